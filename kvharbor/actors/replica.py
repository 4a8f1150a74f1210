"""LLMReplica: one engine per Serve replica, stepped by an asyncio task.

Concurrency: the engine is not thread-safe. The step loop runs each step in a worker thread
(``_step_in_thread``: drain the inbox, apply aborts, ``engine.step``, take a stats snapshot)
while ``_engine_lock`` is held; the event loop touches the engine only under that lock
(background: tenants.yaml reload, directory resync, metrics). New requests and aborts never
wait for the lock: they go into thread-safe inboxes (``collections.deque``) that the step
thread drains at every step boundary, so a premium arrival joins the very next step; it also
``engine.announce``s its class, so a latency-budgeted arrival can cut a lower-class step in
flight short instead of waiting for it (``StepInterrupt``).
``stats()`` and ``record_routing_stats()`` answer from the snapshot taken at the last step
boundary and never read engine state the step thread may be changing.

    generate() ──append──▶ inbox ──┐
    abort()    ──append──▶ aborts ─┤ step thread: drain ▶ engine.step ▶ snapshot
                                   ▼
                 outputs / rejections ──▶ per-request asyncio queues (event loop)

A request aborted by ``abort()`` (not by its client) ends its stream with finish_reason
"abort". A failed step is isolated to its suspects (``_suspects``): the requests that have not produced
a token yet, when there are some and others besides them (each of the others has come through a
step that succeeded with its whole prompt). Only the suspects are failed, with a non-retryable error event (the gateway must not
send a request that breaks steps to another replica); the others keep running. A step that
fails with no newcomer, or with only newcomers, fails every request in it. A failure after the
forward, while the engine accounts for one request's tokens (``Engine.take_failures``), fails
that request alone, and the others' tokens of that step are delivered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ray import serve

from kvharbor.actors.beam_runs import beam_events
from kvharbor.actors.calls import start_background
from kvharbor.actors.replica_sync import DirectorySync
from kvharbor.actors.stream_events import coalesced, is_last
from kvharbor.actors.tenant_sync import TenantSync
from kvharbor.config import EngineConfig
from kvharbor.engine.engine_stats import lora_requests, memory_breakdown
from kvharbor.engine.pooling import PooledOutput, PoolingParams
from kvharbor.engine.request import SamplingParams
from kvharbor.observability.metrics import get_metrics
from kvharbor.platform.autoscaling import DIRECT_STREAMS
from kvharbor.platform.direct_stream import DirectStreamServer
from kvharbor.platform.loopback import serve_grpc_on_node_address
from kvharbor.platform.protocol import GenerateRequest, RoutingStats, session_key

logger = logging.getLogger("kvharbor.replica")

STATS_PERIOD_S = 1.0
ORPHAN_CHECK_S = 2.0              # how often the callers of live streams are checked for life
MAX_REPORTED_SESSIONS = 4096      # session keys in routing stats (most recently used)
DEFAULT_GRACEFUL_SHUTDOWN_S = 20.0  # Serve's default graceful_shutdown_timeout_s


class LLMReplica:
    """Serve deployment class (decorated in ``kvharbor.platform.app``).

    Args:
        engine_config: ``EngineConfig`` fields.
        tenants_path: tenants.yaml to read QoS classes, pinned prefixes and reservations from.
        directory_name: named PrefixDirectory actor to send KV events to (None: no directory).
        cpu_threads: torch threads (CPU replicas).
        nice: OS nice increment of the thread that runs engine steps (CPU replicas): the
            gateway and proxy, which every request crosses before it reaches an engine, and
            this replica's own event loop (which takes requests in and streams tokens out) then
            get the cores before the steps' compute.
        direct_streams: listen for gateways' direct streams (``kvharbor.platform.
            direct_stream``) on the node's address; the address goes out in routing stats.
    """

    def __init__(self, engine_config: dict, tenants_path: str | None = None,
                 directory_name: str | None = None, cpu_threads: int | None = None,
                 nice: int = 0, direct_streams: bool = False) -> None:
        serve_grpc_on_node_address()           # Serve's own gRPC server, on loopback too
        # Engine steps run on a thread of their own, niced on a CPU host: the request path
        # (gateway, proxy, this replica's loop) preempts their compute, not the other way round.
        self._step_pool = ThreadPoolExecutor(1, "kvharbor-step", initializer=_lower_priority,
                                             initargs=(nice,))
        if cpu_threads:
            import torch  # noqa: PLC0415

            torch.set_num_threads(cpu_threads)
        self.tenants = TenantSync(tenants_path) if tenants_path else None
        config = EngineConfig(**engine_config)
        if self.tenants:
            config = self.tenants.apply_to_config(config)
        # Imported here: torch loads in the replica's process, not in the one building the app.
        from kvharbor.engine.engine import Engine  # noqa: PLC0415

        self.engine = Engine(config)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (unit tests)
            self.replica_id = f"local-{os.getpid()}"
        self.directory = DirectorySync(directory_name, self.replica_id, namespace="kvharbor") \
            if directory_name else None
        if self.tenants:
            self.tenants.pin_prefixes(self.engine)
            self.tenants.apply_session_limits(self.engine)
            self.tenants.sync_adapters(self.engine)
        self._streams: dict[str, asyncio.Queue] = {}
        self._meta: dict[str, GenerateRequest] = {}
        self._arrived: dict[str, float] = {}   # perf_counter() when generate() was called
        self._inbox: deque = deque()           # (GenerateRequest, SamplingParams), thread-safe
        self._aborts: deque = deque()          # request ids, thread-safe
        self._snapshot: dict = self._take_snapshot()
        self._engine_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._bg_task: asyncio.Task | None = None
        self._failed: BaseException | None = None
        self._orphans_checked = 0.0
        self.metrics = get_metrics()
        self._reported: dict = {"evictions": 0}      # counters already exported
        self._direct = (DirectStreamServer(self.generate, _node_address()) if direct_streams
                        else None)

    # ---- public methods (called through the DeploymentHandle) ----------------------------
    async def generate(self, request: GenerateRequest, replica_id: str | None = None) -> AsyncIterator[dict]:
        """Stream events for one request: ``{"token_ids", "text", "finish_reason", ...}``,
        ``request.stream_interval`` tokens per event after the first (``stream_events``).

        ``replica_id`` (read by the router) pins the call to that replica, e.g. the sibling of
        an ``n > 1`` request to the replica that holds the prompt's KV.

        A bad request yields one ``{"error": ..., "status": 400}`` event. If the caller goes
        away (the stream is cancelled), the request is aborted and its blocks freed.
        """
        self._ensure_loop()
        if request.beam is not None:        # its rounds come back through this method
            async for event in beam_events(self.generate, request, self.engine, self.replica_id):
                yield event
            return
        queue: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        try:
            sampling = SamplingParams(**request.sampling)
            if sampling.structured_outputs is not None:   # compiled off the loop and the step
                sampling.validate()
                await asyncio.to_thread(self.engine.grammars.compile, sampling.structured_outputs)
            if (request.lora is not None and self.tenants
                    and request.lora not in self.engine.loras.adapters):    # added a moment ago
                await asyncio.to_thread(self.tenants.ensure_adapter, self.engine, request.lora)
        except (TypeError, ValueError) as e:
            yield {"error": f"bad sampling parameters: {e}", "status": 400, "retryable": False}
            return
        if rid in self._streams:
            yield {"error": f"request id {rid!r} is already in use", "status": 400, "retryable": False}
            return
        self._streams[rid], self._meta[rid] = queue, request
        self._arrived[rid] = time.perf_counter()
        self._inbox.append((request, sampling))
        self.engine.announce(request.qos)       # a premium arrival may cut the step in flight
        self._wake.set()
        finished = False
        try:
            async for event in coalesced(queue, request.stream_interval):
                finished = is_last(event)
                yield event
        finally:
            self._streams.pop(rid, None)
            self._meta.pop(rid, None)
            self._arrived.pop(rid, None)
            if not finished:
                self._aborts.append(rid)
                self._wake.set()

    async def abort(self, request_id: str, replica_id: str | None = None) -> bool:
        """Stop a request server-side; its stream ends with finish_reason "abort".

        ``replica_id`` is read by the router, which then sends the call to that replica.
        Returns False when this replica does not run ``request_id``.
        """
        queue = self._streams.get(request_id)
        if queue is None:
            return False
        self._aborts.append(request_id)
        queue.put_nowait({"token_ids": [], "text": "", "finish_reason": "abort",
                          "replica_id": self.replica_id})
        self._wake.set()
        return True

    async def record_routing_stats(self) -> dict:
        """Queue by priority and free blocks per region, for the KV-aware router (from the
        snapshot of the last step boundary)."""
        self._ensure_loop()
        if self._direct is not None:
            try:
                await self._direct.start()
            except OSError:              # no port to listen on: gateways keep Serve's path
                logger.exception("direct streams are off on this replica")
                self._direct = None
        snap = self._snapshot
        stats = snap["stats"]
        # Arrivals still in the inbox count as waiting: the router adds only what it sent
        # after this report.
        return RoutingStats(self.replica_id, self.engine.block_size, stats["shared_blocks_free"],
                            stats["pinned_blocks_total"] - stats["pinned_blocks_used"],
                            stats["blocks_total"], stats["num_running"],
                            stats["num_waiting"] + len(self._inbox), snap["queue_by_priority"],
                            self._session_keys(), time.time(),
                            stats["shared_blocks_empty"], stats["shared_blocks_total"],
                            self._direct.address if self._direct is not None else None).as_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: the direct streams open here, which Serve's
        ongoing-request count leaves out (``kvharbor.platform.autoscaling`` adds them)."""
        return {DIRECT_STREAMS: float(self._open_direct_streams())}

    def _open_direct_streams(self) -> int:
        return self._direct.open_streams if self._direct is not None else 0

    def _session_keys(self) -> list[str]:
        """``session_key`` of the sessions held here (newest last, at most
        ``MAX_REPORTED_SESSIONS``). ``list(dict)`` copies atomically under the GIL."""
        held = list(self.engine.sessions.sessions)[-MAX_REPORTED_SESSIONS:]
        memo = getattr(self, "_key_memo", {})
        self._key_memo = {k: memo.get(k) or session_key(*k) for k in held}
        return list(self._key_memo.values())

    async def fork_session(self, tenant: str, source: str, target: str) -> dict | None:
        """Start session ``target`` from ``source`` here (shared blocks, no recompute):
        ``{"blocks": n}``, ``{"error": why}`` when ``target`` exists, None when ``source`` is
        not held here."""
        async with self._engine_lock:
            try:
                held = self.engine.fork_session(tenant, source, target)
            except ValueError as e:
                return {"error": str(e)}
            self._snapshot = self._take_snapshot()
        return None if held is None else {"blocks": held}

    async def flush_cache(self, salts: list | None = None, tenants: list | None = None) -> dict:
        """Drop this replica's cached KV (``Engine.flush_cache``: all, or only the scopes
        ``salts`` and the sessions of ``tenants``) and publish the removals to the prefix
        directory now. Returns the counts by kind."""
        async with self._engine_lock:
            counts = self.engine.flush_cache(salts, tenants)
            self._publish_events()
            self._snapshot = self._take_snapshot()
        return counts

    async def end_session(self, tenant: str, session_id: str) -> int | None:
        """End a session here now (its blocks return to the LRU): block references released,
        or None when this replica holds no such session."""
        async with self._engine_lock:
            released = self.engine.end_session(tenant, session_id)
            self._snapshot = self._take_snapshot()
        return released

    async def check_health(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"engine loop died: {self._failed!r}")

    async def stats(self, replica_id: str | None = None) -> dict:
        """Engine stats plus this replica's id (for tests and /admin).

        ``replica_id`` is read by the router, which then sends the call to that replica.
        """
        return {**self._snapshot["stats"], "replica_id": self.replica_id}

    async def check_integrity(self, replica_id: str | None = None) -> dict:
        """Assert the engine's invariants; return its cached hashes and usage (router-targetable)."""
        async with self._engine_lock:
            self.engine.check_integrity()
            return {"replica_id": self.replica_id, "cached": sorted(self.engine.cached_block_hashes() | self.engine.host_block_hashes()),
                    "blocks_used": self.engine.stats()["blocks_used"], "running": len(self._streams)}

    def __del__(self):
        """Graceful shutdown (scale-down, redeploy, delete): the directory forgets this
        replica's blocks.

        Serve calls this once the requests it counts have finished, on the replica's event
        loop, and awaits what it returns. It does not count direct streams; so while some are
        open (under Serve, never on garbage collection: their tasks hold this object), this
        returns a coroutine that stops taking new ones, lets the open ones finish within the
        deployment's ``graceful_shutdown_timeout_s`` and then shuts down. Otherwise it shuts
        down now and returns None.
        """
        direct = getattr(self, "_direct", None)
        if direct is not None and direct.open_streams:
            return self._drain_then_release(direct)
        self._release()
        return None

    async def _drain_then_release(self, direct: DirectStreamServer) -> None:
        left = await direct.drain(_graceful_shutdown_s())
        if left:
            logger.warning("shutting down with %d direct streams still open", left)
        self._release()

    def _release(self) -> None:
        pool = getattr(self, "_step_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        direct = getattr(self, "_direct", None)
        if direct is not None:
            direct.close()
        directory = getattr(self, "directory", None)
        if directory is not None:
            try:
                directory.close()
            except Exception:  # noqa: BLE001 - best effort; the router also forgets dead replicas
                pass

    # ---- engine loop ---------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        """Start the engine loop on the running event loop (once per event loop).

        Serve calls every method on one loop. Outside Serve (tests, scripts calling
        ``asyncio.run`` twice) the first loop may be gone: its tasks never run again, so the
        loop, its lock and its wake event are made anew on the current one.
        """
        loop = asyncio.get_running_loop()
        if self._loop_task is not None:
            old = self._loop_task.get_loop()
            if old is loop:
                return
            if not old.is_closed():
                raise RuntimeError("this LLMReplica's engine loop runs on another event loop; "
                                   "call it from that loop")
        self._engine_lock, self._wake = asyncio.Lock(), asyncio.Event()
        # Started by whichever request came first, but no child of it (calls.start_background).
        self._loop_task = start_background(self._run(), loop)
        self._bg_task = start_background(self._background(), loop)

    async def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished() and not self._aborts and not self._inbox:
                    self._wake.clear()
                    await self._wake.wait()
                async with self._engine_lock:
                    outputs, ended = await self._step()
                    for rid, event in ended:
                        queue = self._streams.get(rid)
                        if queue is not None:
                            queue.put_nowait(event)
                    for out in outputs:
                        self._dispatch(out)
                    # The streams forward this step's tokens before its KV events go out (an
                    # actor call per batch, ~0.5 ms of a first token's way out otherwise); the
                    # next step starts only after both.
                    await asyncio.sleep(0)
                    self._publish_events()
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise                                     # the replica is shutting down
        except BaseException as e:  # noqa: BLE001 - reported through check_health
            self._failed = e
            logger.exception("engine loop failed")
            for queue in self._streams.values():
                queue.put_nowait({"error": f"replica engine failed: {e!r}", "status": 500})
            raise

    async def _step(self) -> tuple[list, list]:
        """One step boundary + step. A step that raises fails the requests in it, not the replica."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._step_pool,
                                                                     self._step_in_thread)
        except Exception as e:  # noqa: BLE001 - isolate the failure, keep serving
            suspects = self._suspects()
            logger.exception("engine step failed; failing %d of its %d requests", len(suspects),
                             len(self.engine.requests))
            isolated = len(suspects) < len(self.engine.requests)
            for rid in suspects:
                self.engine.abort(rid)
                queue = self._streams.get(rid)
                if queue is not None:
                    queue.put_nowait(_step_failed(type(e).__name__, retryable=not isolated))
            self._snapshot = self._take_snapshot()
            return [], []

    def _suspects(self) -> list[str]:
        """The requests to fail for a failed step (see the module docstring)."""
        running = list(self.engine.requests)
        newcomers = [rid for rid, req in self.engine.requests.items() if not req.num_output_tokens]
        return newcomers if newcomers and len(newcomers) < len(running) else running

    def _step_in_thread(self) -> tuple[list, list[tuple[str, dict]]]:
        """Worker thread: drain inboxes, step, snapshot. Returns (outputs, the last event of
        each request refused or failed alone)."""
        rejected = self._drain_inbox()
        while self._aborts:
            self.engine.abort(self._aborts.popleft())
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        if not outputs and not self.engine.scheduler.running and self.engine.has_unfinished():
            rejected += list(self.engine.reject_unfittable().items())
        self._snapshot = self._take_snapshot()
        ended = [(rid, _refused(message)) for rid, message in rejected]
        ended += [(rid, _step_failed(type(e).__name__, retryable=False))
                  for rid, e in self.engine.take_failures().items()]
        return outputs, ended

    def _drain_inbox(self) -> list[tuple[str, str]]:
        rejected = []
        self.engine.interrupt.clear()           # before draining: later arrivals announce again
        while self._inbox:
            request, sampling = self._inbox.popleft()
            try:
                self.engine.add_request(request.request_id, request.prompt_token_ids, sampling,
                                        tenant=request.tenant, qos=request.qos,
                                        cache_salt=request.cache_salt, session_id=request.session_id,
                                        lora=request.lora, request_salt=request.request_salt,
                                        pooling=request.pooling and PoolingParams(**request.pooling))
            except (TypeError, ValueError) as e:
                rejected.append((request.request_id, str(e)))
        return rejected

    def _take_snapshot(self) -> dict:
        """Stats at a step boundary (O(running requests + waiting tenants) for the queue by
        priority, O(1) otherwise)."""
        return {"stats": self.engine.stats(),
                "queue_by_priority": self.engine.scheduler.requests_by_priority()}

    def _dispatch(self, out) -> None:
        queue = self._streams.get(out.request_id)
        if queue is None:
            return
        meta = self._meta.get(out.request_id)
        if meta is not None and out.num_output_tokens == 1 and meta.metadata.get("router_policy") == "kv_aware":
            # The router's prediction for *this* replica (Serve may have used a lower rank).
            predicted = meta.metadata.get("router_predicted_by_replica", {}).get(self.replica_id, 0)
            self.metrics.router_prefix_tokens(self.replica_id, int(predicted), out.num_cached_tokens)
        first = {}
        if out.num_output_tokens == len(out.new_token_ids) and out.request_id in self._arrived:
            first["replica_ms"] = (time.perf_counter() - self._arrived[out.request_id]) * 1000.0
        queue.put_nowait({**first, "token_ids": out.new_token_ids, "text": out.new_text,
                          "finish_reason": out.finish_reason, "num_cached_tokens": out.num_cached_tokens,
                          "num_prompt_tokens": len(out.prompt_token_ids),
                          "num_output_tokens": out.num_output_tokens, "replica_id": self.replica_id,
                          **({"stop_reason": out.stop_reason} if out.finish_reason else {}),
                          **({"embedding": out.embedding.numpy().tobytes()}   # float32, as the wire's base64
                             if type(out) is PooledOutput else {}),
                          **({"num_reasoning_tokens": out.num_reasoning_tokens}    # so far: continuous usage shows it
                             if out.num_reasoning_tokens or out.finish_reason else {}),
                          **({"logprobs": [(lp.logprob, lp.top) for lp in out.new_logprobs]}
                             if out.new_logprobs else {}),
                          **({"prompt_logprobs": [lp and (lp.logprob, lp.top, lp.rank) for lp in out.prompt_logprobs]}
                             if out.prompt_logprobs is not None and out.num_output_tokens == len(out.new_token_ids)
                             else {})})

    def _publish_events(self) -> None:
        if self.directory is not None:
            self.directory.publish(self.engine)

    async def _background(self) -> None:
        """Every second: tenants.yaml reload (pinned region, prefixes), directory resync, metrics."""
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            try:
                reloaded = False
                async with self._engine_lock:
                    if self.tenants:
                        reloaded = self.tenants.maybe_reload(self.engine)
                    if self.engine.expire_sessions() or self.tenants:
                        self._snapshot = self._take_snapshot()
                    resync = self.directory.prepare(self.engine) if self.directory else None
                    self._record_metrics()
                if reloaded:                         # checkpoints read off the loop and lock
                    await asyncio.to_thread(self.tenants.sync_adapters, self.engine)
                if self.directory is not None:       # awaited off the engine lock
                    await self.directory.settle(resync)
                await self._abort_orphans()
            except Exception:  # noqa: BLE001 - keep serving; the error is logged
                logger.exception("replica background task failed")

    async def _abort_orphans(self) -> int:
        """Abort the streams whose caller (the gateway actor reading them) has died.

        Ray does not reliably cancel an actor's streaming call when the caller is killed, and
        such a stream would otherwise generate to nobody until ``max_tokens``, holding its
        blocks and a place in every step. Checked every ``ORPHAN_CHECK_S``, off the engine lock.
        Returns how many streams were aborted.
        """
        now = time.monotonic()
        if now - self._orphans_checked < ORPHAN_CHECK_S:
            return 0
        self._orphans_checked = now
        callers = {m.caller for m in self._meta.values() if m.caller is not None}
        dead = [c for c in callers if not await asyncio.to_thread(_actor_alive, *c)]
        if not dead:
            return 0
        orphans = [rid for rid, m in list(self._meta.items()) if m.caller in dead]
        for rid in orphans:
            await self.abort(rid)
        logger.warning("aborted %d streams whose caller died: %s", len(orphans), dead)
        return len(orphans)

    def _record_metrics(self) -> None:
        m, e, rid = self.metrics, self.engine, self.replica_id
        for region in ("pinned", "shared"):
            counts = e.pool.region_counts(region)
            if region == "pinned":      # idle pinned blocks are reserved, not wasted
                counts = {**counts, "reserved": counts["free"] + counts["cached"], "free": 0, "cached": 0}
            for state in ("used", "cached", "free", "reserved"):
                m.kv_blocks(rid, region, state, counts.get(state, 0))
        per_tenant: dict[str, int] = {}
        waiting = dict.fromkeys(e.config.qos_classes, 0)
        running = dict(waiting)
        for req in e.scheduler.running:
            per_tenant[req.tenant] = per_tenant.get(req.tenant, 0) + len(req.blocks)
            running[req.qos] = running.get(req.qos, 0) + 1
        for req in e.scheduler.waiting:
            waiting[req.qos] = waiting.get(req.qos, 0) + 1
        m.lora_requests(rid, lora_requests(e))
        m.kv_occupancy_by_tenant(rid, per_tenant)
        m.memory_bytes(rid, memory_breakdown(e))
        for qos in waiting:
            m.queue_length(rid, qos, waiting[qos])
            m.running(rid, qos, running[qos])
        sched = e.scheduler
        m.pinned_region(rid, {"size": e.pool.num_pinned, "target": sched.sizer.target(),
                              "floor": sched.sizer.floor, "ceiling": sched.sizer.ceiling,
                              "demand_peak": sched.sizer.peak})
        for name, report, n in (("trimmed", m.step_budget_trims, sched.num_trimmed),
                                ("interrupted", m.steps_interrupted, e.interrupt.num_interrupted),
                                ("prefix_waits", m.prefix_waits, sched.num_prefix_waits)):
            report(rid, n - self._reported.get(name, 0))
            self._reported[name] = n
        if e.spec is not None:
            m.spec_decode_tokens(rid, e.spec.draft_tokens - self._reported.get("drafts", 0),
                                 e.spec.accepted_tokens - self._reported.get("accepted", 0))
            self._reported["drafts"], self._reported["accepted"] = e.spec.draft_tokens, e.spec.accepted_tokens
        m.replica_up(rid, True)
        m.direct_streams(rid, self._open_direct_streams())
        self._record_session_metrics()
        m.evictions(rid, e.pool.num_evictions - self._reported["evictions"])
        self._reported["evictions"] = e.pool.num_evictions
        for qos, n in e.scheduler.preemptions_by_qos.items():
            m.preemptions(rid, qos, n - self._reported.get(("preempt", qos), 0))
            self._reported[("preempt", qos)] = n

    def _record_session_metrics(self) -> None:
        """Sessions held, their blocks by tenant (0 for tenants that had some), and counter deltas."""
        sessions, rid = self.engine.sessions, self.replica_id
        by_tenant = sessions.blocks_by_tenant()
        seen = self._reported.setdefault("session_tenants", set())
        blocks = {**dict.fromkeys(seen, 0), **by_tenant}
        seen.update(by_tenant)
        expired = sessions.expirations - self._reported.get("session_expired", 0)
        hits = sessions.hit_tokens - self._reported.get("session_hits", 0)
        self.metrics.sessions(rid, len(sessions.sessions), blocks, expired, hits)
        self._reported["session_expired"], self._reported["session_hits"] = sessions.expirations, sessions.hit_tokens


