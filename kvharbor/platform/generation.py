"""One generation as the gateway runs it: replica calls with retry, metrics, OpenAI shapes.

Retry rule: a request whose replica fails *before the first token* (the actor died, or its
engine answered with a retryable 5xx error event) is sent again, to another replica when there
is one (the router skips the replicas in ``metadata["exclude_replicas"]``). A request the
replica refused (a 4xx event) or whose own input made the engine step fail (an event with
``"retryable": false``: the replica found this request to be the step's suspect) is never sent
again: it would fail the next replica's batch too. Once tokens have streamed,
the stream ends with an OpenAI-shaped error event and ``[DONE]`` (a non-streaming request gets
503 with Retry-After). When the client goes away the replica calls are cancelled, which aborts
the request in the engine and frees its blocks.

``n > 1``: the siblings are separate engine requests. The first is sent alone; the others are
sent once it has produced its first token (its prompt's full blocks are then in that
replica's prefix cache) and pinned to its replica, so they prefill only the last partial block.
A batch of prompts (``/v1/completions`` with a list of prompts) is one group of ``n`` siblings
per prompt, in the order of the prompts (choice ``p * n + j`` is prompt ``p``'s ``j``-th): each
group's first request is routed on its own, at once, and leads its group as above.
A beam search (``use_beam_search``) sends each group's leader alone, with ``beam`` set: its
replica runs the search (``actors.beam_runs``) and answers the group's ``n`` choices.
Each sibling's handle call carries its own Serve request id: calls made inside one HTTP
request inherit that request's internal id, and Serve's request router matches a routed
replica to a pending call by that id, so concurrent siblings sharing it were never routed.
Usage counts each prompt once and the completion tokens of every choice.

Every request ends in exactly one status: ok, error, aborted (client went away) or
replica_failed, counted in ``kvharbor_requests``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.context import _serve_request_context

from kvharbor.platform import openai_shapes as shapes
from kvharbor.platform import reasoning, tool_parsers
from kvharbor.platform.direct_stream import DirectStream
from kvharbor.platform.error_body import APIError, error_type
from kvharbor.platform.parsed_answers import ParsedAnswers
from kvharbor.platform.router import KVAwareRouter
from kvharbor.platform.service_tier import answered_tier

logger = logging.getLogger("kvharbor.gateway")

MAX_ATTEMPTS = 3


class ReplicaFailed(Exception):
    """The replica answered with a retryable internal error event (its engine failed)."""


REPLICA_ERRORS = (RayActorError, RayTaskError, ConnectionError, ReplicaFailed)


def exclude_failed_replica(metadata: dict) -> None:
    """Make the retry avoid the replica that just failed (the router set ``routed_to``)."""
    failed = metadata.get("routed_to")
    if failed and failed not in metadata.setdefault("exclude_replicas", []):
        metadata["exclude_replicas"].append(failed)


@contextmanager
def own_serve_request_id(suffix: str) -> Iterator[None]:
    """Handle calls made inside this block get their own Serve internal request id.

    Serve gives every handle call made while serving a request that request's internal id,
    and its request router hands a chosen replica to the pending call with that id. Two
    concurrent calls sharing it collide: one is never routed (seen with ``n > 1``). The
    suffix keeps the parent id readable in Serve's logs. Outside a Serve request, a no-op.
    """
    ctx = _serve_request_context.get()
    if ctx is None or not ctx._internal_request_id:
        yield
        return
    token = _serve_request_context.set(
        dataclasses.replace(ctx, _internal_request_id=f"{ctx._internal_request_id}.{suffix}"))
    try:
        yield
    finally:
        _serve_request_context.reset(token)


async def sse(chunks: AsyncIterator[dict | str]) -> AsyncIterator[str]:
    """Server-Sent Events framing; a string chunk is sent verbatim (``[DONE]``)."""
    async for chunk in chunks:
        yield f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


@dataclass(slots=True)
class Choice:
    """What one sibling (choice) has produced so far."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    logprobs: list[dict] = field(default_factory=list)
    tokens: int = 0
    chars: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0          # the engine's count, with a reasoning parser
    last_token_at: float | None = None
    echoed: bool = False
    call_id: str | None = None        # a streamed named function call's id, once its first delta went out
    parser: tool_parsers.StreamParser | None = None     # tool_choice "auto": the calls in its stream
    thinker: reasoning.ReasoningStream | None = None    # a reasoning parser: the reasoning in its stream
    ids: list[int] = field(default_factory=list)        # return_token_ids: its output ids not yet sent
    prompt_ids_sent: bool = False


