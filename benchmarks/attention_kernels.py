"""Decode attention bandwidth: kvharbor's Triton paged attention vs torch SDPA, side by side.

For each (batch, context) point, one decode token per sequence attends over a bf16 paged
cache (block size 16, head dim 128, 32 query / 8 KV heads, blocks scattered at random). The
Triton backend reads the paged cache directly; the baseline is
``F.scaled_dot_product_attention`` over K/V already gathered into contiguous tensors (the
gather is not timed, so the baseline is the best a contiguous layout can do).

    achieved GB/s = bytes of K and V read (+ q, out) / kernel time
    % of peak     = achieved / HBM peak (H100 SXM 3350, H100 PCIe 2000, H100 NVL 3900,
                    H200 4800 GB/s; --peak-gbps overrides)

Times are medians of ``triton.testing.do_bench_cudagraph`` (kernel time without Python
launch overhead; plain ``do_bench`` if graph capture fails). Prints a
table and writes ``results/kernels_decode.json`` and ``results/kernels_decode.png``.
Needs a CUDA GPU: without one it says so and exits (status 0) without writing anything.

Run:  python benchmarks/attention_kernels.py
      python benchmarks/attention_kernels.py --batch 1 8 --context 1024 16384 --peak-gbps 3350
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
# Substring of torch.cuda.get_device_name() -> HBM peak in GB/s (first match wins).
HBM_PEAK_GBPS = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0),
                 ("H100", 3350.0))


def detect_peak_gbps(device_name: str) -> float | None:
    """HBM peak of a known GPU from its name, else None."""
    for key, peak in HBM_PEAK_GBPS:
        if key in device_name:
            return peak
    return None


def make_case(batch: int, context: int, args, device) -> dict:
    """A decode batch over a paged bf16 cache with randomly placed blocks, plus gathered K/V."""
    from kvharbor.kernels import LayerKVCache  # noqa: PLC0415

    bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
    per_seq = -(-context // bs)
    num_blocks = batch * per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, bs, hkv, d)
    cache = LayerKVCache(torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen),
                         torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen))
    perm = torch.randperm(num_blocks, device=device, generator=gen)
    tables = perm.view(batch, per_seq).to(torch.int32)
    query = torch.randn(batch, args.q_heads, d, device=device, dtype=torch.bfloat16,
                        generator=gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)

    def gather(c):                                          # [B, Hkv, ctx, D]
        return c[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    return dict(query=query, cache=cache, tables=tables, seq_lens=seq_lens, qsl=qsl,
                k=gather(cache.key), v=gather(cache.value))


def bytes_moved(batch: int, context: int, args) -> int:
    """K and V read once, query read and output written once (bf16)."""
    kv = 2 * batch * context * args.kv_heads * args.head_dim * 2
    return kv + 2 * batch * args.q_heads * args.head_dim * 2


def bench_ms(fn) -> float:
    """Median GPU time of ``fn`` in ms: replayed as a CUDA graph (no launch overhead), or
    with plain CUDA events if capture fails."""
    import triton.testing  # noqa: PLC0415

    try:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    except Exception as e:  # noqa: BLE001 - capture is best effort; say so and fall back
        print(f"  (CUDA graph capture failed: {e!r:.80}; timing with events)", file=sys.stderr)
        return triton.testing.do_bench(fn, return_mode="median")


def measure_point(batch: int, context: int, args, device, num_sms: int) -> dict:
    """Time both implementations at one point; check they agree."""

    from kvharbor.kernels.reference import paged_attention_ref  # noqa: PLC0415
    from kvharbor.kernels.triton_backend import TritonBackend, choose_num_splits  # noqa: PLC0415

    c = make_case(batch, context, args, device)
    scale = args.head_dim ** -0.5

    def triton_fn():
        return TritonBackend.paged_attention(c["query"], c["cache"], c["tables"], c["seq_lens"],
                                             c["qsl"], scale, None, context)

    q4 = c["query"].unsqueeze(2)                             # [B, H, 1, D]

    def sdpa_fn():
        return F.scaled_dot_product_attention(q4, c["k"], c["v"], scale=scale, enable_gqa=True)

    out = triton_fn()
    ref = sdpa_fn().squeeze(2)
    max_err = (out.float() - ref.float()).abs().max().item()
    if batch * context <= 8 * 2048:
        exact = paged_attention_ref(c["query"], c["cache"].key, c["cache"].value, c["tables"],
                                    c["seq_lens"], c["qsl"], scale)
        max_err = max(max_err, (out.float() - exact.float()).abs().max().item())
    t_triton, t_sdpa = bench_ms(triton_fn), bench_ms(sdpa_fn)
    sweep = {}
    if args.sweep_splits:
        import itertools  # noqa: PLC0415

        from kvharbor.kernels.paged_attention import paged_attention  # noqa: PLC0415

        cache = c["cache"]
        decode_paths = args.sweep_decode_only or [0]
        for n, bn, w, st, dec in itertools.product(args.sweep_splits, args.sweep_block_n,
                                                   args.sweep_warps, args.sweep_stages, decode_paths):
            def fn(n=n, bn=bn, w=w, st=st, dec=dec):
                return paged_attention(c["query"], cache.key, cache.value, c["tables"],
                                       c["seq_lens"], c["qsl"], scale, num_splits=n,
                                       block_n=bn, num_warps=w, num_stages=st,
                                       decode_only=bool(dec))
            key = f"s{n}_n{bn or 'd'}_w{w or 'd'}_st{st or 'd'}"
            if args.sweep_decode_only:
                key += f"_dec{dec}"
            try:
                sweep[key] = 1e3 * bench_ms(fn)
            except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory)
                print(f"  {key}: {e!r:.60}", file=sys.stderr)
    nbytes = bytes_moved(batch, context, args)
    del c
    if device.type == "cuda":
        torch.cuda.empty_cache()
    splits = choose_num_splits(batch, batch, args.kv_heads, context, num_sms)
    return dict(batch=batch, context=context, num_splits=splits, bytes=nbytes,
                triton_us=t_triton * 1e3, sdpa_us=t_sdpa * 1e3,
                triton_gbps=nbytes / t_triton / 1e6, sdpa_gbps=nbytes / t_sdpa / 1e6,
                max_abs_err=max_err, **({"sweep_splits_us": sweep} if sweep else {}))


def print_table(rows: list[dict], peak: float | None) -> None:
    pct = (lambda g: f"{100 * g / peak:5.1f}%") if peak else (lambda g: "  n/a")
    print(f"{'batch':>5} {'ctx':>6} {'splits':>6} | {'triton us':>10} {'GB/s':>7} {'%peak':>6} "
          f"| {'sdpa us':>10} {'GB/s':>7} {'%peak':>6} | {'speedup':>7} {'max err':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>6} {r['num_splits']:>6} | "
              f"{r['triton_us']:>10.1f} {r['triton_gbps']:>7.0f} {pct(r['triton_gbps']):>6} | "
              f"{r['sdpa_us']:>10.1f} {r['sdpa_gbps']:>7.0f} {pct(r['sdpa_gbps']):>6} | "
              f"{r['sdpa_us'] / r['triton_us']:>6.2f}x {r['max_abs_err']:>8.1e}")


def plot(rows: list[dict], peak: float | None, title: str, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, batch in enumerate(sorted({r["batch"] for r in rows})):
        pts = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        ctx = [r["context"] for r in pts]
        ax.plot(ctx, [r["triton_gbps"] for r in pts], "-o", color=f"C{i}",
                label=f"triton paged, batch {batch}")
        ax.plot(ctx, [r["sdpa_gbps"] for r in pts], "--x", color=f"C{i}",
                label=f"SDPA contiguous, batch {batch}")
    if peak:
        ax.axhline(peak, color="k", lw=0.8, label=f"HBM peak {peak:.0f} GB/s")
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="achieved GB/s", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="HBM peak in GB/s (default: from the device name)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where JSON and PNG go")
    p.add_argument("--sweep-splits", type=int, nargs="*", default=None,
                   help="also time the kernel with each of these split-K counts forced, "
                        "crossed with the --sweep-block-n/-warps/-stages values (0: default)")
    p.add_argument("--sweep-block-n", type=int, nargs="*", default=[0])
    p.add_argument("--sweep-warps", type=int, nargs="*", default=[0])
    p.add_argument("--sweep-stages", type=int, nargs="*", default=[0])
    p.add_argument("--sweep-decode-only", type=int, nargs="*", default=None,
                   help="also cross the sweep with the kernel's decode path off (0) / on (1); "
                        "the default run (the backend) takes it for these decode batches")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention_kernels.py: no CUDA GPU on this machine - the kernel benchmark "
              "measures GPU memory bandwidth and needs one. Nothing was measured or written.",
              file=sys.stderr)
        return 0
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or detect_peak_gbps(name)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = [measure_point(b, c, args, device, num_sms) for b in args.batch for c in args.context]
    print(f"{name}; HBM peak {peak or 'unknown (pass --peak-gbps)'} GB/s; bf16, head dim "
          f"{args.head_dim}, {args.q_heads}/{args.kv_heads} heads, block {args.block_size}")
    print_table(rows, peak)
    if args.sweep_splits:
        print("sweep (split-K s, keys per step n, warps w, stages st): best configs per point")
        for r in rows:
            times = sorted(r["sweep_splits_us"].items(), key=lambda kv: kv[1])
            gbps = r["bytes"] / (times[0][1] * 1e3)
            print(f"{r['batch']:>5} {r['context']:>6} default {r['triton_us']:7.1f} us | best "
                  + ", ".join(f"{k} {t:.1f}" for k, t in times[:4])
                  + (f" | {100 * gbps / peak:.1f}% peak" if peak else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=name, peak_gbps=peak, head_dim=args.head_dim, q_heads=args.q_heads,
                kv_heads=args.kv_heads, block_size=args.block_size, dtype="bfloat16",
                torch=torch.__version__, triton=__import__("triton").__version__)
    stem = f"kernels_decode{args.tag}"
    (args.out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    plot(rows, peak, f"decode attention, {name}", args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
