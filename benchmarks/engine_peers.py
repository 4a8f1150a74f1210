"""The systems ``benchmarks/engine.py`` compares, and the checkpoints they all load.

* kvharbor: ``Engine.step`` loop in this process (``LLM(model=checkpoint_dir)``).
* vLLM-CPU: ``benchmarks/vllm_peer.py`` in vLLM's own venv and process (see docs/benchmarks.md).
* transformers ``generate_batch`` (continuous batching) on the same weights, in this process.

Every system gets the same token-id prompts, greedy decoding with EOS ignored, the same KV
capacity in tokens, per-step token budget and maximum sequences; every timed run starts from
an empty prefix cache; model loading, compilation and a warm-up happen outside the timers.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import RESULTS, bar_panels, machine, median, pct, result_name, write_json

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Limits:
    """What every engine gets: KV capacity in tokens, per-step token budget, max sequences."""

    kv_tokens: int = 65536
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048


def add_peer_arguments(ap, requests: int, output_tokens: int) -> None:
    """The options every kvharbor-vs-vLLM benchmark takes (the workload, both engines' block
    sizes, vLLM's venv, the checkpoint directory, the result tag, the pause between rounds)."""
    ap.add_argument("--requests", type=int, default=requests)
    ap.add_argument("--output-tokens", type=int, default=output_tokens)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (report other seeds too)")
    ap.add_argument("--block-size", type=int, default=16, help="kvharbor's KV block size")
    ap.add_argument("--vllm-block-size", type=int, default=128, help="vLLM's (CPU: multiple of 32)")
    ap.add_argument("--vllm-python", default=os.environ.get("KVH_VLLM_PYTHON"),
                    help="python of the venv holding vllm-cpu (see docs/benchmarks.md); none: skip")
    ap.add_argument("--checkpoints", default="/tmp/kvh-bench-checkpoints")
    ap.add_argument("--tag", type=result_name, default="", help="suffix of the result file names")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="pause before every timed round and TTFT, either system: vLLM's worker "
                         "busy-polls a core for ~1 s after each call, which would land on "
                         "kvharbor's next round")


MODELS = {
    # name: (how to build, prompt id range)
    "tiny-llama": "builtin kvharbor/tiny-llama (trained weights, hidden 256, 4 layers, 8/2 heads)",
    "llama-135m": "random-weight Llama shaped like SmolLM2-135M (hidden 576, 30 layers, 9/3 heads, "
                  "vocab 49,152)",
}


