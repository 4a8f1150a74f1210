"""Where an idle premium request's time to first token goes, through HTTP vs in the engine.

One run: the same prompts (premium tenant, 1 generated token, greedy) are timed
  engine   in this process with ``LLM.generate`` on a fresh engine (tiny-llama, CPU), and
  http     one at a time through the kvharbor app (``serve run`` defaults: 2 replicas, KV-aware
           router) on 127.0.0.1, streamed; the client's TTFT is send -> first token chunk.
The app's own breakdown comes back in each stream's usage chunk (``kvharbor.timings_ms``):
proxy (Serve's proxy -> the gateway; Serve's proxy only), parse (the gateway reads and
validates the body), queue, tokenize, admit, first_token (= replica + hops). ``outside`` is
what none of those phases cover: the HTTP round trip, the ingress until it forwards, and the
first token's way back to the client.
Outputs are checked: the token each path produced must match.

The HTTP side runs once per ingress (``--ingress``, default ``direct,proxy``, in one run: a
fresh Ray each): ``direct`` (the one gateway replica serves HTTP itself, kvharbor's default),
``proxy`` (Serve's Python proxy actor in front of the gateway, ``KVHARBOR_INGRESS=proxy``),
``haproxy`` (HAProxy straight to the gateway replicas, ``KVHARBOR_INGRESS=haproxy``) and
``lane`` (``direct``, with ``premium_port`` set, and the requests sent to the premium lane's
port: ``kvharbor.platform.premium_lane``).

Goal (issue #16): idle premium TTFT through HTTP <= engine TTFT + 15 ms on this machine.
Run:  python benchmarks/request_path.py [--requests 60] [--seed 0]    (about 4 minutes)
Writes benchmarks/results/request_path.json (``--name`` another stem).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, pct, result_name, table, write_json  # noqa: E402
from benchmarks.qos import APP_PHASES, guard_config, lifted_tenants, proxy_lag  # noqa: E402

PORT = 18600
LANE_PORT = 18601
PHASES = ["proxy", "parse", "queue", "tokenize", "admit", "first_token", "replica", "hops"]
WORDS = "harbor premium tenant cache block replica route token prefix engine".split()


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def engine_ttfts(texts: list[str], threads: int | None = None) -> tuple[list[float], list[int]]:
    """In-process TTFT (ms) of each prompt alone, and the token each produced; ``threads``:
    torch threads (None: torch's default; the app's replicas run with ``cpu_threads``, 1)."""
    import torch  # noqa: PLC0415

    from kvharbor.engine.llm import LLM  # noqa: PLC0415
    from kvharbor.engine.request import SamplingParams  # noqa: PLC0415

    default = torch.get_num_threads()
    torch.set_num_threads(threads or default)
    try:
        return _engine_ttfts(texts, LLM, SamplingParams)
    finally:
        torch.set_num_threads(default)


def _engine_ttfts(texts, LLM, SamplingParams) -> tuple[list[float], list[int]]:  # noqa: N803
    llm = LLM("kvharbor/tiny-llama", device="cpu")
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(texts[:4], params)                                    # warm-up
    times, tokens = [], []
    for text in texts:
        start = time.perf_counter()
        out = llm.generate(text, params)[0]
        times.append((time.perf_counter() - start) * 1000)
        tokens.append(out.token_ids[0])
    return times, tokens


def http_ttfts(base: str, texts: list[str]) -> tuple[list[float], list[dict], list[str], dict]:
    """Client TTFT (ms), the app's timings and the text of the token, per prompt, one at a time,
    and how many requests each transport served (``kvharbor.transport``)."""
    times, timings, texts_out, transports = [], [], [], {}
    headers = {"Authorization": "Bearer kvh-demo-premium"}
    with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
        for i, text in enumerate([*texts[:4], *texts]):                 # 4 warm-up requests
            body = {"model": "kvharbor/tiny-llama", "prompt": text, "max_tokens": 1, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            start, first, usage, token = time.perf_counter(), None, None, ""
            with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and first is None:
                        first, token = time.perf_counter(), chunk["choices"][0]["text"]
                    if "usage" in chunk:
                        usage = chunk
            if i >= 4:
                times.append((first - start) * 1000)
                timings.append(usage["kvharbor"]["timings_ms"])
                texts_out.append(token)
                via = str(usage["kvharbor"].get("transport"))
                transports[via] = transports.get(via, 0) + 1
    return times, timings, texts_out, transports


def serve_app(tenants: Path, ingress: str, overload_lag_ms: str | None = None,
              proxy_guard: str = "on", direct_streams: bool = True) -> str:
    """Start Ray with ``ingress`` (``kvharbor.platform.ingress``) and the app on it. -> the base
    URL the requests go to. ``lane``: the direct ingress with the premium lane deployed
    (``build_app premium_port``), and the lane's URL."""
    lane = ingress == "lane"
    ingress = "direct" if lane else ingress
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from kvharbor.platform.app import build_app, wait_until_healthy  # noqa: PLC0415
    from kvharbor.platform.ingress import http_options, starting_cluster  # noqa: PLC0415

    with starting_cluster(ingress, proxy_lag(overload_lag_ms, proxy_guard), port=PORT) as mode:
        if mode != ingress:
            raise SystemExit(f"ingress {ingress!r} is not available here")
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(http_options=http_options(mode, PORT))
    config = {"tenants": str(tenants), "directory_name": "request-path-directory",
              "direct_streams": direct_streams,
              **guard_config(overload_lag_ms), **({"premium_port": LANE_PORT} if lane else {})}
    serve.run(build_app(config), name="kvharbor", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{PORT}"
    wait_until_healthy(base, timeout_s=300)
    if httpx.get(base + "/healthz").json().get("ingress") != ingress:
        raise SystemExit(f"the app does not run behind {ingress!r}")
    if lane:
        base = f"http://127.0.0.1:{LANE_PORT}"
        wait_until_healthy(base, timeout_s=60)
    return base


def stop_app() -> None:
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    serve.shutdown()
    ray.shutdown()


def summarize(engine_ms, http_ms, timings, engine_1t_ms=None) -> list[dict]:
    rows = [{"phase": "engine TTFT (in process)", "p50_ms": pct(engine_ms, 50), "p90_ms": pct(engine_ms, 90)}]
    if engine_1t_ms:
        rows.append({"phase": "engine TTFT (in process, 1 thread as a replica)",
                     "p50_ms": pct(engine_1t_ms, 50), "p90_ms": pct(engine_1t_ms, 90)})
    rows += [
            {"phase": "HTTP TTFT (client)", "p50_ms": pct(http_ms, 50), "p90_ms": pct(http_ms, 90)}]
    for phase in PHASES:
        values = [t[phase] for t in timings if phase in t]
        rows.append({"phase": f"  {phase}", "p50_ms": pct(values, 50), "p90_ms": pct(values, 90)})
    outside = [h - sum(t.get(p, 0.0) for p in APP_PHASES) for h, t in zip(http_ms, timings)]
    rows.append({"phase": "  outside (HTTP in and out, the ingress until it forwards, the response's way back)",
                 "p50_ms": pct(outside, 50), "p90_ms": pct(outside, 90)})
    return [{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ingress", default="direct,proxy",
                    help="ingresses to measure, in this order (kvharbor.platform.ingress): haproxy, proxy, "
                         "direct, lane (direct, with the requests sent to the premium lane)")
    ap.add_argument("--name", type=result_name, default="request_path", help="results file stem")
    ap.add_argument("--overload-lag-ms", default=None,
                    help="overload_lag_ms of the gateway and of Serve's proxy (a number, or 'off'; "
                         "default: the platform's)")
    ap.add_argument("--proxy-guard", choices=("on", "off"), default="on",
                    help="the overload guard in Serve's proxy (proxy ingress): off turns it alone off")
    ap.add_argument("--direct-streams", choices=("on", "off"), default="on",
                    help="build_app direct_streams: premium's tokens over a connection of their own "
                         "to the replica (on, the default) or through a Serve handle call (off)")
    args = ap.parse_args(argv)
    info = machine()
    texts = prompts(args.requests, args.seed)
    engine_ms, engine_tokens = engine_ttfts(texts)
    engine_1t_ms, _ = engine_ttfts(texts, threads=1)
    from kvharbor.engine.model_info import load_tokenizer  # noqa: PLC0415

    tok = load_tokenizer("kvharbor/tiny-llama")
    report = {"machine": info, "seed": args.seed, "requests": args.requests, "goal_ms": 15.0,
              "overload_lag_ms": args.overload_lag_ms, "proxy_guard": args.proxy_guard,
              "direct_streams": args.direct_streams,
              "engine_p50_ms": round(pct(engine_ms, 50), 2), "engine_1thread_p50_ms": round(pct(engine_1t_ms, 50), 2),
              "ingress": {}, "raw": {"engine_ms": engine_ms, "engine_1thread_ms": engine_1t_ms}}
    ok = True
    for ingress in args.ingress.split(","):
        with tempfile.TemporaryDirectory() as folder:
            base = serve_app(lifted_tenants(Path(folder)), ingress, args.overload_lag_ms,
                             args.proxy_guard, args.direct_streams == "on")
            try:
                http_ms, timings, http_texts, transports = http_ttfts(base, texts)
            finally:
                stop_app()
        same = sum(tok.decode([t]) == s for t, s in zip(engine_tokens, http_texts))
        ok &= same == len(texts)
        rows = summarize(engine_ms, http_ms, timings, engine_1t_ms)
        excess = pct(http_ms, 50) - pct(engine_ms, 50)
        excess_1t = pct(http_ms, 50) - pct(engine_1t_ms, 50)
        print(f"\ningress: {ingress}")
        print(table(rows, ["phase", "p50_ms", "p90_ms"]))
        print(f"outputs equal: {same}/{len(texts)}; HTTP - engine TTFT p50: {excess:.1f} ms (goal <= 15 ms); "
              f"HTTP - 1-thread engine: {excess_1t:.1f} ms; served {transports}")
        report["ingress"][ingress] = {"rows": rows, "outputs_equal": same,
                                      "http_minus_engine_p50_ms": round(excess, 2),
                                      "http_minus_1thread_engine_p50_ms": round(excess_1t, 2),
                                      "goal_met": excess <= 15.0, "transports": transports}
        report["raw"][ingress] = {"http_ms": http_ms, "timings": timings}
    print(f"load avg at start {info['load_avg_at_start']}")
    path = write_json(args.name, report)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
