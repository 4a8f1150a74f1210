"""One generation as the gateway runs it: replica call with retry, metrics, OpenAI shapes.

Retry rule: a request whose replica fails *before the first token* (the actor died, or its
engine answered with a 5xx error event) is sent again, to another replica when there is one
(the router skips the replicas in ``metadata["exclude_replicas"]``);
once tokens have streamed, the stream ends with an OpenAI-shaped error event and ``[DONE]``
(a non-streaming request gets 503 with Retry-After). When the client goes away the replica
call is cancelled, which aborts the request in the engine and frees its blocks.
Every request ends in exactly one status: ok, error, aborted (client went away) or
replica_failed, counted in ``kvharbor_requests``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError

from kvharbor.platform.openai_protocol import APIError, error_type

logger = logging.getLogger("kvharbor.gateway")

MAX_ATTEMPTS = 3


class ReplicaFailed(Exception):
    """The replica answered with an internal error event (its engine failed)."""


REPLICA_ERRORS = (RayActorError, RayTaskError, ConnectionError, ReplicaFailed)


def exclude_failed_replica(metadata: dict) -> None:
    """Make the retry avoid the replica that just failed (the router set ``routed_to``)."""
    failed = metadata.get("routed_to")
    if failed and failed not in metadata.setdefault("exclude_replicas", []):
        metadata["exclude_replicas"].append(failed)


async def sse(chunks: AsyncIterator[dict | str]) -> AsyncIterator[str]:
    """Server-Sent Events framing; a string chunk is sent verbatim (``[DONE]``)."""
    async for chunk in chunks:
        yield f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


class GenerationRun:
    """Drives one request through ``LLMReplica.generate`` and records its metrics."""

    def __init__(self, gateway, request, principal, ticket, chat: bool, model: str) -> None:
        self.gw, self.req, self.principal, self.ticket = gateway, request, principal, ticket
        self.chat, self.model = chat, model
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.replica_id: str | None = None
        self.status = "aborted"
        self._stream = None               # the replica call in progress (None: none running)
        self._finished = False

    # ---- replica events --------------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict]:
        """Token events from a replica, retried on replica failure before the first token."""
        started = False
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self._stream = self.gw.llm.options(stream=True).generate.remote(self.req)
            try:
                async for event in self._stream:
                    if "error" in event:
                        status = int(event.get("status", 500))
                        if status >= 500:
                            raise ReplicaFailed(event["error"])
                        raise APIError(status, event["error"])
                    started = True
                    self._observe(event)
                    yield event
                self._stream = None
                return
            except REPLICA_ERRORS as e:
                self._stream = None
                if started or attempt == MAX_ATTEMPTS:
                    self.status = "replica_failed"
                    raise APIError(503, f"the replica serving this request failed ({type(e).__name__}); "
                                   "retry the request", "replica_failed", headers={"Retry-After": "1"}) from e
                logger.warning("replica failed before the first token (attempt %d): %r", attempt, e)
                exclude_failed_replica(self.req.metadata)
                await asyncio.sleep(0.2 * attempt)
            finally:
                self.cancel()             # the client went away (or an error event): abort

    def cancel(self) -> None:
        """Abort the request on its replica if it is still running there (idempotent)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()

    def _observe(self, event: dict) -> None:
        now = time.perf_counter()
        n = len(event.get("token_ids", ()))
        if n and self.first_token_at is None:
            self.first_token_at = now
            decision_ms = self.req.metadata.get("router_decision_ms")
            if decision_ms is not None:
                self.gw.metrics.router_decision(decision_ms / 1000.0)
        elif n and self.last_token_at is not None:
            self.gw.metrics.inter_token_latency(self.req.tenant, self.req.qos, (now - self.last_token_at) / n)
        if n:
            self.last_token_at = now
        self.completion_tokens += n
        self.cached_tokens = event.get("num_cached_tokens", self.cached_tokens)
        self.replica_id = event.get("replica_id", self.replica_id)

    async def finish(self) -> None:
        """Record metrics and release the admission ticket; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        m, tenant, qos = self.gw.metrics, self.req.tenant, self.req.qos
        prompt = len(self.req.prompt_token_ids)
        m.request_finished(tenant, qos, self.status)
        m.request_latency(tenant, qos, time.perf_counter() - self.start)
        m.tokens(tenant, qos, prompt, self.cached_tokens, self.completion_tokens)
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.start
            m.ttft(tenant, qos, ttft)
            slo_ms = self.principal.qos.ttft_slo_ms
            if slo_ms:
                m.slo(tenant, qos, ttft * 1000.0 <= slo_ms)
        try:
            self.gw.request_done(self.ticket, qos, prompt + self.completion_tokens)
        except Exception:  # noqa: BLE001 - never fail a finished request on accounting
            logger.exception("admission release failed")

    def usage(self) -> dict:
        prompt = len(self.req.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # ---- OpenAI shapes ---------------------------------------------------------------------
    def _choice(self, text: str, finish_reason: str | None, final: bool) -> dict:
        if finish_reason == "abort":
            finish_reason = "stop"
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if final:
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "finish_reason": finish_reason}
        return {"index": 0, "delta": {"content": text} if text or finish_reason else {"role": "assistant", "content": ""},
                "finish_reason": finish_reason}

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.req.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, "kvharbor": {"replica_id": self.replica_id}}

    async def complete(self) -> dict:
        """Non-streaming: the whole answer as one OpenAI response."""
        parts, reason = [], None
        try:
            async for event in self.events():
                parts.append(event.get("text", ""))
                reason = event.get("finish_reason") or reason
            self.status = "ok"
        except APIError:
            self.status = "error" if self.status == "aborted" else self.status
            raise
        finally:
            await self.finish()
        body = self._envelope([self._choice("".join(parts), reason, final=True)], chunk=False)
        body["usage"] = self.usage()
        return body

    async def stream_chunks(self, include_usage: bool) -> AsyncIterator[dict | str]:
        """Streaming: one chunk per event, an error event on failure, then ``[DONE]``."""
        try:
            if self.chat:
                yield self._envelope([self._choice("", None, final=False)], chunk=True)
            async for event in self.events():
                yield self._envelope([self._choice(event.get("text", ""), event.get("finish_reason"),
                                                   final=False)], chunk=True)
            self.status = "ok"
            if include_usage:
                yield {**self._envelope([], chunk=True), "usage": self.usage()}
        except APIError as e:
            self.status = "error" if self.status == "aborted" else self.status
            yield {"error": {"message": e.message, "type": error_type(e.status), "param": e.param,
                             "code": e.code}}
        finally:
            await self.finish()
        yield "[DONE]"