def export_checkpoint(model: str, root: Path) -> Path:
    """Write ``model`` as a transformers checkpoint (config, safetensors, tokenizer) under ``root``."""
    out = root / model
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if model == "tiny-llama":
        from kvharbor.engine.models import load_model

        loaded = load_model("kvharbor/tiny-llama", torch.float32, torch.device("cpu"))
        hf, tok = loaded.model, loaded.tokenizer
    else:
        hf, tok = _llama_135m()
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def word_level_tokenizer(vocab: int):
    """Token ``i`` spelled ``t{i}``, split on whitespace (pad/unk t0, bos t1, eos t2): a
    tokenizer for random-weight checkpoints whose benchmarks feed token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wl = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="t0", pad_token="t0",
                                   bos_token="t1", eos_token="t2")


def _llama_135m():
    from transformers import AutoModelForCausalLM, LlamaConfig

    vocab = 49152
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      initializer_range=0.04)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model, word_level_tokenizer(vocab)


def alternate(args, ours, peer: "VllmPeer | None", **peer_round) -> tuple[list[dict], list[dict]]:
    """``args.rounds`` timed rounds of ``ours()`` and, when there is a peer, of its ``round``
    command (``peer_round``: the command's fields), alternating so both see the same load, each
    after ``args.settle_s`` of rest; the peer is closed at the end."""
    mine, theirs = [], []
    try:
        for _ in range(args.rounds):
            time.sleep(args.settle_s)
            mine.append(ours())
            if peer:
                time.sleep(args.settle_s)
                theirs.append(peer.call("round", **peer_round))
    finally:
        if peer:
            peer.close()
    return mine, theirs


def peer_workload(args, limits: Limits, **extra) -> dict:
    """The ``workload`` of a kvharbor-vs-vLLM result: the options ``add_peer_arguments`` took,
    the shared ``limits`` and the benchmark's own ``extra`` fields."""
    return {"model": args.model, "describe": MODELS[args.model], "requests": args.requests,
            "prompt_tokens": "64-512", "seed": args.seed, **extra, "rounds": args.rounds,
            "dtype": "float32", "settle_s": args.settle_s, "kv_tokens": limits.kv_tokens,
            "block_size": args.block_size, "vllm_block_size": args.vllm_block_size,
            "max_num_batched_tokens": limits.max_num_batched_tokens, "max_num_seqs": limits.max_num_seqs}


def workload(n: int, vocab: int, seed: int, lo: int = 64, hi: int = 512) -> list[list[int]]:
    """``n`` prompts of ``lo..hi`` token ids drawn from ``3..vocab`` (no special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _summary(system: str, rounds: list[dict], outputs, start_s: float | None = None) -> dict:
    rates = [r["output_tokens"] / r["elapsed_s"] for r in rounds]
    ttft = rounds[-1]["ttft_s"]
    row = {"system": system, "output_tokens_per_s": median(rates), "rounds_tokens_per_s": rates,
           "elapsed_s": median([r["elapsed_s"] for r in rounds]),
           "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "outputs": outputs}
    if start_s is not None:
        row["start_s"] = start_s
    return row


# ---- kvharbor ---------------------------------------------------------------------------------
def kvharbor_llm(checkpoint: Path, limits: Limits, block_size: int, **engine):
    """kvharbor's ``LLM`` of ``checkpoint`` under ``limits`` (``engine``: more EngineConfig fields)."""
    from kvharbor import LLM

    return LLM(model=str(checkpoint), device="cpu", dtype="float32", block_size=block_size,
               num_kv_blocks=limits.kv_tokens // block_size,
               max_num_batched_tokens=limits.max_num_batched_tokens,
               max_num_seqs=limits.max_num_seqs, max_model_len=limits.max_model_len, **engine)


def start(args):
    """``(machine info, limits, checkpoint, kvharbor's LLM)`` for a benchmark's parsed ``args``
    (``--model``, ``--checkpoints``, ``--block-size``): the machine is read before anything
    loads; the bytes kvharbor's process holds in huge pages once its engine is built, and the
    row counts its CPU products chose at start (``cpu_linear.few_rows`` / ``many_rows``, and
    from how many rows the few-row product is ``cpu_gemv``'s kernel)."""
    from kvharbor.engine import host_memory

    info, limits = machine(), Limits()
    ckpt = export_checkpoint(args.model, Path(args.checkpoints))
    llm = kvharbor_llm(ckpt, limits, args.block_size)
    info["kvharbor_host_huge_page_bytes"] = host_memory.huge_page_bytes()
    fast = llm.engine.runner.fast
    if fast is not None and fast.projections and hasattr(fast.projections[0], "linears"):
        layer = fast.projections[0].linears()[0]
        info["kvharbor_few_rows"], info["kvharbor_many_rows"] = layer.few_rows, layer.many_rows
        info["kvharbor_gemv_from"] = layer.gemv_from if layer.panels is not None else None
    return info, limits, ckpt, llm


def kvharbor_round(llm, prompts, out_tokens: int | list[int], structured: list[dict] | None = None,
                   loras: list[str | None] | None = None) -> dict:
    """One timed step loop over ``prompts`` from an empty prefix cache (also counting the prompt
    tokens read from the prefix cache, ``cached_tokens``, as vLLM's peer does); EOS ignored, or with
    ``structured`` request ``i`` follows ``structured[i]`` (``structured_outputs`` fields) and
    ends with its grammar. ``out_tokens``: the cap of every request, or of each. ``loras``:
    request ``i`` generates with the loaded LoRA adapter ``loras[i]``."""
    from kvharbor import SamplingParams

    engine = llm.engine
    engine.pool.evict_all_cached()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, SamplingParams(
            max_tokens=out_tokens[i] if isinstance(out_tokens, list) else out_tokens,
            temperature=0, ignore_eos=structured is None,
            structured_outputs=structured[i] if structured else None), lora=loras[i] if loras else None)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                tokens[out.request_id] = out.token_ids
                cached += out.num_cached_tokens
    elapsed = time.perf_counter() - start
    outputs = [tokens[f"bench-{i}"] for i in range(len(prompts))]
    return {"elapsed_s": elapsed, "output_tokens": sum(map(len, outputs)), "cached_tokens": cached,
            "ttft_s": sorted(v - start for v in first.values()), "outputs": outputs}


