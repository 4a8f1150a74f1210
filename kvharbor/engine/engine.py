"""The engine: add requests, step, stream outputs. Driven by ``LLM`` or the replica actor."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from kvharbor.config import EngineConfig
from kvharbor.kernels import KV_CACHE_DTYPES, build_cpu_kernels

from .block_pool import BlockPool
from .decode_graphs import DecodeGraphs
from .detokenizer import Detokenizer
from .device import flush_denormals, resolve_device, resolve_dtype
from . import host_memory
from .engine_stats import engine_stats
from .host_pool import HostKVPool
from .integrity import check_engine
from .kv_events import KVEvents, drain_tiers
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVTransfer
from .logits_processors import depends_on_outputs
from .structured_output import Grammars, advance, start_reasoning
from .lora import LoRAs
from .model_runner import ModelRunner, ScheduledRequest, kv_bytes_per_token
from .eviction import make_eviction_policy
from .hashing import adapter_salt, model_root, with_request_salt
from .model_identity import model_identity
from .models import load_model, uniform_sliding_window
from .pooling import PoolingParams, PooledOutput, check_pooling
from .preemption import PreemptionPolicy
from .request import (Request, RequestOutput, SamplingParams, Status, bad_word_ids, check_request, repeated,
                      stopped_on_token)
from .scheduler import Scheduler
from .step_budget import NO_PRIORITY, StepInterrupt, StepInterrupted
from .sessions import SessionLimits, SessionManager
from .spec_decode import NgramProposer

logger = logging.getLogger(__name__)


class Engine:
    """One model, one paged KV cache, one scheduler. Not thread-safe; no Ray."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            host_memory.keep_freed_memory()       # before the model's allocations
            build_cpu_kernels()                   # a first start compiles them side by side
        loaded = load_model(config.model, self.dtype, self.device, config.seed)
        self.model_name, self.model, self.tokenizer = loaded.name, loaded.model, loaded.tokenizer
        self.tokenizer.chat_template = config.chat_template or self.tokenizer.chat_template
        self.model_identity = model_identity(config.model, config.seed)   # once, at load
        self.hash_root = model_root(self.model_identity)                  # every chain starts here
        if (config.max_model_len or 0) > loaded.max_model_len:     # as vLLM: not cut silently
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of "
                             f"{loaded.max_model_len} tokens; lower it or leave it unset (the model's)")
        self.max_model_len = config.max_model_len or loaded.max_model_len
        self.block_size = config.block_size
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        self.pool = BlockPool(num_blocks, config.pinned_kv_blocks, make_eviction_policy(config.eviction_policy))
        self.runner = ModelRunner(self.model, num_blocks, self.block_size, self.device, self.dtype,
                                  config.attention_backend, config.kv_cache_dtype, config.model_path)
        self.interrupt = self.runner.interrupt = StepInterrupt(self.runner.num_layers)
        r = self.runner
        if (self.device.type == "cuda" and not config.enforce_eager and r.fast is not None
                and r.backend.name == "triton"):
            r.graphs = DecodeGraphs(r, config.max_num_seqs, self.max_model_len)
        self.host, self.transfer = self._make_host_tier()
        self.sliding_window = uniform_sliding_window(self.model.config)
        self.kv = KVCacheManager(self.pool, self.block_size, self.host, self.transfer,
                                 self.sliding_window, config.enable_prefix_caching)
        policy = PreemptionPolicy(config.preemption_mode, self.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs, policy)
        self.scheduler.fcfs = config.scheduling == "fcfs"
        self.scheduler.low_priority_prefill_cap = config.low_priority_prefill_cap
        self.scheduler.sizer.ceiling = config.pinned_kv_blocks_max
        self.scheduler.sizer.window_s = config.pinned_demand_window_s
        self.set_qos_classes(config.qos_classes)
        self.detok = Detokenizer(self.tokenizer)
        max_blocks = config.session_max_blocks if config.session_max_blocks is not None else num_blocks // 2
        self.sessions = SessionManager(self.pool, self.block_size,
                                       SessionLimits(config.session_ttl_s, max_blocks))
        self.requests: dict[str, Request] = {}
        self.failures: dict[str, Exception] = {}     # see take_failures
        spec = config.speculative_config
        self.spec = NgramProposer.from_config(spec) if spec is not None else None
        # Decode steps run ahead (see ``_runs_ahead``): where the decode graphs run (CUDA), and
        # not with speculative decoding (whose drafts come from the tokens not read yet).
        self.async_scheduling = config.async_scheduling and r.graphs is not None and self.spec is None
        self._inflight = None          # the decode step launched and not yet collected
        self.steps_ahead = 0           # decode steps launched before the previous one's tokens were read
        self._arrivals = itertools.count()
        self._event_seq = 0
        self.pinned_prefixes: list[list] = []
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "aborted": 0}
        self.eos_id = eos = getattr(self.tokenizer, "eos_token_id", None)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = {e for e in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos]))
                        if e is not None}
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_ids)
        self.loras = LoRAs(self.model, config.max_lora_rank)
        for name, path in config.lora_modules.items():
            self.add_lora(name, path)
        # Host memory in huge pages once weights and KV cache are allocated (none: a warning).
        self.host_huge_page_bytes = (host_memory.check_huge_pages() if self.device.type == "cpu"
                                     else host_memory.huge_page_bytes())
        host_memory.freeze_startup_objects()      # full GC passes stop walking the model

    def _make_host_tier(self) -> tuple[HostKVPool | None, KVTransfer | None]:
        """The host KV tier (pinned memory on CUDA) and its copier, or (None, None) when off."""
        n = self.config.host_kv_blocks
        if n == 0:
            if self.config.preemption_mode != "recompute":
                raise ValueError(f"preemption_mode={self.config.preemption_mode!r} swaps KV to host "
                                 f"memory: set host_kv_blocks > 0, or use preemption_mode='recompute'")
            return None, None
        r = self.runner
        host = HostKVPool(n, (r.num_layers, 2, self.block_size, r.num_kv_heads, r.head_dim),
                          r.kv_cache_dtype, pin_memory=self.device.type == "cuda")
        transfer = KVTransfer(host, r.caches)
        self.pool.on_evict = transfer.on_evict
        return host, transfer

    def _default_num_blocks(self) -> int:
        if self.device.type != "cuda":
            return 4096
        cache_dtype = KV_CACHE_DTYPES.get(self.config.kv_cache_dtype) or self.dtype
        per_block = kv_bytes_per_token(self.model.config, cache_dtype) * self.block_size
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(16, int(free * self.config.gpu_memory_utilization) // per_block)

    # ---- requests -----------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA checkpoint at ``path`` as adapter ``name`` (see ``lora.py``).
        Raises ValueError for a checkpoint this engine cannot serve, with the reason."""
        if self.runner.fast is None:
            raise ValueError("LoRA adapters run on kvharbor's model path (Llama, Qwen2, Mistral), "
                             f"not on transformers' forward of {type(self.model).__name__}")
        self.loras.add(name, path)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    tenant: str = "default", qos: str = "standard", cache_salt: str | None = None,
                    session_id: str | None = None, lora: str | None = None,
                    request_salt: str | None = None, pooling: PoolingParams | None = None) -> Request:
        """Queue a request. Raises ValueError for arguments a caller must fix.

        ``session_id``: a turn of that session of ``tenant``: its prompt + output blocks stay
        referenced for the next turn (``sessions.py``). ``lora``: a loaded LoRA adapter (None:
        the base model), cached in a scope of its own. ``cache_salt``: the tenant's cache scope
        (None: public; what a scope flush matches); ``request_salt``: vLLM's ``cache_salt``.
        ``pooling``: an embedding request (``pooling.py``), answered by a ``PooledOutput``.
        """
        prompt_token_ids = check_request(prompt_token_ids, sampling, tenant, qos, cache_salt, session_id,
                                         self.config.qos_classes, self.model.config.vocab_size,
                                         self.max_model_len, request_salt, self.config.reasoning_parser)
        if pooling is not None:
            check_pooling(pooling, sampling, session_id, self.model.config)
        adapter = None if lora is None else self.loras.get(lora)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        spec = self.config.qos_classes[qos]
        priority = spec.priority if self.config.scheduling == "priority" else 0
        salt = adapter_salt(with_request_salt(cache_salt, request_salt), lora, adapter and adapter.path)
        req = Request(request_id, prompt_token_ids, sampling, tenant=tenant, qos=qos,
                      priority=priority, pinned=spec.pinned, cache_salt=salt, scope=cache_salt,
                      hash_root=self.hash_root, session_id=session_id,
                      arrival=time.monotonic(), arrival_seq=next(self._arrivals), lora=adapter,
                      pooling=pooling)
        if sampling.prompt_logprobs is not None:
            req.prompt_lps = [None]             # the first prompt token has no logprob
        if sampling.structured_outputs is not None:
            req.matcher = self.grammars.matcher(sampling.structured_outputs)
        if self.config.reasoning_parser is not None:
            start_reasoning(req, self.tokenizer)        # counts its thought; a grammar waits
        if sampling.bad_words:
            req.bad_words = bad_word_ids(self.tokenizer, sampling.bad_words, sampling.allowed_token_ids)
        if sampling.allowed_token_ids is not None:
            req.allowed_ids = frozenset(sampling.allowed_token_ids)
        if sampling.min_tokens:
            req.held_stops = tuple(sorted(set(sampling.stop_token_ids)
                                          | (set() if sampling.ignore_eos else self.eos_ids)))
        problem = self._never_fits(req)
        if problem:
            raise ValueError(problem)
        self.requests[request_id] = req
        self.scheduler.add(req)
        if session_id is not None:
            self.sessions.begin(req)
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        return req

    def _capacity(self, req: Request) -> int:
        """Blocks a request of ``req``'s class could ever hold (O(1): pool counters)."""
        return self.pool.capacity(req.pinned, self.scheduler.sizer.ceiling)

    def _never_fits(self, req: Request) -> str | None:
        """Why ``req`` can never run (its whole length exceeds its class's capacity), or None.

        Capacity excludes blocks pinned prefixes hold forever (a hit on them costs nothing)
        and, for classes without the pinned region, the region at its largest.
        """
        capacity = self._capacity(req)
        if self.kv.fits_ever(req, capacity):
            return None
        return (f"request needs {self.kv.max_blocks_needed(req)} KV blocks but only {capacity} exist "
                f"for QoS class {req.qos!r} (prompt {len(req.prompt_token_ids)} + max_tokens "
                f"{req.sampling.max_tokens} tokens; blocks held forever by pinned prefixes"
                f"{'' if req.pinned else ' and the pinned region'} do not count); raise num_kv_blocks "
                "or lower max_tokens")

    def reject_unfittable(self) -> dict[str, str]:
        """Abort waiting requests that can never fit (capacity shrank after they were added:
        the pinned region grew or prefixes were pinned). Returns ``{request id: reason}``. The
        scheduler skips such requests without blocking others; drivers call this when a step
        made no progress (nothing ran) so callers get an error instead of a wait."""
        failed = {}
        for req in list(self.scheduler.waiting):
            problem = self._never_fits(req)
            if problem:
                self.abort(req.request_id)
                req.finish_reason = "error"
                failed[req.request_id] = problem
        return failed

    def set_qos_classes(self, classes: dict) -> None:
        """Apply QoS classes (at start and on a tenants.yaml reload): preemptibility and the
        step-time targets of the latency budget, by priority."""
        self.config = self.config.model_copy(update={"qos_classes": dict(classes)})
        sched = self.scheduler
        sched.preemptible = {k: q.preemptible for k, q in classes.items()}
        sched.step_target_s = {}
        for q in classes.values():
            target = q.step_target_s()
            if target is not None:
                sched.step_target_s[q.priority] = min(target, sched.step_target_s.get(q.priority, target))
        # Only the top latency-budgeted class cuts steps short (premium in tenants.yaml): a
        # lower one (standard, 1 s SLO) would throw away work for a wait it can afford.
        self.interrupt.interruptible = frozenset([max(sched.step_target_s)] if sched.step_target_s else [])

    def announce(self, qos: str) -> None:
        """A request of class ``qos`` was queued for this engine by another thread (which adds
        it at the next step boundary): a latency-budgeted class may cut the step in flight
        short (see ``StepInterrupt``). Thread-safe; unknown classes are ignored (``add_request``
        rejects them)."""
        spec = self.config.qos_classes.get(qos)
        if spec is not None and self.config.scheduling == "priority":
            self.interrupt.announce(spec.priority)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks. Returns False if it is unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.session_id is not None:
            self.sessions.end_turn(req)
        self.scheduler.remove(req)
        self.detok.forget(request_id)
        req.status, req.finish_reason = Status.FINISHED, "abort"
        self.counters["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; return outputs of requests that advanced
        (none when an announced higher-class arrival cut the step short: see ``announce``).

        With decode steps run ahead (``async_scheduling``), a step may return the outputs of
        the decode step launched by the call before it instead of its own."""
        self.sessions.expire()
        outputs = []
        if self._inflight is not None:
            nxt = self._continuation()
            if nxt is not None:      # launch the next decode step, then collect this one
                launched = self.runner.launch(nxt, ahead=1, prev=self._inflight)
                self.steps_ahead += 1
                outputs = self._collect(self._inflight)
                self._inflight = launched
                return outputs
            outputs = self._collect(self._inflight)
            self._inflight = None
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.max_model_len, self.scheduler.cost)
        plan = self.scheduler.schedule()
        self._flush_transfers()
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                self.sessions.release_oldest_idle()     # retention must never starve the engine
            return outputs
        if self._runs_ahead(plan.scheduled):
            self.scheduler.untimed()
            self._inflight = self.runner.launch(plan.scheduled)
            return outputs
        self.interrupt.arm(plan.scheduled)
        try:
            with flush_denormals(self.device.type == "cpu"):
                tokens = self.runner.execute(plan.scheduled)
        except StepInterrupted:
            self.scheduler.abandon(plan)        # the next step takes the announced arrival
            return outputs
        finally:
            self.interrupt.disarm()
        sampled, logprobs = iter(tokens), iter(self.runner.last_logprobs)
        for item in plan.scheduled:         # a sampling request has 1 + its drafts rows
            n = item.num_drafts + 1 if item.samples else 0
            rows, lps = [next(sampled) for _ in range(n)], [next(logprobs) for _ in range(n)]
            try:
                out = self._account(item, rows, lps)
            except Exception as e:  # noqa: BLE001 - fails this request alone (take_failures)
                self._fail(item.request, e)
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    def _account(self, item: ScheduledRequest, rows: list[int], lps: list) -> RequestOutput | None:
        """Advance ``item``'s request and append its sampled ``rows``; its output, if any."""
        req, drafts = item.request, item.num_drafts
        if drafts:
            kept = self.spec.accept(req, req.spec_token_ids[:drafts], rows)
            if kept < drafts and req.rng_states:           # seeded: undraw the discarded rows
                req.generator.set_state(req.rng_states[kept])
            self._advance(req, item.num_new_tokens - (drafts - kept))
            return self._append_tokens(req, rows[:kept + 1], lps[:kept + 1])
        self._advance(req, item.num_new_tokens)
        if rows and req.pooling is not None:        # its prompt's last hidden state is the answer
            self._finish(req, "stop")
            return PooledOutput(req.request_id, req.prompt_token_ids, max(req.num_cached_tokens, 0),
                                req.pooling.embed(self.runner.pooled.pop(req)))
        return self._append_token(req, rows[0], lps[0]) if rows else None

    def _fail(self, req: Request, error: Exception) -> None:
        """Abort ``req`` alone: accounting for its step raised (detokenizing, stops, grammar)."""
        logger.error("%s failed in an engine step: %r", req.request_id, error, exc_info=error)
        self.abort(req.request_id)                  # False when it had finished already
        req.finish_reason = "error"
        self.failures[req.request_id] = error

    def take_failures(self) -> dict[str, Exception]:
        """``{request id: error}`` of the requests steps failed alone (``_fail``) since the last call."""
        failures, self.failures = self.failures, {}
        return failures

    def _advance(self, req: Request, num_new: int) -> None:
        """``num_new`` more tokens of ``req`` are computed: cache its filled blocks, release
        those the sliding window left behind."""
        req.num_computed_tokens += num_new
        self.kv.cache_full_blocks(req)
        self.kv.free_outside_window(req)

    # ---- decode steps run ahead ------------------------------------------------------------
    # On a GPU the host's part of a step (scheduling, staging, detokenizing, finish checks)
    # otherwise runs while the GPU idles. With ``async_scheduling``, a decode step whose
    # requests all continue is launched before the tokens of the one in flight are read: its
    # input ids are gathered on the device from the tokens the step in flight sampled, and the
    # host collects those (appends, detokenizes, checks for stops) while the GPU computes.
    # A request that stops at the collected token had one more token computed for it, which
    # is dropped: its K/V went to its own next slot, never to a cached (full) block. Any other
    # situation (a waiting or announced request, logprobs, penalties or a min_tokens not yet
    # reached, a decode that a higher class's step budget would trim, a block that cannot be
    # allocated) collects the step in flight and schedules normally.

    def _runs_ahead(self, batch: list[ScheduledRequest]) -> bool:
        """Launch ``batch`` (just scheduled) without waiting for its tokens?"""
        graphs = self.runner.graphs
        return (self.async_scheduling and graphs is not None and graphs.eligible(batch)
                and self._continuable([item.request for item in batch]))

    def _continuable(self, reqs: list[Request]) -> bool:
        """No request waits or was announced, every running request is in ``reqs``, none asks
        for logprobs or has logits that depend on its output so far (penalties, ``min_tokens``
        not yet reached), and the step budget of a higher class would trim none of them."""
        sched = self.scheduler
        if sched.waiting or self.interrupt.announced != NO_PRIORITY:
            return False
        if len(reqs) != len(sched.running) or any(r.sampling.logprobs is not None for r in reqs):
            return False
        if any(depends_on_outputs(r) for r in reqs):     # its logits would miss the token in flight
            return False
        return not sched.trims_decodes(reqs)

    def _continuation(self) -> list[ScheduledRequest] | None:
        """The decode step after the one in flight, of the same requests less those that
        stop at its token for certain (length); None when it cannot be run ahead."""
        reqs = [item.request for item in self._inflight.batch
                if self.requests.get(item.request.request_id) is item.request]
        if not reqs or not self._continuable(reqs):
            return None
        self.scheduler.size_pinned_region(self.scheduler.clock())   # as every schedule does
        nxt, kv = [], self.kv
        for r in reqs:
            n = r.num_tokens + 1                        # tokens after the one in flight
            if n - len(r.prompt_token_ids) >= r.sampling.max_tokens or n >= self.max_model_len:
                continue
            if kv.blocks_needed(r, 2):                  # a slot for position computed + 1
                if not kv.can_allocate(r, 2):
                    return None
                kv.allocate(r, 2)
            nxt.append(ScheduledRequest(r, 1))
        if not nxt:
            return None
        for item in nxt:
            self.scheduler.fair.charge(item.request, 1)
        return nxt

    def _collect(self, launched) -> list[RequestOutput]:
        """Wait for ``launched``'s tokens and account for them as ``step`` does for its own."""
        outputs = []
        for item, token in zip(launched.batch, launched.tokens_on_host()):
            req = item.request
            if self.requests.get(req.request_id) is not req:
                continue                          # finished or aborted meanwhile: dropped
            try:
                self._advance(req, 1)
                outputs.append(self._append_token(req, token, None))
            except Exception as e:  # noqa: BLE001 - as in step
                self._fail(req, e)
        return outputs

    def _flush_transfers(self) -> None:
        """Run the host <-> device copies planned since the last flush (before any forward)."""
        if self.transfer is not None and self.transfer.pending:
            self.transfer.flush()

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list) -> RequestOutput:
        """Append ``tokens`` (a speculative step's) one by one, as separate steps would, up to
        the one that finishes ``req``; one output with all of them as its delta."""
        new_ids, new_text, new_lps = [], "", None
        for token, lp in zip(tokens, logprobs):
            out = self._append_token(req, token, lp)
            new_ids += out.new_token_ids
            new_text += out.new_text
            if out.new_logprobs is not None:
                new_lps = (new_lps or []) + out.new_logprobs
            if out.finished:
                break
        out.new_token_ids, out.new_text, out.new_logprobs = new_ids, new_text, new_lps
        return out

    def _append_token(self, req: Request, token: int, logprobs=None) -> RequestOutput:
        """Append ``token`` to ``req``; its output for this step. Its cost does not grow with
        the output, but for one copy of the text: the text is decoded incrementally, stop
        strings are looked for only where the text changed, and the output's ``token_ids``
        are sliced only when read."""
        req.all_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.counters["generated_tokens"] += 1
        text_before = len(req.output_text)
        changed = self.detok.update(req)
        reason = self._finish_reason(req, token, text_before, changed)
        new_text = self.detok.delta(req, final=reason is not None)
        if reason is not None:
            self._finish(req, reason)
        return RequestOutput(req.request_id, req.prompt_token_ids, req.output_ids, req.output_text,
                             req.finish_reason, max(req.num_cached_tokens, 0), [token], new_text,
                             None if logprobs is None else [logprobs], req.prompt_lps,
                             num_reasoning_tokens=req.reasoning_tokens, stop_reason=req.stop_reason)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason, req.status = reason, Status.FINISHED
        if req.session_id is not None:
            self.sessions.end_turn(req)        # before its blocks are freed
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.counters["finished"] += 1

    def _finish_reason(self, req: Request, token: int, text_before: int, changed: int) -> str | None:
        """Why ``req`` ends with ``token`` (None: it goes on), and in ``req.stop_reason`` the
        stop token id or string that ended it (vLLM's). A stop token's text is left out of the
        output (as vLLM; the token stays in the ids); a stop string and what follows it too.
        Only stop strings ending in the text from ``changed`` on (what this token changed)
        count, as in vLLM: one completed before ``min_tokens`` was streamed and stays."""
        sp = req.sampling
        n_out = req.num_output_tokens
        if req.allowed_ids is not None and token not in req.allowed_ids:
            req.output_text = req.output_text[:text_before]     # bad_words or min_tokens banned
            return "stop"                                       # every allowed id this step
        if req.matcher is not None or req.reasoning:
            if ended := advance(req, token, changed):       # the grammar: complete, or broken
                return ended
        if n_out >= sp.min_tokens:
            if (not sp.ignore_eos and token in self.eos_ids) or token in sp.stop_token_ids:
                return stopped_on_token(req, token, text_before, self.eos_id)
            if sp.stop and (stop := self.detok.truncate_at_stop(req, sp.stop, changed)) is not None:
                req.stop_reason = stop
                return "stop"
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return "repetition" if repeated(req) else None

    # ---- sessions ---------------------------------------------------------------------------
    def set_session_limits(self, tenant: str, ttl_s: float | None = None,
                           max_blocks: int | None = None) -> None:
        """Retention rules of ``tenant``'s sessions (None: the engine default for that field)."""
        default = self.sessions.default
        self.sessions.limits[tenant] = SessionLimits(default.ttl_s if ttl_s is None else ttl_s,
                                                     default.max_blocks if max_blocks is None else max_blocks)

    def end_session(self, tenant: str, session_id: str) -> int | None:
        """End a session now: its blocks return to the LRU. Block references released, or
        None when this engine holds no such session."""
        return self.sessions.end(tenant, session_id)

    def fork_session(self, tenant: str, source: str, target: str) -> int | None:
        """Start session ``target`` of ``tenant`` from ``source``'s cached state (its blocks,
        shared, no recompute). Blocks held, or None when ``source`` is not held here.
        Raises ValueError when ``target`` already exists."""
        return self.sessions.fork(tenant, source, target)

    def flush_cache(self, salts=None, tenants=None) -> dict[str, int]:
        """Drop cached KV so the next identical request is computed again: every session
        ends, every free cached device block and every unlocked host-tier entry loses its hash
        (each a "removed" KV event, so the prefix directory forgets them). Blocks of running
        requests and pinned prefixes stay. Returns counts by kind.

        ``salts`` (a collection of cache salts; None in it is the public scope): drop only
        blocks cached under those scopes, and end only the sessions of ``tenants``.
        """
        if salts is None:
            sessions, match = self.sessions.end_all(), None
        else:
            sessions, match = self.sessions.end_all(set(tenants or ())), self.kv.in_scopes(set(salts))
        device = self.pool.evict_all_cached(match)
        host = self.host.drop_all_cached(match) if self.host is not None else 0
        return {"sessions": sessions, "device_blocks": device, "host_blocks": host}

    def expire_sessions(self) -> int:
        """Release idle sessions past their ttl now (``step`` does it too). Returns how many."""
        return self.sessions.expire(force=True)

    # ---- pinned prefixes, events, stats --------------------------------------------------
    def pin_prefix(self, token_ids: list[int], qos: str, cache_salt: str | None = None) -> int:
        """Prefill ``token_ids`` now and keep its full blocks cached forever (a pinned prompt).

        Blocks come from the pinned region when ``qos`` is a pinned class. Returns the number
        of blocks pinned. Raises RuntimeError when the cache cannot hold the prefix.
        """
        spec = self.config.qos_classes[qos]
        req = Request(f"pin-{next(self._arrivals)}", list(token_ids), SamplingParams(max_tokens=1),
                      qos=qos, pinned=spec.pinned, cache_salt=cache_salt, scope=cache_salt,
                      hash_root=self.hash_root)
        hit = self.kv.get_computed_blocks(req)
        if not self.kv.can_allocate(req, req.num_tokens - hit.num_tokens, hit):
            raise RuntimeError(f"no room to pin a {req.num_tokens}-token prefix; raise pinned_kv_blocks")
        self.kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
        self._flush_transfers()
        while req.num_computed_tokens < req.num_tokens:
            n = min(self.config.max_num_batched_tokens, req.num_tokens - req.num_computed_tokens)
            self.runner.forward_logits([ScheduledRequest(req, n)])
            req.num_computed_tokens += n
        kept = self.kv.pin_prefix(req)
        self.kv.free(req)
        self.pinned_prefixes.append(kept)
        return len(kept)

    def resize_pinned_region(self) -> tuple[int, int]:
        """Move the pinned region toward its target now (see ``PinnedSizer``): (size, target)."""
        return self.scheduler.size_pinned_region(self.scheduler.clock())

    def unpin_prefix(self, blocks: list) -> None:
        """Release a prefix pinned by :meth:`pin_prefix` (its blocks become evictable)."""
        self.pinned_prefixes.remove(blocks)
        self.pool.unpin(blocks)

    def drain_kv_events(self) -> list[KVEvents]:
        """Event batches since the last call (``kv_events.drain_tiers``); batches of all tiers
        share one numbering 0, 1, 2, ...; ``last_event_seq`` is the latest number handed out."""
        batches = drain_tiers(self.pool, self.host, self._event_seq)
        self._event_seq += len(batches)
        return batches

    @property
    def last_event_seq(self) -> int:
        return self._event_seq - 1

    def cached_block_hashes(self) -> set:
        return set(self.pool.cached)

    def host_block_hashes(self) -> set:
        """Hashes whose K/V the host tier holds (empty when it is off)."""
        return set(self.host.cached) if self.host is not None else set()

    def stats(self) -> dict:
        """Block, token, tier and memory counters (see :func:`engine_stats`)."""
        return engine_stats(self)

    def check_integrity(self) -> None:
        """Assert the pool's invariants, and that each block's ref count equals its holders
        (running requests' tables, sessions, pinned prefixes), running <= max_num_seqs, and that
        every unfinished request is queued exactly once (``integrity.py``)."""
        check_engine(self)
