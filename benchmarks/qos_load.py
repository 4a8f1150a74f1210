"""The QoS benchmark's load: its request mix, open-loop Poisson arrivals and the asyncio + httpx
client that sends them and records what each request got (``benchmarks/qos.py`` runs the
phases, deploys the app and judges the goals).

Every request is streamed with ``temperature 0, ignore_eos``; TTFT is from sending the
request to the first token chunk, measured at the client, whose own event-loop lag is
recorded beside it (``open_loop``).

The client's cyclic garbage collector is paused for each timed phase (``client_gc_paused``):
this process holds every outcome and Ray's driver state, and a full collection of it took
355-452 ms under the flood (measured with ``gc.callbacks``, 2026-11-26), a stall of the client's
loop that the TTFT of every request whose first chunk arrived meanwhile counted as the app's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx

from loadtests import workload
from loadtests.summary import percentile

MIX = (("premium", 0.2), ("standard", 0.4), ("batch", 0.4))
MAX_TOKENS = {"premium": 16, "standard": 24, "batch": 32}
MODEL = "kvharbor/tiny-llama"
DOCS, DOC_SENTENCES = 8, 12          # 8 shared documents of ~750 tokens


@dataclass(slots=True)
class Job:
    """One request to send ``at_s`` seconds after the phase starts."""

    at_s: float
    qos: str
    path: str
    body: dict


@dataclass(slots=True)
class Outcome:
    """What happened to one job; times are seconds since the phase started."""

    qos: str
    sent: float
    first: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    timings: dict | None = None        # the app's breakdown of its TTFT (usage chunk)

    def ttft(self, cutoff: float) -> tuple[float, bool]:
        """(TTFT seconds, censored): censored means no token by ``cutoff`` (a lower bound)."""
        return (self.first - self.sent, False) if self.first is not None else (cutoff - self.sent, True)


# ---- workload ------------------------------------------------------------------------------
def make_job(qos: str, at_s: float, rng: random.Random, info: workload.TenantsInfo) -> Job:
    base = {"model": MODEL, "max_tokens": MAX_TOKENS[qos], "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if qos == "premium":
        return Job(at_s, qos, "/v1/chat/completions", {**base, "messages": workload.premium_messages(info, rng)})
    if qos == "standard":
        return Job(at_s, qos, "/v1/chat/completions",
                   {**base, "messages": workload.document_question(rng, DOCS, DOC_SENTENCES)})
    return Job(at_s, qos, "/v1/completions", {**base, "prompt": workload.batch_prompt(rng, DOCS, DOC_SENTENCES)})


def poisson_jobs(rate: float, duration_s: float, seed: int, info, only: str | None = None,
                 premium_rate: float | None = None) -> list[Job]:
    """Open-loop arrivals at ``rate``/s with the MIX; ``only`` keeps one class (same times).
    ``premium_rate``: premium arrives as a Poisson stream of its own at that rate instead of
    as the MIX's share (the other classes' arrivals are the same as without it)."""
    rng, jobs, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        qos = rng.choices([q for q, _ in MIX], [w for _, w in MIX])[0]
        job = make_job(qos, t, rng, info)
        if (only is None or qos == only) and not (premium_rate and qos == "premium"):
            jobs.append(job)
    if premium_rate and only in (None, "premium"):
        rng, t = random.Random(seed + 7919), 0.0
        while (t := t + rng.expovariate(premium_rate)) < duration_s:
            jobs.append(make_job("premium", t, rng, info))
        jobs.sort(key=lambda j: j.at_s)
    return jobs


# ---- client --------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, job: Job, t0: float, out: Outcome) -> None:
    """Send ``job`` at its time, streaming into ``out`` (so a cancelled job keeps what it got)."""
    await asyncio.sleep(max(0.0, t0 + job.at_s - time.perf_counter()))
    out.sent = time.perf_counter() - t0
    headers = {"Authorization": f"Bearer {workload.api_key(job.qos)}"}
    chat, seen = "messages" in job.body, 0
    try:
        async with client.stream("POST", job.path, json=job.body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}"
                await resp.aread()      # an unread error body makes httpx close the connection
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out.error = data["error"].get("message", "stream error")
                    return
                seen += 1
                out.timings = (data.get("kvharbor") or {}).get("timings_ms", out.timings)
                if data.get("choices") and not (chat and seen == 1):   # chat chunk 1: role only
                    # a chunk holds its class's stream_interval tokens; usage says how many
                    now = time.perf_counter() - t0
                    count = data["usage"]["completion_tokens"]
                    out.token_times += [now] * (count - len(out.token_times))
                    out.first = now if out.first is None else out.first
            out.end = time.perf_counter() - t0
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"


def http_client(base: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    return httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0), limits=limits)


async def open_loop(base: str, jobs: list[Job], window_s: float, grace_s: float,
                    t0: float | None = None, bases: dict[str, str] | None = None
                    ) -> tuple[list[Outcome], float, list[float]]:
    """Send ``jobs`` on schedule from ``t0`` (a ``time.perf_counter()`` value, the same clock
    in every process on this host; default: now); cancel what is left ``grace_s`` after the
    window. ``bases``: another base URL for some classes (e.g. premium to the premium lane).

    Each class (one tenant each) sends through a connection pool of its own, as separate
    client services would: a premium request never waits for a connection that a flood of
    other tenants' requests holds or has just had closed.

    Returns (outcomes in job order, cutoff seconds since ``t0``, this client's event-loop lag
    samples in ms: how late a 10 ms sleep woke, a send or a chunk read here waits as long).
    """
    outcomes = [Outcome(job.qos, job.at_s) for job in jobs]
    lags: list[float] = []

    async def tick() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append((time.perf_counter() - before - 0.01) * 1000.0)

    async with contextlib.AsyncExitStack() as stack:
        clients = {qos: await stack.enter_async_context(http_client((bases or {}).get(qos, base)))  # a pool per tenant
                   for qos in sorted({job.qos for job in jobs})}
        t0 = time.perf_counter() if t0 is None else t0
        ticker = asyncio.create_task(tick())
        tasks = [asyncio.create_task(send(clients[job.qos], job, t0, out)) for job, out in zip(jobs, outcomes)]
        timeout = max(0.0, t0 + window_s + grace_s - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        cutoff = time.perf_counter() - t0
        for task in [*pending, ticker]:
            task.cancel()
        await asyncio.gather(*pending, ticker, return_exceptions=True)
    return outcomes, cutoff, lags


def run_phase(base: str, jobs: list[Job], window_s: float, grace_s: float,
              bases: dict[str, str] | None = None) -> tuple[list[Outcome], float, dict]:
    """One phase's arrivals (``bases`` as in ``open_loop``) -> (outcomes in job order, cutoff,
    the client's loop lag and the garbage collections it made, which stall that loop:
    ``gc_runs`` and ``gc_ms_max``)."""
    with client_gc_paused() as collections:
        outcomes, cutoff, lags = asyncio.run(open_loop(base, jobs, window_s, grace_s, bases=bases))
    return outcomes, cutoff, {**lag_summary(lags), "gc_runs": len(collections),
                              "gc_ms_max": rounded(max(collections, default=0.0))}


@contextlib.contextmanager
def client_gc_paused():
    """Collect, then keep this process's cyclic GC off until the block ends (memory grows by
    the phase's cyclic garbage, collected right after). Yields the list of collections made
    meanwhile (ms each): empty unless something calls ``gc.collect``. ``KVH_CLIENT_GC=on``
    leaves the GC running, to measure what it costs."""
    paused = os.environ.get("KVH_CLIENT_GC", "paused") != "on"
    pauses: list[float] = []
    started: list[float] = []

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((time.perf_counter() - started.pop()) * 1000.0)

    gc.collect()
    if paused:
        gc.disable()
    gc.callbacks.append(timer)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timer)
        if paused:
            gc.enable()
        gc.collect()


def lag_summary(lags: list[float]) -> dict:
    return {"p50": rounded(percentile(lags, 50)), "p99": rounded(percentile(lags, 99)),
            "max": rounded(max(lags)) if lags else None, "n": len(lags)}


def steady_rate(ends: list[float]) -> float:
    """Completions per second while the pipeline is full: the rate between the first and
    the third quartile of completion times.

    A burst's first completions wait for the prompts' prefill and its last ones run nearly
    alone (the longest outputs), so ``len(ends) / max(ends)`` counts both edges and reads
    low; the middle half is the service rate a sustained load gets.
    """
    ends = sorted(ends)
    if len(ends) < 8:
        return len(ends) / max(ends)
    lo, hi = len(ends) // 4, (3 * len(ends)) // 4
    span = ends[hi] - ends[lo]
    return (hi - lo) / span if span > 0 else len(ends) / max(ends)


async def burst_capacity(base: str, size: int, info, timeout_s: float = 240.0) -> tuple[float, int]:
    """Requests per second to complete a burst of ``size`` MIX requests sent at once: the
    saturated completion rate of this deployment on this machine (``steady_rate``); and how
    many of the burst were refused (429: the overload guard shed them, so the rate is of the
    rest)."""
    rng = random.Random(99)
    qos = rng.choices([q for q, _ in MIX], [w for _, w in MIX], k=size)
    jobs = [make_job(q, 0.0, rng, info) for q in qos]
    outcomes, _, _ = await open_loop(base, jobs, timeout_s, 0.0)
    ends = [o.end for o in outcomes if o.end is not None and o.error is None]
    if not ends:
        raise RuntimeError(f"no request of the capacity burst completed in {timeout_s:.0f} s")
    return steady_rate(ends), sum(o.error == "HTTP 429" for o in outcomes)


def rounded(v: float | None) -> float | None:
    """``v`` to 0.1 (the benchmark's JSON precision), None kept."""
    return None if v is None else round(v, 1)