class GenerationRun(ParsedAnswers):
    """Drives one HTTP request (``n`` engine requests) through ``LLMReplica.generate``.

    Args:
        requests: the siblings, distinct request ids; each run of ``choices_per_prompt`` of
            them shares one prompt (all of them when it is None).
        logprobs: None, or how many alternatives per token (the OpenAI object is built).
        echo: completions' ``echo``: each prompt's text, put before its choices' text (and, with
            ``logprobs``, its tokens' logprobs, which each prompt's leader asked the engine for,
            before theirs); None: no echo.
        prompt_only: ``echo`` with ``max_tokens`` 0 (as vLLM): the engine computes one token
            per choice, which the answer leaves out (no text, logprobs or usage for it).
        tool_mode: chat's function calling (``tool_calls.tool_mode``): each choice's text is
            the constrained call(s), answered as ``message.tool_calls`` (a stream sends them in
            a named function's arguments as they come, ``required``'s calls in one delta when
            the choice ends); ``auto``: the model's text, its calls read by the parser
            (``tool_parsers``); None: text.
        reasoning: a chat's reasoning parser, whether the model thinks and whether the answer
            shows its reasoning (``reasoning``; ``Gateway._reasoning``): each message's
            ``reasoning`` apart from its content; None: no parser.
        one_call: ``parallel_tool_calls`` false: an ``auto`` answer keeps its first call only
            (``required`` is constrained to one).
        prompt_logprobs: vLLM's field: each prompt's leader asked the engine to score its
            tokens, and the answer shows this many alternatives per token (None: no field).
    """

    def __init__(self, gateway, requests, principal, ticket, chat: bool, model: str,
                 logprobs: int | None = None, marks: dict[str, float] | None = None,
                 choices_per_prompt: int | None = None, echo: list[str] | None = None,
                 prompt_only: bool = False, tool_mode: str | None = None,
                 reasoning: tuple[str, bool, bool] | None = None, one_call: bool = False,
                 chat_echo: str | None = None, return_token_ids: bool = False,
                 tokens_as_ids: bool = False, prompt_logprobs: int | None = None) -> None:
        self.gw, self.reqs, self.principal, self.ticket = gateway, requests, principal, ticket
        self.req = requests[0]
        self.per_prompt = choices_per_prompt or len(requests)
        self.leaders = range(0, len(requests), self.per_prompt)
        self.chat, self.model, self.top_k = chat, model, logprobs
        self.created = int(time.time())
        # perf_counter() marks of the gateway's phases ("proxied", "received", "arrived",
        # "queued", "tokenized", "admitted"); TTFT and latency count from "arrived", the
        # handler's first line.
        self.marks = dict(marks or {})
        self.start = self.marks.setdefault("arrived", time.perf_counter())
        self.replica_ms: float | None = None
        self.first_token_at: float | None = None
        self.choices = [Choice() for _ in requests]
        self.replica_id: str | None = None
        self.transport: str | None = None      # how the first choice's tokens came: direct / serve
        self.status = "aborted"
        self._streams: dict[int, object] = {}     # replica calls in progress, by choice index
        # leader index -> set once that sibling has its first token (its prompt is cached)
        self._prefilled = {lead: asyncio.Event() for lead in self.leaders}
        self._replica_of: dict[int, str] = {}      # leader index -> the replica serving it
        self._finished = False
        self.prompt_k = prompt_logprobs
        self._text_of = shapes.TokenText(gateway.tokenizer, tokens_as_ids) \
            if self.want_logprobs or prompt_logprobs is not None else None
        self.echo, self.prompt_only, self.tool_mode, self.reasoning = echo, prompt_only, tool_mode, reasoning
        self.one_call, self.chat_echo = one_call, chat_echo      # chat_echo: vLLM's chat echo, before each content
        self.return_token_ids, self._prompt_ids_sent = return_token_ids, False
        self._prompt_lps: dict[int, list] = {}     # leader index -> its prompt's scored tokens

    # ---- replica events --------------------------------------------------------------------
    def _lead(self, index: int) -> int:
        """The index of the sibling that leads ``index``'s prompt group."""
        return index - index % self.per_prompt

    def _call(self, index: int):
        """Choice ``index``'s stream: straight to its replica for a pinned class when the
        gateway takes direct streams (``direct_stream``), else a Serve handle call."""
        replica = self._replica_of.get(self._lead(index)) if index % self.per_prompt else None
        request = self.reqs[index]
        router = KVAwareRouter.for_handle(self.gw.llm) \
            if request.pinned and self.gw.config.get("direct_streams") else None
        if router is None:
            return self._serve_call(index, replica)
        return DirectStream(functools.partial(router.route_direct, replica_id=replica),
                            router.direct_done, request,
                            functools.partial(self._serve_call, index, replica))

    def _serve_call(self, index: int, replica: str | None):
        generate = self.gw.llm.options(stream=True).generate
        if not index:
            return generate.remote(self.reqs[0])
        with own_serve_request_id(f"choice{index}"):
            if replica is not None:
                return generate.remote(self.reqs[index], replica_id=replica)
            return generate.remote(self.reqs[index])

    async def events(self, index: int = 0) -> AsyncIterator[dict]:
        """Token events of choice ``index``, retried on replica failure before its first token."""
        lead = self._lead(index)
        if index != lead:
            await self._prefilled[lead].wait()
        started = finished = False
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self._streams[index] = self._call(index)
            try:
                async for event in self._streams[index]:
                    if "error" in event:
                        _raise_error_event(event)
                    if not started and index == 0:
                        stream = self._streams.get(0)
                        direct = isinstance(stream, DirectStream) and stream.replica is not None
                        self.transport = "direct" if direct else "serve"
                    started = True
                    self._observe(index + event.get("beam", 0), event)
                    if index == lead:
                        self._prefilled[lead].set()    # its prompt is cached now: siblings go
                    finished = finished or event.get("finish_reason") is not None
                    yield event
                self._streams.pop(index, None)
                if not finished:      # the replica ended the stream early: the request was aborted
                    yield {"token_ids": [], "text": "", "finish_reason": "abort"}
                return
            except REPLICA_ERRORS as e:
                self._streams.pop(index, None)
                if started or attempt == MAX_ATTEMPTS:
                    self.status = "replica_failed"
                    raise APIError(503, f"the replica serving this request failed ({type(e).__name__}); "
                                   "retry the request", "replica_failed", headers={"Retry-After": "1"}) from e
                logger.warning("replica failed before the first token (attempt %d): %r", attempt, e)
                exclude_failed_replica(self.reqs[index].metadata)
                await asyncio.sleep(0.2 * attempt)
            finally:
                if index == lead:
                    self._prefilled[lead].set()    # failed or done: siblings go on their own
                self._cancel(index)            # the client went away (or an error event): abort

    async def all_events(self) -> AsyncIterator[tuple[int, dict]]:
        """``(choice index, event)`` of every sibling, in arrival order; the first error wins."""
        if len(self.reqs) == 1:
            async for event in self.events(0):
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for event in self.events(index):
                    await queue.put((index + event.get("beam", 0), event, None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((index, None, e))
            await queue.put((index, None, None))

        tasks = [asyncio.create_task(pump(i)) for i in self.called]
        try:
            open_ = len(tasks)
            while open_:
                index, event, error = await queue.get()
                if error is not None:
                    raise error
                if event is None:
                    open_ -= 1
                    continue
                yield index, event
        finally:
            for task in tasks:
                task.cancel()

    @property
    def called(self) -> list[int]:
        """The siblings sent to a replica: all, but a beam search's leader alone answers its
        group's choices (one event per beam, ``"beam": j`` for choice ``lead + j``)."""
        return [i for i in range(len(self.reqs)) if self.reqs[self._lead(i)].beam is None or i == self._lead(i)]

    def cancel(self) -> None:
        """Abort every sibling still running on its replica (idempotent)."""
        for index in list(self._streams):
            self._cancel(index)

    def _cancel(self, index: int) -> None:
        stream = self._streams.pop(index, None)
        if stream is not None:
            stream.cancel()

    def _observe(self, index: int, event: dict) -> None:
        now, choice = time.perf_counter(), self.choices[index]
        n = len(event.get("token_ids", ()))
        if n and self.first_token_at is None:
            self.first_token_at = now
            self.replica_ms = event.get("replica_ms")
            decision_ms = self.req.metadata.get("router_decision_ms")
            if decision_ms is not None:
                self.gw.metrics.router_decision(decision_ms / 1000.0)
        elif n and choice.last_token_at is not None:
            self.gw.metrics.inter_token_latency(self.req.tenant, self.req.qos, (now - choice.last_token_at) / n)
        if n:
            choice.last_token_at = now
        choice.tokens += n
        if self.return_token_ids:
            choice.ids += event.get("token_ids", ())
        choice.cached_tokens = event.get("num_cached_tokens", choice.cached_tokens)
        choice.stop_reason = event.get("stop_reason", choice.stop_reason)
        choice.reasoning_tokens = event.get("num_reasoning_tokens", choice.reasoning_tokens)
        if "prompt_logprobs" in event:
            self._prompt_lps[index] = event["prompt_logprobs"]
        if index % self.per_prompt == 0 and "replica_id" in event:
            self._replica_of[index] = event["replica_id"]
            if index == 0:
                self.replica_id = event["replica_id"]

    # ---- accounting ------------------------------------------------------------------------
    @property
    def completion_tokens(self) -> int:
        return 0 if self.prompt_only else sum(c.tokens for c in self.choices)

    @property
    def prompt_tokens(self) -> int:
        """Each prompt once (its ``n`` choices share it)."""
        return sum(len(self.reqs[lead].prompt_token_ids) for lead in self.leaders)

    @property
    def cached_tokens(self) -> int:
        return sum(self.choices[lead].cached_tokens for lead in self.leaders)

    async def finish(self) -> None:
        """Record metrics and release the admission ticket; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        m, tenant, qos = self.gw.metrics, self.req.tenant, self.req.qos
        prompt = self.prompt_tokens
        m.request_finished(tenant, qos, self.status, self.gw.ingress)
        m.request_latency(tenant, qos, time.perf_counter() - self.start)
        m.tokens(tenant, qos, prompt, self.cached_tokens, self.completion_tokens)
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.start
            m.ttft(tenant, qos, ttft, self.gw.ingress)
            slo_ms = self.principal.qos.ttft_slo_ms
            if slo_ms:
                m.slo(tenant, qos, ttft * 1000.0 <= slo_ms)
        self.gw.request_done(qos, self.req.request_id)
        try:
            await self.gw.admitter.release(self.ticket, prompt + self.completion_tokens)
        except Exception:  # noqa: BLE001 - never fail a finished request on accounting
            logger.exception("admission release failed")

    @property
    def want_logprobs(self) -> bool:
        """The answer carries logprobs (``top_k`` alternatives a token)."""
        return self.top_k is not None

    def usage(self) -> dict:
        prompt = self.prompt_tokens
        usage = {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                 "total_tokens": prompt + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.reasoning is not None:                  # vLLM's, with a parser; 0 with thinking off
            thought = sum(c.reasoning_tokens for c in self.choices) if self.reasoning[1] else 0
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}
        return usage

    # ---- OpenAI shapes ---------------------------------------------------------------------
    def _answer(self, index: int, event: dict) -> tuple[str, dict | None]:
        """``event``'s text and logprobs object, with the prompt's before them when it is the
        first event of an echoed choice."""
        if self.echo is None:
            return event.get("text", ""), self._event_logprobs(index, event)
        choice, head, parts = self.choices[index], "", []
        if not choice.echoed:
            choice.echoed = True
            lead = self._lead(index)
            head = self.echo[lead // self.per_prompt]
            if self.want_logprobs and lead in self._prompt_lps:
                parts.append(shapes.prompt_logprobs(self._prompt_lps[lead], self.reqs[lead].prompt_token_ids,
                                                    self._text_of, self.top_k))
                choice.chars = sum(map(len, parts[0]["tokens"]))
        if self.prompt_only:
            return head, shapes.merge_logprobs(parts, False)
        part = self._event_logprobs(index, event)
        parts += [part] if part is not None else []
        return head + event.get("text", ""), shapes.merge_logprobs(parts, False)

    def _final_choice(self, index: int, c) -> dict:
        text, logprobs = "".join(c.text), shapes.merge_logprobs(c.logprobs, self.chat)
        said = None
        if self.reasoning is not None:
            said, text = reasoning.split(text, *self.reasoning[:2])
        content, calls = self._calls(text, c.finish_reason)
        if calls is None:
            out = shapes.choice(index, text, c.finish_reason, self.chat, final=True, logprobs=logprobs)
        else:
            out = shapes.tool_choice(index, calls, self._tool_reason(c.finish_reason), logprobs, content)
        if self.reasoning is not None:
            out["message"]["reasoning"] = said if self.reasoning[2] else None
        if self.chat_echo:
            out["message"]["content"] = self.chat_echo + (out["message"]["content"] or "")
        if self.prompt_k is not None and not self.chat:
            out["prompt_logprobs"] = self._vllm_prompt_logprobs(self._lead(index))
        out["stop_reason"] = None if self.prompt_only else c.stop_reason
        return out

    def _vllm_prompt_logprobs(self, lead: int) -> list[dict | None] | None:
        scored = self._prompt_lps.get(lead)
        return None if scored is None else shapes.vllm_prompt_logprobs(
            scored, self.reqs[lead].prompt_token_ids, self._text_of, self.prompt_k)

    def _finish_reason(self, event: dict) -> str | None:
        reason = event.get("finish_reason")
        return "length" if self.prompt_only and reason not in (None, "abort") else reason

    def _event_logprobs(self, index: int, event: dict) -> dict | None:
        lps = event.get("logprobs")
        if not self.want_logprobs or lps is None:
            return None
        ids = event.get("token_ids", [])
        if self.chat:
            return shapes.chat_logprobs(lps, ids, self._text_of)
        part = shapes.completion_logprobs(lps, ids, self._text_of, self.choices[index].chars)
        self.choices[index].chars += sum(len(t) for t in part["tokens"])
        return part

    def timings_ms(self) -> dict[str, float]:
        """Where this request's time to first token went, in ms (only the phases it reached).

        ``proxy`` (Serve's proxy received the request -> the gateway did: the proxy's queue and
        its call to a gateway; only behind Serve's proxy), ``parse`` (the gateway received it ->
        its route handler ran: reading, parsing and validating the body), ``queue``
        (class-queue place), ``tokenize`` (prompt ids and length checks), ``admit`` (tenant
        limits), ``first_token`` (admitted -> first token at the gateway: routing, the replica
        call and the engine), ``replica`` (the replica's share of it: its inbox, scheduling and
        prefill), ``hops`` (``first_token`` - ``replica``: router and Ray).
        """
        m, out, prev = self.marks, {}, None
        for mark, phase in (("proxied", None), ("received", "proxy"), ("arrived", "parse"),
                            ("queued", "queue"), ("tokenized", "tokenize"), ("admitted", "admit")):
            if mark in m:
                if prev is not None:                 # a phase ends at each mark after the first
                    out[phase] = round((m[mark] - prev) * 1000, 3)
                prev = m[mark]
        if self.first_token_at is not None and "admitted" in m:
            out["first_token"] = round((self.first_token_at - m["admitted"]) * 1000, 3)
            if self.replica_ms is not None:
                out["replica"] = round(self.replica_ms, 3)
                out["hops"] = round(out["first_token"] - self.replica_ms, 3)
        return out

    def _envelope(self, choices: list, chunk: bool, final: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        extra = {"replica_id": self.replica_id}
        if final:
            extra["timings_ms"] = self.timings_ms()
            extra["transport"] = self.transport
        return {"id": self.req.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, "service_tier": answered_tier(self.principal), "kvharbor": extra}

    def _chunk(self, choices: list, with_usage: bool) -> dict:
        for c in choices:                       # vLLM's stop_reason, on each choice's last chunk
            if c["finish_reason"] is not None:
                c["stop_reason"] = self.choices[c["index"]].stop_reason
        chunk = self._envelope(choices, chunk=True)
        if with_usage:
            chunk["usage"] = self.usage()
        return self._token_ids(chunk)

    def _token_ids(self, out: dict) -> dict:
        """vLLM's ``return_token_ids`` on a response or chunk ``out``: each choice's output
        token ids (in a chunk, those not sent yet; none on a chat's role chunk) and the
        prompt's (chat: on the response, or the stream's first chunk; completions: on each
        choice, or its first chunk)."""
        if not self.return_token_ids:
            return out
        for c in out["choices"]:
            choice = self.choices[c["index"]]
            if "role" in c.get("delta", ()):
                continue
            c["token_ids"], choice.ids = [] if self.prompt_only else choice.ids, []
            if not self.chat and not choice.prompt_ids_sent:
                c["prompt_token_ids"] = self.reqs[self._lead(c["index"])].prompt_token_ids
                choice.prompt_ids_sent = True
        if self.chat and not self._prompt_ids_sent:
            out["prompt_token_ids"], self._prompt_ids_sent = self.req.prompt_token_ids, True
        return out

    @asynccontextmanager
    async def accounted(self):
        """Around reading a whole answer: its status ("ok" unless an APIError, which passes),
        then every sibling still running aborted and ``finish``."""
        try:
            yield
            self.status = "ok"
        except APIError:
            self.status = "error" if self.status == "aborted" else self.status
            raise
        finally:
            self.cancel()
            await self.finish()

    async def complete(self) -> dict:
        """Non-streaming: the whole answer as one OpenAI response."""
        async with self.accounted():
            async for index, event in self.all_events():
                choice = self.choices[index]
                text, part = self._answer(index, event)
                choice.text.append(text)
                choice.finish_reason = self._finish_reason(event) or choice.finish_reason
                if part is not None:
                    choice.logprobs.append(part)
        choices = [self._final_choice(i, c) for i, c in enumerate(self.choices)]
        out = {**self._envelope(choices, chunk=False, final=True), "usage": self.usage()}
        if self.prompt_k is not None and self.chat:
            out["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        return self._token_ids(out)

    async def stream_chunks(self, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[dict | str]:
        """Streaming: one chunk per event (``stream_interval`` tokens, see
        ``kvharbor.actors.stream_events``), an error event on failure, then ``[DONE]``.
        ``continuous_usage``: every chunk carries the usage so far.

        Nothing is sent before the first event (a chat stream's role chunk comes with it): an
        error before then, a request the replica refuses (it can never fit in the KV cache) or
        no replica able to take it, is raised, and ``RunStream`` answers it with its own HTTP
        status and JSON body, as vLLM answers a stream's invalid request and as a non-streamed
        request is answered; not as a 200 stream that carries the error."""
        started = False
        try:
            async for index, event in self.all_events():
                if not started and self.chat:
                    yield self._chunk([shapes.choice(i, "", None, True, final=False, first=True)
                                       for i in range(len(self.reqs))], continuous_usage)
                    if self.chat_echo:
                        yield self._chunk([shapes.choice(i, self.chat_echo, None, True, final=False)
                                           for i in range(len(self.reqs))], continuous_usage)
                started = True
                text, part = self._answer(index, event)
                if self.reasoning is not None or self.tool_mode is not None:
                    chunk = (self._parsed_chunk if self.reasoning is not None or self.tool_mode == "auto"
                             else self._tool_chunk)(index, text, event, part)
                    if chunk is not None:
                        yield self._chunk([chunk], continuous_usage)
                    continue
                yield self._chunk([shapes.choice(index, text, self._finish_reason(event), self.chat,
                                                 final=False, logprobs=part)], continuous_usage)
            self.status = "ok"
            if include_usage:
                yield {**self._envelope([], chunk=True, final=True), "usage": self.usage()}
        except APIError as e:
            self.status = "error" if self.status == "aborted" else self.status
            if not started:
                raise
            yield {"error": {"message": e.message, "type": error_type(e.status), "param": e.param,
                             "code": e.code}}
        finally:
            self.cancel()
            await self.finish()
        yield "[DONE]"


def _raise_error_event(event: dict) -> None:
    """A replica's error event: retryable 5xx -> ReplicaFailed, anything else -> APIError."""
    status = int(event.get("status", 500))
    if status >= 500 and event.get("retryable", True):
        raise ReplicaFailed(event["error"])
    code = event.get("code") or ("engine_step_failed" if status >= 500 else "invalid_request_error")
    raise APIError(status, event["error"], code)
