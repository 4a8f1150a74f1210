"""vLLM-CPU side of ``benchmarks/engine.py``: run in vLLM's own venv and process.

    VENV/bin/python benchmarks/vllm_peer.py SPEC.json FD

It imports only the standard library and vllm (never kvharbor: vLLM pins another
transformers). ``SPEC.json`` (written by ``benchmarks/engine.py``) holds the checkpoint
directory, the token-id prompts and the engine limits. It builds ``LLM`` (vLLM's torch.compile
of the model) and runs a warm-up before any timer, writes ``{"ready": ...}`` as one JSON line to
the file descriptor ``FD``, then serves commands, one JSON line each on stdin, answering one
JSON line each on ``FD`` (stdout is left to vLLM's logs): ``{"op": "round"}`` times one step
loop over the spec's prompts from an empty prefix cache (its answer also counts the prompt
tokens read from the prefix cache, ``cached_tokens``) (``"structured": true``: request ``i``
follows the spec's ``structured[i]``, vLLM's ``StructuredOutputsParams`` fields, and ends with
its grammar; else EOS is ignored; ``"caps"``: each request's ``max_tokens``; ``"lora": true``:
request ``i`` with the LoRA adapter ``loras["of"][i]`` of the spec, vLLM built with
``enable_lora``; ``"sequential": true``: the first ``"count"`` prompts (all: null) one at a time, each alone; the spec's
``speculative``: vLLM's ``speculative_config``); ``{"op": "ttft",
"i": n}`` the cold
TTFT of ``ttft_prompts[n]``; ``{"op": "quit"}``. So the benchmark can interleave its rounds
with kvharbor's: on a shared machine both then see the same background load.
"""

from __future__ import annotations

import json
import os
import sys
import time


def build(spec: dict):
    from vllm import LLM

    loras = spec.get("loras")
    lora = {"enable_lora": True, "max_loras": len(loras["paths"]), "max_cpu_loras": len(loras["paths"]),
            "max_lora_rank": loras["rank"]} if loras else {}
    t0 = time.perf_counter()
    llm = LLM(model=spec["checkpoint"], skip_tokenizer_init=not spec.get("structured"), dtype="float32", **lora,
              enable_prefix_caching=True, block_size=spec["block_size"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=spec["max_num_seqs"], kv_cache_memory_bytes=spec["kv_cache_bytes"],
              max_model_len=spec["max_model_len"], seed=0,
              # vLLM reads disable_any_whitespace from here, not from a request's params
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
              speculative_config=spec.get("speculative"))
    return llm, time.perf_counter() - t0


def params(max_tokens: int, structured: dict | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if structured is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(**structured))


def lora_requests(loras: dict | None) -> list | None:
    """Each prompt's ``LoRARequest`` (adapter ``i`` is ``lora-i``, id ``i + 1``)."""
    if not loras:
        return None
    from vllm.lora.request import LoRARequest

    return [LoRARequest(f"lora-{a}", a + 1, loras["paths"][a]) for a in loras["of"]]


def step_loop(llm, prompts: list[list[int]], max_tokens: int | list[int], structured: list | None = None,
              loras: list | None = None) -> dict:
    """Serve ``prompts`` through vLLM's engine step loop (what ``LLM.generate`` runs);
    ``loras``: prompt ``i`` with the LoRA adapter ``loras[i]``."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        sp = params(max_tokens[i] if isinstance(max_tokens, list) else max_tokens,
                    structured[i] if structured else None)
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp,
                           lora_request=loras[i] if loras else None)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                cached += out.num_cached_tokens or 0
    elapsed = time.perf_counter() - start
    outputs = [tokens[str(i)] for i in range(len(prompts))]
    return {"elapsed_s": elapsed, "output_tokens": sum(map(len, outputs)), "cached_tokens": cached,
            "ttft_s": sorted(first[k] - start for k in first), "outputs": outputs}


def one_at_a_time(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """``step_loop`` over each prompt alone, one after another (a single stream)."""
    runs = [step_loop(llm, [p], max_tokens) for p in prompts]
    return {"elapsed_s": sum(r["elapsed_s"] for r in runs), "output_tokens": sum(r["output_tokens"] for r in runs),
            "ttft_s": sorted(r["ttft_s"][0] for r in runs), "outputs": [r["outputs"][0] for r in runs]}


def cold_ttft(llm, prompts: list[list[int]]) -> list[float]:
    """Seconds to the first token of each prompt alone, from an empty prefix cache."""
    from vllm.inputs import TokensPrompt

    out = []
    for p in prompts:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p)], params(1), use_tqdm=False)
        out.append(time.perf_counter() - t0)
    return out


def channel(spec_path: str, fd: str):
    """``(spec, answer)``: the spec file's contents, and a function that writes one JSON line
    to the file descriptor ``fd`` (the benchmark reads it; stdout is vLLM's log)."""
    with open(spec_path) as f:
        spec = json.load(f)
    out = os.fdopen(int(fd), "w")

    def answer(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return spec, answer


def main(spec_path: str, fd: str) -> int:
    spec, answer = channel(spec_path, fd)
    import vllm

    llm, start_s = build(spec)
    step_loop(llm, spec["warmup_prompts"], 4)                    # untimed warm-up
    if spec.get("structured"):                                   # and of the grammars
        step_loop(llm, spec["prompts"], 4, spec["structured"])
    loras = lora_requests(spec.get("loras"))
    if loras:                                                    # and of the adapters (loaded)
        step_loop(llm, spec["prompts"], 4, loras=loras)
    answer({"ready": True, "vllm_version": vllm.__version__, "start_s": start_s})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "round" and cmd.get("sequential"):
            answer(one_at_a_time(llm, spec["prompts"][:cmd.get("count")], spec["output_tokens"]))
        elif cmd["op"] == "round":
            answer(step_loop(llm, spec["prompts"][:cmd.get("count")], cmd.get("caps") or spec["output_tokens"],
                             spec["structured"] if cmd.get("structured") else None,
                             loras if cmd.get("lora") else None))
        elif cmd["op"] == "ttft":
            answer({"ttft_s": cold_ttft(llm, [spec["ttft_prompts"][cmd["i"]]])[0]})
        else:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
