"""A client that goes away has its request aborted in the engine and its KV blocks freed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.reliability.helpers import DEMO, rand_text, ray_log_files, replica_stats, wait_idle

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _used(stats: list[dict]) -> dict[str, int]:
    return {s["replica_id"]: s["blocks_used"] for s in stats}


def _drop_stream_after(app, key: str, prompt: str, events: int) -> int:
    """Open a stream, read ``events`` SSE events, then close the connection. Returns events read."""
    seen = 0
    with app.client(key) as c, c.stream("POST", "/v1/completions", json={
            "model": app.model, "prompt": prompt, "stream": True, **LONG}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert '"error"' not in line, line
                seen += 1
                if seen >= events:
                    break
    return seen


def _server_errors_logged() -> int:
    """How many times this Ray session's processes logged the gateway's 500 handler."""
    return sum(p.read_bytes().count(b"unexpected error on ") for p in ray_log_files((".err",)))


@pytest.fixture(autouse=True)
def _no_server_error_logged(kvharbor_app):
    """A client's close is not a server error: no test here adds a 500-handler log line."""
    before = _server_errors_logged()
    yield
    assert _server_errors_logged() == before, "a client's close was logged as a server error"


def _outcomes(stats: list[dict]) -> tuple[int, int]:
    """(aborted, finished) requests summed over the replicas' engines."""
    return (sum(s["requests_aborted"] for s in stats), sum(s["requests_finished"] for s in stats))


def _assert_back_to_baseline(app, baseline: dict[str, int], outcomes: tuple[int, int],
                             dropped: int) -> None:
    """Blocks back to ``baseline``, and exactly ``dropped`` more requests *aborted* (none finished:
    a fast finish would free the blocks too, so only the abort count proves the abort)."""
    stats = wait_idle(app, timeout_s=30)
    assert _used(stats) == baseline, (_used(stats), baseline)
    aborted, finished = _outcomes(stats)
    assert (aborted - outcomes[0], finished - outcomes[1]) == (dropped, 0)
    for report in app.replica_call("check_integrity").values():
        assert report["running"] == 0, report
        assert report["blocks_used"] == baseline[report["replica_id"]]


def test_dropped_stream_is_aborted_and_its_blocks_freed(kvharbor_app):
    idle = wait_idle(kvharbor_app)
    baseline, outcomes = _used(idle), _outcomes(idle)
    with kvharbor_app.client(DEMO["standard"]) as c, c.stream("POST", "/v1/completions", json={
            "model": kvharbor_app.model, "prompt": rand_text(400, 7), "stream": True, **LONG}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line.startswith("data: "))
        during = replica_stats(kvharbor_app)
        assert sum(s["num_running"] for s in during) == 1
        assert sum(_used(during).values()) >= sum(baseline.values()) + 400 // 16
    _assert_back_to_baseline(kvharbor_app, baseline, outcomes, dropped=1)


def test_many_dropped_streams_across_tenants_leave_nothing_behind(kvharbor_app):
    idle = wait_idle(kvharbor_app)
    baseline, outcomes = _used(idle), _outcomes(idle)
    keys = [DEMO["premium"], DEMO["standard"], DEMO["batch"]] * 3
    with ThreadPoolExecutor(len(keys)) as pool:
        seen = list(pool.map(lambda i: _drop_stream_after(kvharbor_app, keys[i], rand_text(100, 50 + i), 1 + i % 4),
                             range(len(keys))))
    assert seen == [1 + i % 4 for i in range(len(keys))]
    _assert_back_to_baseline(kvharbor_app, baseline, outcomes, dropped=len(keys))


def test_client_timeout_on_a_non_streaming_request_aborts_it(kvharbor_app):
    idle = wait_idle(kvharbor_app)
    baseline, outcomes = _used(idle), _outcomes(idle)
    start = time.monotonic()
    with kvharbor_app.client(DEMO["standard"], timeout=1.5) as c:
        try:
            c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": rand_text(64, 3), **LONG})
            raise AssertionError("a 3000-token completion finished within 1.5 s; make it longer")
        except httpx.TimeoutException:
            pass
    assert time.monotonic() - start < 10
    _assert_back_to_baseline(kvharbor_app, baseline, outcomes, dropped=1)
