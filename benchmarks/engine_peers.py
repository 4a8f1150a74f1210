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
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import median, pct

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Limits:
    """What every engine gets: KV capacity in tokens, per-step token budget, max sequences."""

    kv_tokens: int = 65536
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048


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


def _llama_135m():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = 49152
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      initializer_range=0.04)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    words = {f"t{i}": i for i in range(vocab)}
    wl = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="t0", pad_token="t0",
                                  bos_token="t1", eos_token="t2")
    return model, tok


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
def kvharbor_llm(checkpoint: Path, limits: Limits, block_size: int):
    from kvharbor import LLM

    return LLM(model=str(checkpoint), device="cpu", dtype="float32", block_size=block_size,
               num_kv_blocks=limits.kv_tokens // block_size,
               max_num_batched_tokens=limits.max_num_batched_tokens,
               max_num_seqs=limits.max_num_seqs, max_model_len=limits.max_model_len)


def kvharbor_round(llm, prompts, out_tokens: int) -> dict:
    """One timed step loop over ``prompts`` from an empty prefix cache."""
    from kvharbor import SamplingParams

    engine = llm.engine
    engine.pool.evict_all_cached()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, SamplingParams(max_tokens=out_tokens, temperature=0,
                                                           ignore_eos=True))
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                tokens[out.request_id] = out.token_ids
    elapsed = time.perf_counter() - start
    outputs = [tokens[f"bench-{i}"] for i in range(len(prompts))]
    return {"elapsed_s": elapsed, "output_tokens": sum(map(len, outputs)),
            "ttft_s": sorted(v - start for v in first.values()), "outputs": outputs}


def run_kvharbor(llm, prompts, out_tokens: int, rounds: int) -> dict:
    kvharbor_round(llm, prompts[:4], 4)                                 # warm-up, untimed
    results = [kvharbor_round(llm, prompts, out_tokens) for _ in range(rounds)]
    return _summary("kvharbor", results, results[-1]["outputs"])


def kvharbor_cold_ttft(llm, prompts) -> list[float]:
    from kvharbor import SamplingParams

    out = []
    for p in prompts:
        llm.engine.pool.evict_all_cached()
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        out.append(time.perf_counter() - t0)
    return out


# ---- vLLM-CPU ---------------------------------------------------------------------------------
def vllm_env(scratch: Path) -> dict:
    """Environment for vLLM's CPU build: its 2 cores, scratch caches, tcmalloc + Intel OpenMP
    preloaded when found (vLLM's CPU docs ask for both)."""
    env = dict(os.environ)
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        env[key] = str(scratch / key.lower())
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env["PYTHONPATH"] = ""
    return env


def preload_libs(python: str) -> list[str]:
    """tcmalloc and libiomp5 for vLLM, if present (``KVH_TCMALLOC`` overrides the search)."""
    venv = Path(python).resolve().parent.parent
    found = [str(p) for p in [Path(os.environ.get("KVH_TCMALLOC", "/nonexistent")),
                              Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                              ROOT / ".sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"]
             if p.is_file()][:1]
    iomp = venv / "lib" / "libiomp5.so"
    return found + ([str(iomp)] if iomp.is_file() else [])


def run_vllm(python: str, checkpoint: Path, prompts, out_tokens: int, rounds: int, limits: Limits,
             block_size: int, ttft_prompts, timeout_s: float = 3600) -> tuple[dict, list[float]]:
    """Run vLLM in its own process; returns its summary row and cold TTFTs."""
    with tempfile.TemporaryDirectory(prefix="kvh-vllm-") as tmp:
        tmp = Path(tmp)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(checkpoint)
        from kvharbor.engine.model_runner import kv_bytes_per_token

        spec = {"checkpoint": str(checkpoint), "prompts": prompts, "output_tokens": out_tokens,
                "rounds": rounds, "warmup_prompts": prompts[:4], "ttft_prompts": ttft_prompts,
                "block_size": block_size, "max_num_batched_tokens": limits.max_num_batched_tokens,
                "max_num_seqs": limits.max_num_seqs, "max_model_len": limits.max_model_len,
                "kv_cache_bytes": limits.kv_tokens * kv_bytes_per_token(cfg, torch.float32)}
        (tmp / "spec.json").write_text(json.dumps(spec))
        env = vllm_env(tmp)
        libs = preload_libs(python)
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
        cmd = [python, str(ROOT / "benchmarks" / "vllm_peer.py"), str(tmp / "spec.json"),
               str(tmp / "result.json")]
        proc = subprocess.run(cmd, env=env, cwd=str(tmp), timeout=timeout_s,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise RuntimeError(f"vLLM peer failed with exit status {proc.returncode}")
        res = json.loads((tmp / "result.json").read_text())
    row = _summary(f"vLLM-CPU {res['vllm_version']}", res["rounds"], res["outputs"], res["start_s"])
    row["preloaded"] = [Path(p).name for p in libs]
    return row, res["cold_ttft_s"]


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
