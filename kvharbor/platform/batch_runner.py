"""Running one batch of the Batch API: its input file's lines, each a request to the gateway's
own route, and the output and error files that answer them.

The input is OpenAI's batch JSONL: one request per line, ``{"custom_id", "method": "POST",
"url", "body"}``, every ``url`` the batch's endpoint and every ``custom_id`` distinct. A file
that breaks those rules fails the batch (``failed``, with the faulty lines in ``errors``)
before any line runs.

Each line is sent, as its tenant, through the gateway's own HTTP app in process (``send``:
no socket): it meets the same key check, limits, queue, validation and engine as the same
request over HTTP, and its answer (status and body) is written as the client would have
received it, but as ``service_tier: "flex"`` unless the line names a tier: at the lowest QoS
class, below every tenant's interactive traffic (``service_tier``). At most ``concurrency``
lines are in flight; a 429 (the tenant's rate limits, a full class queue, an overloaded
gateway) is waited out (``retry-after-ms``, else ``Retry-After``) and the line sent again, so
a batch slows down under load instead of failing. A line asking to stream is answered 400: a
batch result is one JSON body.

The runner reports progress to the store (``request_counts``) every ``HEARTBEAT_S`` and learns
there whether the client cancelled: then no new line starts, the lines under way finish and
the batch ends ``cancelled`` with their results. At ``expires_at`` no new line starts either:
the batch ends ``expired`` and the lines never run are in the error file
(``batch_expired``). Results: the 2xx answers in the output file, the others in the error
file, both in input order.

Metrics (``metrics``, the gateway's recorder): the batch is counted as created when its runner
starts and once more with the status it ends in (``kvharbor_batches``); each line once, as it
finishes, by outcome (``kvharbor_batch_requests``: completed, failed, expired).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from kvharbor.observability.metrics import KvharborMetrics, NullMetrics
from kvharbor.platform.batch_store import HEARTBEAT_S, errors_list, new_id
from kvharbor.platform.error_body import error_dict
from kvharbor.platform.service_tier import FLEX

logger = logging.getLogger("kvharbor.batches")

MAX_LINES = 50_000
"""Requests one batch may hold (OpenAI's limit)."""
MAX_LISTED_ERRORS = 100
MAX_RETRY_WAIT_S = 60.0
DEFAULT_CONCURRENCY = 8


def parse_lines(content: bytes, endpoint: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    """The input file's requests as (custom_id, body), and the errors that fail the batch
    (each with its 1-based ``line``; at most ``MAX_LISTED_ERRORS``)."""
    lines, errors, seen = [], [], set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "the input file is not UTF-8 text: upload JSONL"}]
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        problem, param, request = None, None, None
        try:
            request = json.loads(raw)
        except ValueError:
            problem = "is not JSON: each line is one request object"
        if problem is None and not isinstance(request, dict):
            problem = "is not a JSON object with custom_id, method, url and body"
        elif problem is None:
            cid, body = request.get("custom_id"), request.get("body")
            if not isinstance(cid, str) or not cid:
                problem, param = "has no custom_id (a non-empty string naming the request)", "custom_id"
            elif cid in seen:
                problem, param = f"repeats custom_id {cid!r}: each request needs its own", "custom_id"
            elif request.get("method") != "POST":
                problem, param = "has a method other than POST", "method"
            elif request.get("url") != endpoint:
                problem, param = f"has url {request.get('url')!r}, not the batch's endpoint {endpoint!r}", "url"
            elif not isinstance(body, dict):
                problem, param = "has no body object (the request's JSON body)", "body"
            else:
                seen.add(cid)
                lines.append((cid, body))
        if problem is not None and len(errors) < MAX_LISTED_ERRORS:
            errors.append({"code": "invalid_request", "line": number, "param": param,
                           "message": f"line {number} {problem}"})
    if not errors and not lines:
        errors.append({"code": "empty_file", "message": "the input file holds no request: one JSON object per line"})
    if len(lines) > MAX_LINES:
        errors.append({"code": "too_many_requests", "message": f"the input file holds {len(lines)} requests; "
                       f"a batch takes at most {MAX_LINES}: split it"})
    return lines, errors


STREAM_REFUSED = (400, error_dict(400, "stream is not supported in a batch: a batch result is one JSON body; "
                                  "drop stream or set it to false", "stream_not_supported", "stream"), {})


def retry_after(headers) -> float:
    """Seconds to wait before sending a 429'd line again: ``retry-after-ms`` (the exact wait)
    if given, else ``Retry-After``; at most ``MAX_RETRY_WAIT_S``."""
    for name, scale, least in (("retry-after-ms", 1e-3, 0.001), ("retry-after", 1.0, 0.1)):
        try:
            return min(max(float(headers[name]) * scale, least), MAX_RETRY_WAIT_S)
        except (KeyError, TypeError, ValueError):
            continue
    return 1.0