def kvharbor_summary(rounds: list[dict]) -> dict:
    return _summary("kvharbor", rounds, rounds[-1]["outputs"])


def kvharbor_cold_ttft(llm, prompt) -> float:
    """Seconds to the first token of ``prompt`` alone, from an empty prefix cache."""
    from kvharbor import SamplingParams

    llm.engine.pool.evict_all_cached()
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - t0


# ---- vLLM-CPU ---------------------------------------------------------------------------------
def vllm_env(scratch: Path, huge_pages: bool = False) -> dict:
    """Environment for vLLM's CPU build: its 2 cores, scratch caches, tcmalloc + Intel OpenMP
    preloaded when found (vLLM's CPU docs ask for both). torch's huge pages
    (``THP_MEM_ALLOC_ENABLE``, which importing kvharbor's engine sets in this process) only
    with ``huge_pages``: vLLM as it ships does not ask for them."""
    env = dict(os.environ)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    if huge_pages:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        env[key] = str(scratch / key.lower())
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env["PYTHONPATH"] = ""
    return env


def preload_libs(python: str) -> list[str]:
    """tcmalloc and libiomp5 for vLLM, if present (``KVH_TCMALLOC`` overrides the search)."""
    venv = Path(python).absolute().parent.parent      # not resolve(): that leaves the venv
    found = [str(p) for p in [Path(os.environ.get("KVH_TCMALLOC", "/nonexistent")),
                              Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                              ROOT / ".sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"]
             if p.is_file()][:1]
    iomp = venv / "lib" / "libiomp5.so"
    return found + ([str(iomp)] if iomp.is_file() else [])


class VllmPeer:
    """vLLM-CPU in its own venv and process (``benchmarks/vllm_peer.py``), driven one command
    at a time so its timed rounds can alternate with kvharbor's. Starting it (model load and
    vLLM's torch.compile) happens in the constructor, outside every timer."""

    def __init__(self, python: str, checkpoint: Path, prompts, out_tokens: int, limits: Limits,
                 block_size: int, ttft_prompts, structured: list[dict] | None = None,
                 loras: dict | None = None, speculative: dict | None = None,
                 huge_pages: bool = False, script: str = "vllm_peer.py") -> None:
        """``script``: the peer's program in ``benchmarks/`` (``vllm_embed_peer.py``: vLLM as
        an embedding model). ``loras``: ``{"paths": [...], "of": [adapter index of each prompt], "rank": r}``
        (vLLM then runs with ``enable_lora``; ``round`` with ``lora=True`` uses them).
        ``huge_pages``: vLLM's torch allocates in huge pages as kvharbor's does (see
        :func:`vllm_env`); its system name then says so."""
        from transformers import AutoConfig

        from kvharbor.engine.model_runner import kv_bytes_per_token

        cfg = AutoConfig.from_pretrained(checkpoint)
        self.tmp = Path(tempfile.mkdtemp(prefix="kvh-vllm-"))
        spec = {"checkpoint": str(checkpoint), "prompts": prompts, "output_tokens": out_tokens,
                "warmup_prompts": prompts[:4], "ttft_prompts": ttft_prompts,
                "block_size": block_size, "max_num_batched_tokens": limits.max_num_batched_tokens,
                "max_num_seqs": limits.max_num_seqs, "max_model_len": limits.max_model_len,
                "kv_cache_bytes": limits.kv_tokens * kv_bytes_per_token(cfg, torch.float32),
                "structured": structured, "loras": loras, "speculative": speculative}
        (self.tmp / "spec.json").write_text(json.dumps(spec))
        env = vllm_env(self.tmp, huge_pages)
        self.preloaded = preload_libs(python)
        if self.preloaded:
            env["LD_PRELOAD"] = ":".join(self.preloaded)
        read_fd, write_fd = os.pipe()
        self.log = open(self.tmp / "vllm.log", "w")
        self.proc = subprocess.Popen(
            [python, str(ROOT / "benchmarks" / script), str(self.tmp / "spec.json"), str(write_fd)],
            env=env, cwd=str(self.tmp), stdin=subprocess.PIPE, stdout=self.log,
            stderr=subprocess.STDOUT, text=True, pass_fds=(write_fd,))
        os.close(write_fd)
        self.answers = os.fdopen(read_fd)
        ready = self._read()
        self.version, self.start_s = ready["vllm_version"], ready["start_s"]
        self.system = f"vLLM-CPU {self.version}" + (" + huge pages" if huge_pages else "")

    def _read(self) -> dict:
        line = self.answers.readline()
        if not line:
            self.proc.wait()
            tail = (self.tmp / "vllm.log").read_text()[-6000:]
            raise RuntimeError(f"vLLM peer exited ({self.proc.returncode}); its log ends:\n{tail}")
        return json.loads(line)

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        self.log.close()

    def summary(self, rounds: list[dict]) -> dict:
        row = _summary(self.system, rounds, rounds[-1]["outputs"], self.start_s)
        row["preloaded"] = [Path(p).name for p in self.preloaded]
        return row


