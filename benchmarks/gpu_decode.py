"""Decode on a GPU against its roofline: kvharbor's engine on a >= 0.5B random-weight model.

``--batch`` sequences (default 64) with ``--prompt``-token prompts (default 512) are prefilled,
then decode steps (every sequence one token) are timed two ways:

- forward: the model's step alone (``ModelRunner.forward_logits``, batch upload included),
  between CUDA events on the stream: GPU time including the gaps while the host launches
  (steps that wait for their tokens only);
- step:    ``Engine.step()`` wall time (scheduling, upload, forward, sampling, detokenizing).
  With decode steps run ahead (``async_scheduling``), a call launches the next step and then
  collects the one before, so in steady state a call lasts one step's period.

::

    roofline = (weight bytes + KV bytes the step reads) / HBM bandwidth

with the bandwidth measured in the same run (a device-to-device copy of 2 GiB, bytes read plus
written over the median time) and the datasheet peak beside it. Each mode (``--modes``:
``graphs``, kvharbor's default on CUDA: decode batches replayed from CUDA graphs of the fused
Triton layer path, each step launched before the previous one's tokens are read;
``graphs-sync``: the same with ``async_scheduling`` off, every step waiting for its tokens;
``graphs-modules``: the graphs over transformers' modules op by op; ``eager``:
``enforce_eager=True``, the fused path launched op by op, waiting) builds its own engine on
the same checkpoint; their greedy tokens are checked to be the same length and reported with
how many agree with the first mode's. For graph modes the captured full-batch graph is also
replayed alone (``graph_replay_ms``: GPU time with no host work between steps).

Models (random weights, real shapes; a checkpoint is written once under ``--checkpoints``):
``llama-1b`` (Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, vocab 128,256, 1.24B) and
``qwen2-0.5b`` (Qwen2.5-0.5B: hidden 896, 24 layers, 14/2 heads, vocab 151,936, 0.49B).

Needs a CUDA GPU: without one it says so and exits (status 0) without writing anything.

Run:  python benchmarks/gpu_decode.py --model llama-1b qwen2-0.5b --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=64, rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen2-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                 head_dim=64, rope_theta=1000000.0, tie_word_embeddings=True)),
}


def export_checkpoint(name: str, root: Path) -> Path:
    """A transformers checkpoint (bf16 random weights, a word-level tokenizer) of shape ``name``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from benchmarks.engine_peers import word_level_tokenizer

    out = root / name
    if (out / "config.json").is_file():
        return out
    family, shape = SHAPES[name]
    cls = LlamaConfig if family == "llama" else Qwen2Config
    cfg = cls(**shape, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.02)
    with torch.random.fork_rng(devices=[]), torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tok = word_level_tokenizer(shape["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def copy_bandwidth_gbps(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read plus written over the median of ``reps`` copies."""
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    times = []
    for i in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


KERNEL_GROUPS = (            # (group, substrings of a kernel's name), first match wins
    ("attention", ("_paged_attn_kernel", "_reduce_splits_kernel")),
    ("store_kv", ("_store_kv_kernel",)),
    ("norm", ("_norm_kernel",)),
    ("rotary", ("_rotary_kernel",)),
    ("silu_mul", ("_silu_mul_kernel",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "sm90_")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k.lower() in low for k in keys)), "other")


def profile_kernels(replay, n: int) -> dict:
    """GPU time per step of each kernel in ``n`` calls of ``replay`` (a graph's replay), from
    torch.profiler's CUDA activity (CUPTI records the kernels inside a graph one by one):
    the kernels by total time, the sum per group, and the sum against the replay's own time
    (the difference is the gaps between kernels)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    try:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            s.record()
            for _ in range(n):
                replay()
            e.record()
            e.synchronize()
        wall_us = 1e3 * s.elapsed_time(e) / n
        rows = []
        for evt in prof.key_averages():
            if str(getattr(evt, "device_type", "")).split(".")[-1] != "CUDA":
                continue
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0.0)
            rows.append(dict(name=evt.key[:160], group=kernel_group(evt.key),
                             calls_per_step=evt.count / n, us_per_step=us / n))
        rows.sort(key=lambda r: -r["us_per_step"])
        groups: dict[str, dict] = {}
        for r in rows:
            g = groups.setdefault(r["group"], dict(us_per_step=0.0, calls_per_step=0.0))
            g["us_per_step"] += r["us_per_step"]
            g["calls_per_step"] += r["calls_per_step"]
        total = sum(r["us_per_step"] for r in rows)
        return dict(replays=n, replay_us_under_profiler=wall_us, kernel_us_per_step=total,
                    gaps_us_per_step=wall_us - total,
                    kernel_calls_per_step=sum(r["calls_per_step"] for r in rows),
                    groups=dict(sorted(groups.items(), key=lambda kv: -kv[1]["us_per_step"])),
                    kernels=rows[:40])
    except Exception as exc:           # a profiler that cannot trace graphs: say so, go on
        return dict(error=f"{type(exc).__name__}: {exc}")


def run_mode(ckpt: Path, mode: str, args, prompts: list[list[int]]) -> dict:
    """Prefill ``prompts``, then time ``args.steps`` decode steps of the whole batch."""
    from kvharbor import LLM, SamplingParams
    from kvharbor.config import EngineConfig

    from kvharbor.engine.decode_graphs import DecodeGraphs
    from kvharbor.engine.fast_model import FastCausalLM

    kw = {}
    if "enforce_eager" in EngineConfig.model_fields:
        kw["enforce_eager"] = mode == "eager"
    elif mode != "eager":
        return {"mode": mode, "skipped": "this kvharbor has no CUDA graphs (enforce_eager)"}
    need = len(prompts) * (args.prompt + args.warmup + args.steps + 2)
    t0 = time.perf_counter()
    llm = LLM(model=str(ckpt), device="cuda", dtype="bfloat16", block_size=16,
              num_kv_blocks=need // 16 + 64 + len(prompts), max_num_seqs=len(prompts),
              max_num_batched_tokens=args.budget or len(prompts) * args.prompt, **kw)
    engine, runner = llm.engine, llm.engine.runner
    if mode == "graphs-modules":     # transformers' modules per op instead of the fused Triton ops
        runner.fast = FastCausalLM(runner.model, triton=False)
        runner.graphs = DecodeGraphs(runner, len(prompts), engine.max_model_len)
    setup_s = time.perf_counter() - t0
    fused = getattr(runner.fast, "triton", False)
    weight_bytes = sum(p.nbytes for p in runner.model.parameters())
    kv_per_token = runner.kv_bytes_per_token
    if mode == "graphs-sync":
        engine.async_scheduling = False
    events: list = []          # (start, end event or None, full-batch decode, kv tokens) per step

    forward = runner.forward_logits

    def timed_forward(batch):                 # steps that wait: GPU time between CUDA events
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = forward(batch)
        e.record()
        decode = all(item.num_new_tokens == 1 for item in batch) and len(batch) == len(prompts)
        events.append((s, e, decode, sum(item.request.num_computed_tokens + 1 for item in batch)))
        return out

    runner.forward_logits = timed_forward
    launch = runner.launch

    def timed_launch(batch, ahead=0, prev=None):   # steps run ahead: no GPU time of their own
        kv = sum(item.request.num_computed_tokens + 1 + ahead for item in batch)
        events.append((None, None, len(batch) == len(prompts), kv))
        return launch(batch, ahead, prev)

    runner.launch = timed_launch
    execute, execute_s = runner.execute, []

    def timed_execute(batch):                 # forward + sampling (its host sync) on the host clock
        t = time.perf_counter()
        out = execute(batch)
        execute_s.append(time.perf_counter() - t)
        return out

    runner.execute = timed_execute
    sp = SamplingParams(max_tokens=args.warmup + args.steps, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    step_s, outside_s, outputs = [], [], {}
    decode_steps = 0
    while engine.has_unfinished():
        n_before, n_exec = len(events), len(execute_s)
        t = time.perf_counter()
        for out in engine.step():
            if out.finish_reason is not None:
                outputs[out.request_id] = list(out.token_ids)
        dt = time.perf_counter() - t
        # A step call that started a full-batch decode step (run ahead: it also collected the
        # one before, so in steady state one call is one step's period).
        if len(events) > n_before and events[-1][2]:
            decode_steps += 1
            if args.warmup < decode_steps <= args.warmup + args.steps - 2:
                step_s.append(dt)
                if len(execute_s) > n_exec:
                    outside_s.append(dt - execute_s[-1])
    torch.cuda.synchronize()
    replay_ms, kernel_profile = None, None
    if runner.graphs is not None:     # the captured full-batch graph alone: GPU time, no host work
        graph = next((g for (b, _), (g, _) in runner.graphs.graphs.items() if b == len(prompts)), None)
        if graph is not None:
            times = []
            for i in range(23):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                if i >= 3:
                    times.append(s.elapsed_time(e))
            replay_ms = statistics.median(times)
            if args.profile_replays:
                kernel_profile = profile_kernels(graph.replay, args.profile_replays)
    full = [(s, e, kv) for s, e, dec, kv in events if dec][args.warmup:]
    fwd_s = [s.elapsed_time(e) / 1e3 for s, e, _ in full if s is not None]
    kv_bytes = statistics.median(kv for _, _, kv in full) * kv_per_token
    ms = (lambda f, xs: 1e3 * f(xs) if xs else None)
    row = {"mode": mode, "fused_triton_ops": fused, "graph_replay_ms_p50": replay_ms,
           "async_scheduling": engine.async_scheduling, "steps_run_ahead": engine.steps_ahead,
           "setup_s": setup_s, "steps_timed": len(step_s),
           "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
           "forward_ms_p50": ms(statistics.median, fwd_s), "forward_ms_min": ms(min, fwd_s),
           "step_ms_p50": ms(statistics.median, step_s), "step_ms_min": ms(min, step_s),
           "step_ms_mean": ms(statistics.fmean, step_s),
           "outside_execute_ms_p50": ms(statistics.median, outside_s),
           "graph_replays": runner.graphs.replays if runner.graphs is not None else 0,
           "replay_kernels": kernel_profile,
           "tokens": [outputs[f"r{i}"] for i in range(len(prompts))]}
    del llm, engine, runner
    torch.cuda.empty_cache()
    return row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", choices=sorted(SHAPES), default=["llama-1b"])
    p.add_argument("--modes", nargs="+", choices=["graphs", "graphs-sync", "graphs-modules", "eager"],
                   default=["graphs", "graphs-sync", "graphs-modules", "eager"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--budget", type=int, default=None,
                   help="max_num_batched_tokens (default: batch x prompt, one prefill step, so "
                        "every sequence decodes in the same steps)")
    p.add_argument("--profile-replays", type=int, default=0,
                   help="also trace this many replays of the full-batch graph with "
                        "torch.profiler and report GPU time per kernel and per group")
    p.add_argument("--blas", nargs="+", choices=["default", "cublas", "cublaslt"],
                   default=["default"],
                   help="torch's BLAS library for the products (torch.backends.cuda."
                        "preferred_blas_library), set before each engine is built so its graphs "
                        "capture that library's kernels; several values run every mode under "
                        "each, in the order given (repeat them to alternate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoints", type=Path, default=Path("/tmp/kvh-gpu-checkpoints"))
    p.add_argument("--peak-gbps", type=float, default=None)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the result file names")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from benchmarks.attention_kernels import detect_peak_gbps

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu_decode.py: no CUDA GPU on this machine. Nothing was measured or written.",
              file=sys.stderr)
        return 0
    name = torch.cuda.get_device_name(0)
    peak = args.peak_gbps or detect_peak_gbps(name)
    bw = copy_bandwidth_gbps()
    rows = []
    for model in args.model:
        ckpt = export_checkpoint(model, args.checkpoints)
        vocab = SHAPES[model][1]["vocab_size"]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
        results = []
        for blas in args.blas:
            torch.backends.cuda.preferred_blas_library(blas)
            for mode in args.modes:
                results.append(dict(run_mode(ckpt, mode, args, prompts), blas=blas))
        torch.backends.cuda.preferred_blas_library("default")
        ran = [r for r in results if "skipped" not in r]
        ref = ran[0]["tokens"] if ran else None
        for r in results:
            r["model"] = model
            if "skipped" in r:
                rows.append(r)
                continue
            toks = r.pop("tokens")
            assert all(len(t) == args.warmup + args.steps for t in toks), "an output has the wrong length"
            r["tokens_agree_with_first_mode"] = sum(a == b for t, u in zip(toks, ref) for a, b in zip(t, u))
            r["tokens_total"] = sum(len(t) for t in toks)
            moved = r["weight_bytes"] + r["kv_bytes_per_step"]
            r["roofline_ms_measured_bw"] = 1e3 * moved / (bw * 1e9)
            r["roofline_ms_peak"] = 1e3 * moved / (peak * 1e9) if peak else None
            r["forward_x_roofline"] = (r["forward_ms_p50"] / r["roofline_ms_measured_bw"]
                                       if r["forward_ms_p50"] is not None else None)
            r["step_x_roofline"] = r["step_ms_p50"] / r["roofline_ms_measured_bw"]
            rows.append(r)
    print(f"{name}; copy bandwidth {bw:.0f} GB/s (datasheet {peak} GB/s); batch {args.batch}, "
          f"prompt {args.prompt}, {args.steps} timed decode steps after {args.warmup}")
    cols = ("model", "mode", "blas", "steps_run_ahead", "graph_replay_ms_p50", "forward_ms_p50", "step_ms_p50",
            "step_ms_mean", "outside_execute_ms_p50",
            "roofline_ms_measured_bw",
            "forward_x_roofline", "step_x_roofline", "tokens_agree_with_first_mode", "setup_s")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r.get(c):.3f}" if isinstance(r.get(c), float) else str(r.get(c, r.get("skipped")))
                         for c in cols))
    for r in rows:
        prof = r.get("replay_kernels")
        if not prof:
            continue
        if "error" in prof:
            print(f"{r['model']} {r['mode']}: kernel profile failed: {prof['error']}")
            continue
        print(f"{r['model']} {r['mode']} ({r['blas']}): replay {prof['replay_us_under_profiler']:.1f} us under the "
              f"profiler, kernels {prof['kernel_us_per_step']:.1f} us in "
              f"{prof['kernel_calls_per_step']:.0f} launches, gaps {prof['gaps_us_per_step']:.1f} us")
        for g, v in prof["groups"].items():
            print(f"    {g:<10} {v['us_per_step']:8.1f} us  {v['calls_per_step']:6.1f} kernels")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=name, copy_gbps=bw, peak_gbps=peak, batch=args.batch, prompt=args.prompt,
                steps=args.steps, warmup=args.warmup, torch=torch.__version__,
                triton=__import__("triton").__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    stem = f"gpu_decode{args.tag}"
    (args.out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    plot(rows, args.out / f"{stem}.png", name, args.batch)
    print(f"wrote {args.out / stem}.json and {stem}.png")
    return 0


def plot(rows: list[dict], path: Path, title: str, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "skipped" not in r]
    labels = [f"{r['model']}\n{r['mode']}" + (f"\n{r['blas']}" if r.get("blas", "default") != "default" else "")
              for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 2.2 * len(rows)), 4))
    ax.bar([i - 0.27 for i in x], [r["roofline_ms_measured_bw"] for r in rows], 0.27, label="roofline")
    ax.bar(list(x), [r["forward_ms_p50"] or 0 for r in rows], 0.27, label="forward (CUDA events)")
    ax.bar([i + 0.27 for i in x], [r["step_ms_p50"] for r in rows], 0.27, label="engine step (wall)")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set(ylabel="ms per decode step", title=f"decode step, batch {batch}, {title}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