class BatchRunner:
    """One batch, from its input file to its result files.

    ``store(method, *args)``: an awaitable call of the ``BatchStore``'s ``update`` / ``finish``.
    ``send(url, body)``: an awaitable (status, body dict, headers) of one request as the tenant.
    ``metrics``: where the batch and its lines are counted (none: not counted).
    """

    def __init__(self, store, send, tenant: str, batch: dict, content: bytes,
                 concurrency: int = DEFAULT_CONCURRENCY, clock=time.time,
                 metrics: KvharborMetrics | None = None) -> None:
        self.store, self.send, self.tenant, self.batch, self.content = store, send, tenant, batch, content
        self.concurrency, self.clock = max(1, concurrency), clock
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.counts = {"total": 0, "completed": 0, "failed": 0}
        self.cancelled = self.lost = False

    @property
    def stopping(self) -> bool:
        return self.cancelled or self.lost or self.clock() >= self.batch["expires_at"]

    async def run(self) -> None:
        """The whole batch; never raises (what went wrong is the batch's ``failed`` status)."""
        self.metrics.batch(self.tenant, "created")
        try:
            await self._run()
        except asyncio.CancelledError:        # the gateway replica is stopping
            await self._fail("runner_stopped", "the gateway replica running this batch stopped: create it again")
            raise
        except Exception:
            logger.exception("batch %s failed", self.batch["id"])
            await self._fail("internal_error", "the batch stopped on an internal error: create it again")
        finally:
            close = getattr(self.send, "aclose", None)      # the sender's client, if it has one
            if close is not None:
                await asyncio.shield(close())

    async def _fail(self, code: str, message: str) -> None:
        self.metrics.batch(self.tenant, "failed")
        try:
            await self.store("update", self.batch["id"], {"status": "failed", "failed_at": int(self.clock()),
                                                         "errors": errors_list([{"code": code, "message": message}])})
        except Exception:                     # the store is gone too: the batch reads as lost later
            logger.warning("batch %s: could not record its failure", self.batch["id"])

    async def _report(self, changes: dict) -> None:
        status = await self.store("update", self.batch["id"], {"request_counts": dict(self.counts), **changes})
        self.cancelled = self.cancelled or status == "cancelling"
        self.lost = self.lost or status is None

    async def _run(self) -> None:
        lines, errors = parse_lines(self.content, self.batch["endpoint"])
        if errors:
            await self._report({"status": "failed", "failed_at": int(self.clock()), "errors": errors_list(errors)})
            self.metrics.batch(self.tenant, "failed")
            return
        self.counts["total"] = len(lines)
        model = next((b["model"] for _, b in lines if isinstance(b.get("model"), str)), None)
        await self._report({"status": "in_progress", "in_progress_at": int(self.clock()), "model": model})
        results: list[dict | None] = [None] * len(lines)
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            await self._run_lines(lines, results)
        finally:
            heartbeat.cancel()
        if self.lost:                         # deleted from the store, or the store restarted
            self.metrics.batch(self.tenant, "failed")
            return
        ended = "cancelled" if self.cancelled else "expired" if None in results else "completed"
        await self._report({"status": "finalizing", "finalizing_at": int(self.clock())})
        if ended == "expired":
            self.metrics.batch_requests(self.tenant, "expired", results.count(None))
            for i, (cid, _) in enumerate(lines):
                if results[i] is None:
                    self.counts["failed"] += 1
                    results[i] = {"id": new_id("batch_req_"), "custom_id": cid, "response": None, "error": {
                        "code": "batch_expired",
                        "message": "this request was not run before the batch's completion window ended"}}
        done = [r for r in results if r is not None]
        files = {}
        for field, kept in (("output_file_id", [r for r in done if _succeeded(r)]),
                            ("error_file_id", [r for r in done if not _succeeded(r)])):
            if kept:
                name = f"{self.batch['id']}_{field.removesuffix('_file_id')}.jsonl"
                files[field] = (name, "".join(json.dumps(r) + "\n" for r in kept).encode())
        await self.store("finish", self.tenant, self.batch["id"],
                         {"status": ended, f"{ended}_at": int(self.clock()), "request_counts": dict(self.counts)},
                         files)
        self.metrics.batch(self.tenant, ended)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self._report({})

    async def _run_lines(self, lines: list[tuple[str, dict]], results: list) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        running = set()
        for i, (cid, body) in enumerate(lines):
            await slots.acquire()
            if self.stopping:
                slots.release()
                break
            task = asyncio.create_task(self._line(i, cid, body, results, slots))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)

    async def _line(self, i: int, cid: str, body: dict, results: list, slots: asyncio.Semaphore) -> None:
        try:
            status, answer, headers = STREAM_REFUSED if body.get("stream") else await self._send(body)
            while status == 429 and not self.stopping:
                wait, waited = retry_after(headers), 0.0
                while waited < wait and not self.stopping:       # a cancel ends the wait
                    step = min(0.25, wait - waited)
                    await asyncio.sleep(step)
                    waited += step
                status, answer, headers = await self._send(body)
            request_id = answer.get("id") if isinstance(answer.get("id"), str) else new_id("req_")
            results[i] = {"id": new_id("batch_req_"), "custom_id": cid, "error": None,
                          "response": {"status_code": status, "request_id": request_id, "body": answer}}
            outcome = "completed" if _succeeded(results[i]) else "failed"
            self.counts[outcome] += 1
            self.metrics.batch_requests(self.tenant, outcome)
        finally:
            slots.release()

    async def _send(self, body: dict) -> tuple[int, dict, dict]:
        if "service_tier" not in body:        # a batch can wait: below interactive work
            body = {**body, "service_tier": FLEX}
        try:
            return await self.send(self.batch["endpoint"], body)
        except Exception as e:                # noqa: BLE001 - one line's failure is that line's result
            logger.warning("batch %s: a request failed to run: %r", self.batch["id"], e)
            return 500, error_dict(500, "internal error; the request was not completed", "server_error"), {}


def _succeeded(record: dict) -> bool:
    return record["response"] is not None and 200 <= record["response"]["status_code"] < 300


__all__ = ["BatchRunner", "parse_lines", "MAX_LINES"]
