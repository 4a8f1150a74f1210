"""The Batch API's runner and store without Ray or HTTP: a fake ``send`` answers the lines and
an in-memory ``BatchStore`` keeps the batch, with a clock the tests move."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest

from kvharbor.platform import batch_runner
from kvharbor.platform.batch_runner import BatchRunner, parse_lines
from kvharbor.platform.batch_store import MAX_ACTIVE_BATCHES, STALE_S, BatchStore


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def jsonl(*lines) -> bytes:
    return "".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines).encode()


def line(cid: str, url: str = "/v1/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", "prompt": cid, **body}}


def new_batch(store: BatchStore, clock: Clock, content: bytes, endpoint="/v1/completions", tenant="acme") -> dict:
    batch = {"id": f"batch_{len(store._batches)}", "endpoint": endpoint, "status": "validating", "completed_at": None,
             "expires_at": clock() + 3600, "request_counts": {"total": 0, "completed": 0, "failed": 0}}
    assert store.add_batch(tenant, batch) is batch
    return batch


async def store_call(store, method, *args):
    await asyncio.sleep(0)
    return getattr(store, method)(*args)


class CountedMetrics:
    """The two recording methods a runner calls, counted by (tenant, status or outcome)."""

    def __init__(self) -> None:
        self.batches, self.lines = Counter(), Counter()

    def batch(self, tenant, status):
        self.batches[tenant, status] += 1

    def batch_requests(self, tenant, outcome, n=1):
        self.lines[tenant, outcome] += n


def run(store, batch, content, send, clock, concurrency=4, tenant="acme", metrics=None):
    runner = BatchRunner(lambda m, *a: store_call(store, m, *a), send, tenant, batch, content,
                         concurrency=concurrency, clock=clock, metrics=metrics)
    asyncio.run(runner.run())
    return runner


def records(store, tenant, file_id) -> list[dict]:
    return [json.loads(x) for x in store.content(tenant, file_id).decode().splitlines()] if file_id else []


def test_results_are_split_by_status_in_input_order():
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"), line("b", max_tokens=-1), line("c"), line("d", stream=True))
    batch = new_batch(store, clock, content)

    async def send(url, body):
        await asyncio.sleep(0.01 if body["prompt"] == "a" else 0)       # "a" answers last
        if body.get("max_tokens", 1) < 0:
            return 400, {"error": {"message": "max_tokens must be >= 1", "param": "max_tokens"}}, {}
        return 200, {"id": f"cmpl-{body['prompt']}", "text": body["prompt"] * 2}, {}

    run(store, batch, content, send, clock)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    out, err = records(store, "acme", batch["output_file_id"]), records(store, "acme", batch["error_file_id"])
    assert [r["custom_id"] for r in out] == ["a", "c"]
    assert out[0]["response"] == {"status_code": 200, "request_id": "cmpl-a", "body": {"id": "cmpl-a", "text": "aa"}}
    assert [(r["custom_id"], r["response"]["status_code"]) for r in err] == [("b", 400), ("d", 400)]
    assert err[1]["response"]["body"]["error"]["param"] == "stream"
    assert store.file("acme", batch["output_file_id"])["purpose"] == "batch_output"


def test_no_more_than_concurrency_lines_in_flight():
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(*[line(str(i)) for i in range(20)])
    batch, live, peak = new_batch(store, clock, content), [0], [0]

    async def send(url, body):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await asyncio.sleep(0.005)
        live[0] -= 1
        return 200, {"id": body["prompt"]}, {}

    run(store, batch, content, send, clock, concurrency=3)
    assert peak[0] == 3 and batch["request_counts"]["completed"] == 20


def test_a_429_is_waited_out_and_sent_again(monkeypatch):
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"))
    batch, calls = new_batch(store, clock, content), []

    async def send(url, body):
        calls.append(clock())
        clock.now += 0.3                       # each call (and its wait) moves the clock
        if len(calls) < 3:
            return 429, {"error": {"message": "slow down"}}, {"retry-after": "0.2"}
        return 200, {"id": "ok"}, {}

    run(store, batch, content, send, clock)
    assert len(calls) == 3 and batch["status"] == "completed"
    assert records(store, "acme", batch["output_file_id"])[0]["response"]["body"] == {"id": "ok"}


@pytest.mark.parametrize("headers, least_s, most_s", [
    ({"retry-after": "5", "retry-after-ms": "30"}, 0.03, 1.0),     # the exact wait is read first
    ({"retry-after": "0.4"}, 0.4, 1.5),
])
def test_a_429_is_retried_after_the_wait_it_names(headers, least_s, most_s):
    """A rate limit that clears in 30 ms costs the line about 30 ms, not Retry-After's whole
    seconds; without ``retry-after-ms``, Retry-After is waited out."""
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"))
    batch, sent_at = new_batch(store, clock, content), []

    async def send(url, body):
        sent_at.append(time.monotonic())
        return (429, {"error": {"message": "slow down"}}, headers) if len(sent_at) == 1 else (200, {"id": "ok"}, {})

    run(store, batch, content, send, clock)
    assert len(sent_at) == 2 and batch["status"] == "completed"
    assert least_s <= sent_at[1] - sent_at[0] < most_s, sent_at[1] - sent_at[0]


def test_a_cancelled_batch_starts_no_new_line_and_keeps_finished_ones(monkeypatch):
    monkeypatch.setattr(batch_runner, "HEARTBEAT_S", 0.01)
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(*[line(str(i)) for i in range(50)])
    batch, sent = new_batch(store, clock, content), []

    async def send(url, body):
        sent.append(body["prompt"])
        if len(sent) == 4:
            store.cancel("acme", batch["id"])
        await asyncio.sleep(0.02)
        return 200, {"id": body["prompt"]}, {}

    run(store, batch, content, send, clock, concurrency=2)
    assert batch["status"] == "cancelled" and batch["cancelling_at"] and batch["cancelled_at"]
    assert 4 <= len(sent) < 50
    assert [r["custom_id"] for r in records(store, "acme", batch["output_file_id"])] == sent
    assert batch["request_counts"] == {"total": 50, "completed": len(sent), "failed": 0}


def test_lines_not_started_before_expiry_are_expired_errors():
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(*[line(str(i)) for i in range(5)])
    batch = new_batch(store, clock, content)

    async def send(url, body):
        if body["prompt"] == "1":
            clock.now = batch["expires_at"]        # the window ends while line 1 runs
        return 200, {"id": body["prompt"]}, {}

    run(store, batch, content, send, clock, concurrency=1)
    assert batch["status"] == "expired" and batch["expired_at"]
    assert [r["custom_id"] for r in records(store, "acme", batch["output_file_id"])] == ["0", "1"]
    err = records(store, "acme", batch["error_file_id"])
    assert [(r["custom_id"], r["error"]["code"], r["response"]) for r in err] == [
        ("2", "batch_expired", None), ("3", "batch_expired", None), ("4", "batch_expired", None)]
    assert batch["request_counts"] == {"total": 5, "completed": 2, "failed": 3}


def test_an_invalid_file_fails_before_any_line_runs():
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"), line("a"), line("b", url="/v1/embeddings"), "not json", "", [1, 2],
                    {"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}},
                    {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": "x"})
    batch, sent = new_batch(store, clock, content), []

    async def send(url, body):
        sent.append(body)
        return 200, {}, {}

    run(store, batch, content, send, clock)
    assert sent == [] and batch["status"] == "failed" and batch["failed_at"]
    errors = batch["errors"]["data"]
    assert [(e["line"], e["param"]) for e in errors] == [(2, "custom_id"), (3, "url"), (4, None), (6, None),
                                                         (7, "method"), (8, "body")]
    assert "/v1/embeddings" in errors[1]["message"] and "line 4" in errors[2]["message"]


@pytest.mark.parametrize("content,code", [(b"", "empty_file"), (b"\n \n", "empty_file"), (b"\xff\xfe", "invalid_file")])
def test_an_empty_or_binary_file_fails(content, code):
    lines, errors = parse_lines(content, "/v1/completions")
    assert lines == [] and [e["code"] for e in errors] == [code]


def test_too_many_lines_fail(monkeypatch):
    monkeypatch.setattr(batch_runner, "MAX_LINES", 3)
    lines, errors = parse_lines(jsonl(*[line(str(i)) for i in range(4)]), "/v1/completions")
    assert [e["code"] for e in errors] == ["too_many_requests"] and "at most 3" in errors[0]["message"]


def test_a_runner_that_stops_reporting_reads_as_failed():
    clock = Clock()
    store = BatchStore(clock=clock)
    batch = new_batch(store, clock, b"")
    assert store.update(batch["id"], {"status": "in_progress"}) == "in_progress"
    clock.now += STALE_S - 1
    assert store.batch("acme", batch["id"])["status"] == "in_progress"
    clock.now += 2
    got = store.batch("acme", batch["id"])
    assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "runner_lost"
    assert store.update(batch["id"], {"status": "completed"}) is None      # a late runner is told so


def test_a_runner_killed_midway_marks_its_batch_failed():
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"))
    batch, metrics = new_batch(store, clock, content), CountedMetrics()

    async def send(url, body):
        await asyncio.sleep(10)

    async def main():
        runner = BatchRunner(lambda m, *a: store_call(store, m, *a), send, "acme", batch, content, clock=clock,
                             metrics=metrics)
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "runner_stopped"
    assert metrics.batches == Counter({("acme", "created"): 1, ("acme", "failed"): 1}) and not metrics.lines


def test_the_store_keeps_tenants_apart_and_bounds_bytes():
    clock = Clock()
    store = BatchStore(max_bytes=10, clock=clock)
    meta = store.add_file("acme", "in.jsonl", "batch", b"123456")
    assert store.add_file("acme", "more.jsonl", "batch", b"12345") is None          # 11 > 10 bytes
    assert store.file("initech", meta["id"]) is None and store.content("initech", meta["id"]) is None
    assert store.files("initech") == ([], False) and store.delete_file("initech", meta["id"]) is False
    assert store.content("acme", meta["id"]) == b"123456" and store.used == 6
    assert store.delete_file("acme", meta["id"]) and store.used == 0
    assert store.add_file("acme", "more.jsonl", "batch", b"12345")["bytes"] == 5
    batch = new_batch(store, clock, b"")
    assert store.batch("initech", batch["id"]) is None and store.cancel("initech", batch["id"]) is None
    assert store.batches("initech", None, 20) == ([], False)


def test_a_tenant_has_a_bounded_number_of_running_batches():
    clock = Clock()
    store = BatchStore(clock=clock)
    batches = [new_batch(store, clock, b"") for _ in range(MAX_ACTIVE_BATCHES)]
    assert store.add_batch("acme", {"id": "one_more", "status": "validating"}) is None
    assert store.add_batch("initech", {"id": "other", "status": "validating"}) is not None
    store.update(batches[0]["id"], {"status": "completed"})
    assert store.add_batch("acme", {"id": "one_more", "status": "validating"}) is not None


def test_batches_page_newest_first():
    clock = Clock()
    store = BatchStore(clock=clock)
    ids = [new_batch(store, clock, b"")["id"] for _ in range(5)]
    page, more = store.batches("acme", None, 2)
    assert [b["id"] for b in page] == ids[::-1][:2] and more
    page, more = store.batches("acme", page[-1]["id"], 10)
    assert [b["id"] for b in page] == ids[::-1][2:] and not more


def test_cancel_leaves_a_finished_batch_as_it_is():
    clock = Clock()
    store = BatchStore(clock=clock)
    batch = new_batch(store, clock, b"")
    store.update(batch["id"], {"status": "completed"})
    assert store.cancel("acme", batch["id"])["status"] == "completed"
    running = new_batch(store, clock, b"")
    assert store.cancel("acme", running["id"])["status"] == "cancelling"
    assert store.update(running["id"], {"status": "in_progress"}) == "cancelling"   # a runner cannot undo it


def test_a_cancel_after_the_last_line_started_still_ends_cancelled(monkeypatch):
    monkeypatch.setattr(batch_runner, "HEARTBEAT_S", 60.0)          # the runner never hears of it
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"), line("b"))
    batch = new_batch(store, clock, content)

    async def send(url, body):
        if body["prompt"] == "b":
            store.cancel("acme", batch["id"])
        return 200, {"id": body["prompt"]}, {}

    run(store, batch, content, send, clock, concurrency=1)
    assert batch["status"] == "cancelled" and batch["cancelled_at"] and batch["completed_at"] is None
    assert batch["request_counts"]["completed"] == 2 and batch["output_file_id"]


def test_the_senders_client_is_closed_when_the_batch_ends():
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"))
    batch, closed = new_batch(store, clock, content), []

    async def send(url, body):
        return 200, {"id": "a"}, {}

    async def aclose():
        closed.append(True)

    send.aclose = aclose
    run(store, batch, content, send, clock)
    assert batch["status"] == "completed" and closed == [True]


def test_metrics_count_each_batch_created_and_ended_and_each_line_by_outcome(monkeypatch):
    """What the Tenants dashboard's Batch API row plots: per tenant, a batch once created and
    once with the status it ended in, and every line once with its outcome, equal to the
    batch's own request_counts."""
    monkeypatch.setattr(batch_runner, "HEARTBEAT_S", 0.01)
    clock = Clock()
    store = BatchStore(clock=clock)
    metrics, to_cancel = CountedMetrics(), []

    async def answer(url, body):
        if body["prompt"] == "x":
            clock.now = 2e9                              # past every batch's window
        if body["prompt"] == "c":
            store.cancel("globex", to_cancel[0])
            await asyncio.sleep(0.05)
        if body["prompt"] == "lost":                     # the store restarted: it forgot the batch
            store._batches.clear()
            await asyncio.sleep(0.05)
        return (400, {"error": {"message": "bad"}}, {}) if body["prompt"] == "bad" else (200, {"id": "i"}, {})

    done = jsonl(line("a"), line("bad"), line("b", stream=True), line("d"))
    run(store, new_batch(store, clock, done), done, answer, clock, metrics=metrics)
    assert metrics.batches == Counter({("acme", "created"): 1, ("acme", "completed"): 1})
    assert metrics.lines == Counter({("acme", "completed"): 2, ("acme", "failed"): 2})

    invalid = jsonl(line("a"), line("a"))
    run(store, new_batch(store, clock, invalid, tenant="initech"), invalid, answer, clock,
        tenant="initech", metrics=metrics)
    cancelled = jsonl(*[line(p) for p in ("c", "e", "f", "g")])
    cancel_batch = new_batch(store, clock, cancelled, tenant="globex")
    to_cancel.append(cancel_batch["id"])
    run(store, cancel_batch, cancelled, answer, clock, concurrency=1, tenant="globex", metrics=metrics)
    expiring = jsonl(line("a"), line("x"), line("y"), line("z"))
    expired = new_batch(store, clock, expiring)
    run(store, expired, expiring, answer, clock, concurrency=1, metrics=metrics)
    assert cancel_batch["status"] == "cancelled" and expired["status"] == "expired"
    forgotten = jsonl(line("lost"))
    run(store, new_batch(store, clock, forgotten, tenant="umbrella"), forgotten, answer, clock,
        tenant="umbrella", metrics=metrics)
    assert metrics.batches == Counter({
        ("acme", "created"): 2, ("acme", "completed"): 1, ("acme", "expired"): 1,
        ("initech", "created"): 1, ("initech", "failed"): 1,
        ("globex", "created"): 1, ("globex", "cancelled"): 1, ("umbrella", "created"): 1, ("umbrella", "failed"): 1})
    assert metrics.lines == Counter({("acme", "completed"): 4, ("acme", "failed"): 2, ("acme", "expired"): 2,
                                     ("globex", "completed"): cancel_batch["request_counts"]["completed"],
                                     ("umbrella", "completed"): 1})
    assert expired["request_counts"] == {"total": 4, "completed": 2, "failed": 2}



def test_lines_are_sent_as_flex_unless_they_name_a_tier():
    """A batch can wait: its lines run at the lowest QoS class (service_tier "flex"), below every
    tenant's interactive requests, unless a line asks for a tier itself."""
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"), line("b", service_tier="default"), line("c", service_tier="flex"))
    batch, sent = new_batch(store, clock, content), {}

    async def send(url, body):
        sent[body["prompt"]] = body.get("service_tier")
        return 200, {"id": body["prompt"]}, {}

    run(store, batch, content, send, clock)
    assert sent == {"a": "flex", "b": "default", "c": "flex"}