def _node_address() -> str:
    """This Ray node's address (loopback outside Ray)."""
    import ray  # noqa: PLC0415

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _graceful_shutdown_s() -> float:
    """The deployment's ``graceful_shutdown_timeout_s`` (Serve kills the replica that long
    after it asked it to stop); Serve's default outside a replica."""
    try:
        return float(serve.get_replica_context()._deployment_config.graceful_shutdown_timeout_s)
    except Exception:  # noqa: BLE001 - outside Serve, or a Serve without the field
        return DEFAULT_GRACEFUL_SHUTDOWN_S


def _actor_alive(namespace: str, name: str) -> bool:
    """False only when no live actor has this name (a dead actor's name is freed)."""
    import ray  # noqa: PLC0415

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    except Exception:  # noqa: BLE001 - GCS unreachable: assume alive, check again later
        return True
    return True


def _refused(message: str) -> dict:
    return {"error": message, "status": 400, "retryable": False}


def _step_failed(why: str, retryable: bool) -> dict:
    return {"error": f"the engine step failed on this request ({why}); it was not retried",
            "status": 500, "code": "engine_step_failed", "retryable": retryable}


def _lower_priority(nice: int) -> None:
    """Step-thread initializer: raise this thread's nice value by ``nice`` (on Linux a nice
    value belongs to a thread; threads it starts later, e.g. torch's OpenMP workers, inherit it)."""
    if nice:
        os.nice(nice)