# ---- transformers ------------------------------------------------------------------------------
def run_transformers_cb(checkpoint: Path, prompts, out_tokens: int, limits: Limits) -> dict:
    """transformers' continuous batching on the same weights (model load + warm-up untimed)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.set_attn_implementation("paged|sdpa")
    cfg = GenerationConfig(max_new_tokens=out_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0,
                           num_blocks=limits.kv_tokens // 16, block_size=16,
                           max_batch_tokens=limits.max_num_batched_tokens)
    warm = GenerationConfig(**{**cfg.to_dict(), "max_new_tokens": 2})
    model.generate_batch(inputs=prompts[:2], generation_config=warm)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=cfg, record_timestamps=True)
    elapsed = time.perf_counter() - start
    ordered = sorted(outs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    outputs = [list(o.generated_tokens) for o in ordered]
    ttft = sorted(o.timestamps[0] - o.created_time for o in ordered if o.timestamps)
    rnd = {"elapsed_s": elapsed, "output_tokens": sum(map(len, outputs)), "ttft_s": ttft}
    return _summary("transformers generate_batch", [rnd], outputs)


def mode_rows(runs: dict[tuple[str, str], list[dict]]) -> list[dict]:
    """One row per (system, mode) of the benchmarks whose rounds alternate modes: median
    tokens/s and seconds over its rounds, the last round's token count and outputs."""
    return [{"system": system, "mode": mode,
             "output_tokens_per_s": median([r["output_tokens"] / r["elapsed_s"] for r in rounds]),
             "elapsed_s": median([r["elapsed_s"] for r in rounds]),
             "output_tokens": rounds[-1]["output_tokens"], "outputs": rounds[-1]["outputs"]}
            for (system, mode), rounds in runs.items()]


def save_mode_rounds(name: str, payload: dict, rows: list[dict], runs: dict, requests: int) -> None:
    """``payload`` with ``rows`` and each (system, mode)'s round rates as
    results/<name>.json, and the rows' tokens/s and seconds per round as <name>.png (the
    benchmarks whose rounds alternate modes: structured.py, lora.py)."""
    write_json(name, {**payload, "rows": rows,
                      "rounds_tokens_per_s": {f"{s} {m}": [r["output_tokens"] / r["elapsed_s"] for r in v]
                                              for (s, m), v in runs.items()}})
    labels = [f"{r['system']}\n{r['mode']}" for r in rows]
    bar_panels(labels, [([r["output_tokens_per_s"] for r in rows], f"output tokens/s, {requests} requests"),
                        ([r["elapsed_s"] for r in rows], "seconds per round")], RESULTS / f"{name}.png")


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Same lengths? How many requests equal token for token, and the share of equal tokens
    up to each request's first difference (greedy tokens after a divergence differ anyway)."""
    same_len = len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b))
    exact = sum(x == y for x, y in zip(a, b))
    prefix = 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix += n
    total = sum(map(len, a)) or 1
    return {"same_lengths": same_len, "requests_identical": exact, "requests": len(a),
            "tokens_before_first_divergence": prefix / total}
