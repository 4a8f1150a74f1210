"""Gateway: the OpenAI-compatible HTTP ingress. Everything that depends on the tenant.

Per request: API key -> tenant (401, before any byte of the body is read; ``auth_gate``) ->
body size (413, before parsing) -> JSON schema (400: unknown fields and OpenAI fields kvharbor
does not implement are refused by name, ``openai_protocol``) -> model check (404/403) ->
``service_tier`` "flex": the lowest QoS class -> tenant refused earlier for a limit not yet
cleared, overload guard, class queue (429; before tokenizing, ``admission_flow``; the guard is
also asked with the key check) -> tokenize and length checks (400) -> tenant limits: rates,
budgets, concurrency (429) -> block hashes salted by the tenant's cache scope ->
``LLMReplica.generate`` through the KV-aware router -> JSON or SSE back.

Every error, including malformed JSON, invalid UTF-8, unknown routes and internal failures,
is an OpenAI-shaped JSON body (``openai_protocol.ErrorResponse``), never a stack trace
(``api_errors``); the OpenAPI schema (``/openapi.json``) declares each route's error statuses
with that body.

Class queue (load shedding, ``platform.class_queue``): a request of class C is refused
(429, ``queue_full``, Retry-After) when ``max_queue`` requests of C or higher-priority classes
are in flight across all gateway replicas, so lower classes shed first under overload.
Queue places and admission tickets are leased and renewed by this replica, so a replica that
dies gives them back within the lease time; every control-plane call has a timeout (503).
"""

import asyncio
import importlib.metadata
import logging
import time
import uuid
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayActorError

from kvharbor.actors.calls import detached, on_event_loop, start_background
from kvharbor.engine.hashing import hash_prompt_blocks, model_root
from kvharbor.engine.model_identity import model_identity
from kvharbor.engine.model_info import load_tokenizer, model_config, model_context_length
from kvharbor.engine.request import sibling_seed
from kvharbor.observability.metrics import get_metrics
from kvharbor.platform.admission_flow import Admitter, unavailable
from kvharbor.platform.api_errors import install_error_handlers
from kvharbor.platform.auth_gate import GENERATION_PATHS, SHED_PATHS, AuthGateMiddleware, bearer_key, encode_hint
from kvharbor.platform.batches_api import router as batches_router
from kvharbor.platform.body_limit import BodyLimitMiddleware, content_length
from kvharbor.platform.class_queue import get_or_create_class_queue
from kvharbor.platform.context_overflow import TRUNCATED_HEADER
from kvharbor.platform.direct_stream import start_request_router
from kvharbor.platform.embeddings import EmbeddingRequest, EmbeddingResponse, bound_dimensions, serve_embeddings
from kvharbor.platform.error_body import APIError, error_responses
from kvharbor.platform.generation import GenerationRun, sse
from kvharbor.platform.health import RunningReplicas
from kvharbor.platform.ingress import running_mode, running_preset
from kvharbor.platform.loopback import serve_grpc_on_node_address
from kvharbor.platform.openai_protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                               TokenizeRequest, TokenizeResponse, bound_token_ids)
from kvharbor.platform.openai_responses import ChatResponse, CompletionResponse, ModelCard, ModelList
from kvharbor.platform.overload_guard import DEFAULT_LAG_TARGET_MS, OverloadGuard
from kvharbor.platform.premium_lane import check_lane, listening_socket, lower_process_priority, start_server
from kvharbor.platform.protocol import GenerateRequest
from kvharbor.platform.prompts import Prompts
from kvharbor.platform.response_store import StoredResponses
from kvharbor.platform.responses_background import router as background_router, start as start_background_response
from kvharbor.platform.responses_api import ResponsesRequest, Turn, responses_error
from kvharbor.platform.run_stream import RunStream
from kvharbor.platform.structured_request import parse_problem
from kvharbor.platform.served_models import ServedModels
from kvharbor.platform.scoring import RerankRequest, ScoreRequest, serve_rerank, serve_score
from kvharbor.platform.service_tier import tiered
from kvharbor.platform.sessions_api import (SESSION_HEADER, FlushRequest, ForkRequest, check_session_id, end_session_everywhere,
                                            flush_everywhere, flush_filter, fork_session_everywhere, session_header)
from kvharbor.platform.tool_calls import AUTO_NEEDS_PARSER
from kvharbor.tenants import ActorAdmission, TenantError, TenantRegistry, get_or_create_admission_actor
from kvharbor.tenants.admission_actor import CALL_TIMEOUT_S

logger = logging.getLogger("kvharbor.gateway")
VERSION = importlib.metadata.version("kvharbor")

api = FastAPI(title="kvharbor", version=VERSION,
              description="OpenAI-compatible, tenant-aware LLM serving on Ray Serve.")
api.add_middleware(BodyLimitMiddleware)
api.add_middleware(AuthGateMiddleware)     # added last: runs first, before the body limit
api.include_router(batches_router)         # /v1/files, /v1/batches (plain routes: no gateway state)
api.include_router(background_router)      # POST /v1/responses/{id}/cancel

SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "description": "with `stream: true`: one event per chunk",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or `[DONE]` last"}}}}}
GENERATE_ERRORS = error_responses(400, 401, 403, 404, 413, 429, 500, 503)
install_error_handlers(api)


def _bearer(request: Request) -> str | None:
    return bearer_key(request.headers)


def marks_of(request: Request, arrived: float) -> dict[str, float]:
    """The request's ``perf_counter()`` instants so far: ``received`` (the gateway's middleware
    saw it) and ``proxied`` (Serve's proxy received it), where ``AuthGateMiddleware`` left
    them, and ``arrived`` (the route handler's first line)."""
    return {**(request.scope.get("state") or {}).get("ingress", {}), "arrived": arrived}


ADMIN = "admin"
"""The principal ``AuthGateMiddleware`` leaves for an admin key on an /admin route."""


def _logprobs(body, chat: bool) -> int | None:
    """Alternatives per token the engine reports (None: no logprobs at all)."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _prompt_logprobs(body, logprobs: int | None, echo, chat: bool) -> int | None:
    """Alternatives per prompt token the answer's ``prompt_logprobs`` shows (None: no field):
    the request's, else completions' echo with logprobs, or chat's echo with ``top_logprobs``
    (as vLLM answers); never on a stream."""
    if body.stream:
        return None
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    return (body.top_logprobs if body.echo else None) if chat else logprobs if echo else None


def _own_actor_name() -> tuple[str, str] | None:
    """(namespace, name) of this Serve replica's actor (replicas are named actors in Serve's
    namespace, not the job's); None outside Serve (unit tests)."""
    try:
        import ray  # noqa: PLC0415

        serve.get_replica_context()
        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - not in a Serve replica
        return None
    return (_serve_namespace(), name) if name else None


def _serve_namespace() -> str:
    try:
        from ray.serve._private.constants import SERVE_NAMESPACE  # noqa: PLC0415
    except ImportError:                   # moved in another Ray version: its long-standing value
        return "serve"
    return SERVE_NAMESPACE


# Defined above the class: serve.ingress copies the methods with the globals of this moment.
@serve.ingress(api)
class Gateway:
    """Serve ingress deployment (options are set in ``kvharbor.platform.app``); ``PremiumGateway``
    serves the same routes on the premium lane's port."""

    is_lane = False

    @property
    def ingress(self) -> str:
        """The metrics' ``ingress`` label of the requests served here."""
        return "premium_lane" if self.is_lane else "main"

    def __init__(self, llm, config: dict, lane=None) -> None:
        serve_grpc_on_node_address()           # Serve's own gRPC server, on loopback too
        self.llm = llm
        self.config = config
        if config.get("direct_streams"):
            start_request_router(llm)
        self.lane = lane        # the PremiumGateway's handle: bound so Serve deploys the lane; never called
        if config.get("premium_port") is not None and not self.is_lane:     # the lane goes first
            lower_process_priority(config.get("main_gateway_nice", 0))
        self.model = config["model"]
        self.registry = TenantRegistry(config["tenants"])
        self.tokenizer = load_tokenizer(self.model)
        self.tokenizer.chat_template = config.get("chat_template") or self.tokenizer.chat_template
        bound_token_ids(api.openapi(), len(self.tokenizer))     # /openapi.json: ids < vocabulary,
        bound_dimensions(api.openapi(), model_config(self.model))   # the dimensions this model takes
        self.context = min(config.get("max_model_len") or 10**9, model_context_length(self.model))
        self.served = ServedModels(self.model, config.get("lora_modules"), self.registry, self.context,
                                   config.get("served_model_name"))
        self.prompts = Prompts(self.tokenizer, self.context, config.get("sampling_defaults"))
        self.tool_parser = config.get("tool_call_parser")      # tool_choice "auto" (None: refused)
        self.reasoning_parser = config.get("reasoning_parser")
        self.block_size = config["block_size"]
        # The replicas' chain root, computed the same way from the model's files (no weights
        # loaded), so the routing hashes here equal the hashes replicas report.
        self.hash_root = model_root(model_identity(self.model, config.get("seed", 0)))
        self.max_body_bytes = config["max_body_bytes"]
        # serve.ingress gave this class's methods a copy of ``api`` (the app Serve serves): the
        # premium lane serves that copy too (``served_api``), state and routes included.
        self.served_api = api
        api.state.max_body_bytes = self.max_body_bytes          # read by BodyLimitMiddleware
        api.state.authenticate = self._gate                     # read by AuthGateMiddleware
        api.state.guard_hint = self._guard_hint                 # for Serve's proxy guard too
        self.admission = ActorAdmission(get_or_create_admission_actor())   # detaches its calls
        self.metrics = get_metrics()
        # Control-plane calls are no request's children: a client leaving must not cancel a leave.
        self.class_queue = detached(get_or_create_class_queue())
        self.guard = OverloadGuard(config.get("overload_lag_ms", DEFAULT_LAG_TARGET_MS), metrics=self.metrics)
        self.admitter = Admitter(self.admission, self.class_queue, self.registry, self.metrics, guard=self.guard)
        self._watcher: asyncio.Task | None = None
        self.llm_replicas = RunningReplicas(llm)              # for /healthz
        self.stored = StoredResponses()                       # the Responses API's store
        if on_event_loop():                   # Serve runs constructors on the replica's loop
            self._start_watcher()
        self.caller = _own_actor_name()       # replicas abort our streams if this actor dies
        demo = self.registry.active_demo_keys()
        if demo:
            logger.warning("demo API keys are active for %s; revoke them in %s before exposing "
                           "this server", ", ".join(demo), config["tenants"])

    # ---- plumbing ------------------------------------------------------------------------
    def _start_watcher(self) -> None:
        """Keep tenants.yaml current from now on (once; at construction under Serve).

        The first call also reloads now: an edit made since the registry was loaded (a key
        revoked, a limit raised) applies to the request that called, not a watch period later.
        """
        if self._watcher is None:
            self.registry.reload_if_changed()
            self._watcher = start_background(self.registry.watch(1.0))

    def _check_lane(self, principal) -> None:
        """Nothing here: the premium lane (``PremiumGateway``) refuses classes not pinned, in
        ``_gate``, before a generation request's body is read."""

    def _gate(self, key: str | None, path: str):
        """The key check ``AuthGateMiddleware`` runs before the body is read (raises 401)."""
        self._start_watcher()
        if path.startswith("/admin/") and self.registry.is_admin(key):
            return ADMIN
        principal = self.registry.authenticate(key)
        if path in SHED_PATHS:               # 403 off the lane, 429 overloaded: before the body
            self._check_lane(principal)
            self.guard.check(principal.qos, self.registry.config.qos_classes, principal.tenant)
        return principal

    def _guard_hint(self, key: str | None, path: str) -> bytes | None:
        """The class hint for Serve's proxy guard (``kvharbor.platform.proxy_guard``): the
        share of the overload limit of ``key``'s class, and its tenant; None off generation
        paths or for a key that is not a tenant's."""
        if path not in GENERATION_PATHS:
            return None
        try:
            principal = self.registry.authenticate(key)
        except TenantError:
            return None
        return encode_hint(self.guard.share(principal.qos, self.registry.config.qos_classes),
                           principal.tenant)

    def _authenticate(self, request: Request):
        """The principal the middleware found (or, outside it, the key checked now)."""
        principal = getattr(request.state, "principal", None)
        if principal is None or principal == ADMIN:
            self._start_watcher()
            return self.registry.authenticate(_bearer(request))
        return principal

    def _check_model(self, principal, model: str) -> None:
        self.served.check(model)
        self.registry.check_model(principal, model)

    # ---- routes --------------------------------------------------------------------------
    @api.get("/health", responses={503: {"description": "no LLM replica is running"}})
    @api.get("/healthz", responses={503: {"description": "no LLM replica is running (the same "
                                                         "health object, status unavailable)"}})
    async def healthz(self) -> JSONResponse:
        """200 ``ok`` while at least one LLM replica runs; 503 ``unavailable`` while none does
        (the app still starting, or every replica gone): with direct ingress the gateway serves
        HTTP before the replicas finish loading, and a request sent then waits for one.
        ``/health`` is the same answer at vLLM's path (probes written for vLLM)."""
        self._start_watcher()                # tenants.yaml reloads even before the first call
        replicas = await self.llm_replicas.count()
        body = {"status": "ok" if replicas != 0 else "unavailable", "llm_replicas": replicas,
                "model": self.model, "tenants_version": self.registry.version,
                "tenants_sha256": self.registry.sha256,
                "ingress": running_mode(), "throughput_preset": running_preset(),
                "premium_port": self.config.get("premium_port"), "premium_lane": self.is_lane}
        if replicas == 0:
            body["detail"] = ("no LLM replica is running yet (the app is starting, or its "
                              "replicas failed): requests wait until one is")
        return JSONResponse(body, status_code=503 if replicas == 0 else 200)

    @api.get("/version")
    async def version(self) -> dict:
        """kvharbor's version, as vLLM's ``/version`` answers its own (no key needed)."""
        return {"version": VERSION}

    @api.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models(self, request: Request) -> dict:
        self._authenticate(request)
        return {"object": "list", "data": [self.served.card(m) for m in self.served.names()]}

    @api.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404))
    async def model(self, model_id: str, request: Request) -> dict:
        self._authenticate(request)
        self.served.check(model_id)
        return self.served.card(model_id)

    @api.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": SSE}, **GENERATE_ERRORS})
    async def completions(self, body: CompletionRequest, request: Request):
        arrived = time.perf_counter()
        principal = self._authenticate(request)
        session_id = session_header(request.headers)
        self._check_model(principal, body.model)
        if session_id and body.batched:
            raise APIError(400, f"a session ({SESSION_HEADER}) continues one conversation: send one "
                           "prompt, not a list of prompts", param="prompt")
        return await self._serve(principal, body, lambda: self.prompts.completion_ids(body), False,
                                 marks_of(request, arrived), session_id=session_id,
                                 size=content_length(request.scope))

    @api.post("/v1/chat/completions", response_model=ChatResponse,
              responses={200: {"content": SSE}, **GENERATE_ERRORS})
    async def chat_completions(self, body: ChatRequest, request: Request):
        arrived = time.perf_counter()
        principal = self._authenticate(request)
        self._check_model(principal, body.model)
        return await self._chat(principal, body, request, arrived)

    @api.post("/v1/responses", responses={200: {"content": {"text/event-stream": {}}}, **GENERATE_ERRORS})
    async def create_response(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, served on the chat path (``responses_api``); with ``store``
        (the default) the response is kept for ``previous_response_id`` and GET."""
        arrived = time.perf_counter()
        principal = self._authenticate(request)
        model = body.model or self.served.names()[0]
        self._check_model(principal, model)
        history = []
        if body.previous_response_id is not None:
            _, history = await self.stored.get(principal.tenant, body.previous_response_id, "previous_response_id")
        turn = Turn(body, model, history, self.block_size)
        if body.background:                   # answered now, run here (responses_background)
            return await start_background_response(self, principal, turn, request, arrived)
        if body.store:
            turn.on_done = lambda turn, response: self.stored.put(principal.tenant, response, turn.history(), turn.inputs)
        try:
            return await self._chat(principal, turn.chat, request, arrived, turn)
        except (APIError, TenantError) as e:
            raise responses_error(e) from None

    @api.post("/v1/embeddings", response_model=EmbeddingResponse, responses=GENERATE_ERRORS)
    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict:
        """OpenAI's embeddings: each input pooled by the engine (``embeddings``)."""
        return await self._pooled(serve_embeddings, body, request, time.perf_counter())

    @api.post("/rerank", responses=GENERATE_ERRORS)
    @api.post("/v1/rerank", responses=GENERATE_ERRORS)
    @api.post("/v2/rerank", responses=GENERATE_ERRORS)
    async def rerank(self, body: RerankRequest, request: Request) -> dict:
        return await self._pooled(serve_rerank, body, request, time.perf_counter())

    @api.post("/score", responses=GENERATE_ERRORS)
    @api.post("/v1/score", responses=GENERATE_ERRORS)
    async def score(self, body: ScoreRequest, request: Request) -> dict:
        return await self._pooled(serve_score, body, request, time.perf_counter())

    async def _pooled(self, serve_route, body, request: Request, arrived: float) -> dict:
        """An embedding route (``embeddings``, ``scoring``) for the request's key and model."""
        principal = tiered(self._authenticate(request), body.service_tier, self.registry.config.qos_classes, self.is_lane)
        self._check_model(principal, body.model)
        return await serve_route(self, principal, body, marks_of(request, arrived), content_length(request.scope))

    @api.get("/v1/responses/{response_id}", responses=error_responses(401, 404, 503))
    async def get_response(self, response_id: str, request: Request) -> dict:
        """A response this tenant stored."""
        return (await self.stored.get(self._authenticate(request).tenant, response_id, "response_id"))[0]

    @api.delete("/v1/responses/{response_id}", responses=error_responses(401, 404, 503))
    async def delete_response(self, response_id: str, request: Request) -> dict:
        return await self.stored.delete(self._authenticate(request).tenant, response_id)

    async def _chat(self, principal, body: ChatRequest, request: Request, arrived: float, turn: Turn | None = None):
        truncated: dict = {}

        def tokenize() -> list[list[int]]:
            fitted = self.prompts.fit_chat(body, principal, oldest=turn is not None and turn.body.truncation == "auto")
            truncated["tokens"] = fitted.dropped_tokens
            return [fitted.token_ids]

        return await self._serve(principal, body, tokenize, True, marks_of(request, arrived),
                                 session_id=session_header(request.headers), truncated=truncated,
                                 size=content_length(request.scope), turn=turn)

    @api.delete("/v1/sessions/{session_id}", responses=error_responses(400, 401, 404, 503))
    async def delete_session(self, session_id: str, request: Request) -> dict:
        """End one of the caller's sessions now: its KV blocks return to the LRU."""
        principal = self._authenticate(request)
        check_session_id(session_id, "session_id")
        released = await end_session_everywhere(self.llm, principal.tenant, session_id)
        if released is None:
            raise APIError(404, f"no session {session_id!r} of this tenant is held (never used, "
                           "already ended or expired)", "session_not_found", "session_id")
        return {"id": session_id, "object": "session.deleted", "deleted": True,
                "blocks_released": released}

    @api.post("/v1/sessions/{session_id}/fork", responses=error_responses(400, 401, 404, 409, 503))
    async def fork_session(self, session_id: str, body: ForkRequest, request: Request) -> dict:
        """Start a new session from this one's cached state (its KV blocks, shared; no recompute)."""
        principal = self._authenticate(request)
        check_session_id(session_id, "session_id")
        target = check_session_id(body.session_id, "session_id")
        blocks = await fork_session_everywhere(self.llm, principal.tenant, session_id, target)
        return {"id": target, "object": "session", "forked_from": session_id, "blocks": blocks}

    @api.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 403, 404, 413))
    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        """The token ids of a completions prompt or of a chat (the model's chat template applied),
        as the generation routes compute them: ``count`` is their ``usage.prompt_tokens``."""
        principal = self._authenticate(request)
        self._check_model(principal, body.model)
        ids = await self.prompts.off_loop(partial(self.prompts.tokenize_ids, body), content_length(request.scope))
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids}

    @api.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 401, 403, 404, 413))
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        """The text of token ids (special tokens included)."""
        principal = self._authenticate(request)
        self._check_model(principal, body.model)
        self.prompts.check_token_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    @api.get("/admin/tenants", responses=error_responses(401))
    async def admin_tenants(self, request: Request) -> dict:
        self._start_watcher()
        key = _bearer(request)
        if self.registry.is_admin(key):
            usage = await self.admission.usage_all()
            tenants = self.registry.describe()
            return {"tenants": {n: {**cfg, "usage": usage.get(n, {})} for n, cfg in tenants.items()},
                    "status": self.registry.status()}
        principal = self.registry.authenticate(key)
        own = self.registry.describe(principal.tenant)[principal.tenant]
        return {"tenants": {principal.tenant: {**own, "usage": await self.admission.usage(principal.tenant)}}}

    @api.get("/admin/tenants/status", responses=error_responses(401, 403))
    async def admin_status(self, request: Request) -> dict:
        self._start_watcher()
        key = _bearer(request)
        if not self.registry.is_admin(key):
            self.registry.authenticate(key)          # 401 for bad keys first
            raise APIError(403, "this route needs an admin key", "permission_denied")
        try:
            queue = await asyncio.wait_for(self.class_queue.status.remote(), CALL_TIMEOUT_S)
        except (TimeoutError, RayActorError):
            raise unavailable("class queue") from None
        in_flight = {q: 0 for q in self.registry.config.qos_classes} | queue["in_flight"]
        return {**self.registry.status(), "demo_keys_active": self.registry.active_demo_keys(),
                "in_flight_by_qos": in_flight,               # every class of tenants.yaml
                "granted_idle_places_by_qos": queue["granted_idle"], "overload_guard": self.guard.state()}

    @api.post("/admin/cache/flush", responses=error_responses(400, 401, 403, 404, 503))
    async def admin_cache_flush(self, request: Request, body: FlushRequest | None = None) -> dict:
        """Drop cached KV on every replica, its host tier and (through KV events) the prefix
        directory; sessions end. The next identical request is computed again."""
        self._start_watcher()
        key = _bearer(request)
        if not self.registry.is_admin(key):
            self.registry.authenticate(key)          # 401 for bad keys first
            raise APIError(403, "this route needs an admin key", "permission_denied")
        filt, salts, tenants = flush_filter(self.registry, body)
        return {"object": "cache.flush", **filt, **await flush_everywhere(self.llm, salts, tenants)}

    # ---- generation ----------------------------------------------------------------------
    def _reasoning(self, body) -> tuple[str, bool, bool] | None:
        """A chat's reasoning parser, whether its model thinks (``enable_thinking``, Qwen3's
        switch, from ``chat_template_kwargs`` or ``reasoning_effort``) and whether the answer
        shows the reasoning (``include_reasoning``). None without a parser. A structured
        output (``response_format``, a named function, ``required``) constrains what follows
        the reasoning (the engines have the parser too)."""
        if self.reasoning_parser is None:
            return None
        return (self.reasoning_parser, body.template_variables().get("enable_thinking", True) is not False,
                body.include_reasoning)

    async def _serve(self, principal, body, tokenize, chat: bool, marks: dict[str, float],
                     session_id: str | None = None, truncated: dict | None = None,
                     size: int | None = None, turn: Turn | None = None):
        """Queue place (before tokenizing), prompt ids, tenant limits, then the generation.
        ``tokenize`` gives the token ids of each prompt (a batch has several; each gets
        ``body.n`` choices). ``marks``: the ``perf_counter()`` instants so far (``arrived`` at
        the handler, and ``received`` / ``proxied`` when known, see ``marks_of``). ``size``:
        the request body's bytes (where ``tokenize`` runs, see ``Prompts.off_loop``)."""
        principal = tiered(principal, body.service_tier, self.registry.config.qos_classes, self.is_lane)
        tenant, qos = principal.tenant, principal.qos_name
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        await self.admitter.early(principal, rid)
        marks["queued"] = time.perf_counter()
        try:
            tools = body.tool_mode() if chat else None
            if tools == "auto" and self.tool_parser is None:
                raise APIError(400, AUTO_NEEDS_PARSER, param="tool_choice")
            if body.thinking_token_budget not in (None, -1) and self.reasoning_parser is None:
                raise APIError(400, "thinking_token_budget needs a server started with reasoning_parser "
                               "(e.g. qwen3): without one nothing tells where the thought ends",
                               param="thinking_token_budget")
            if session_id and body.use_beam_search:
                raise APIError(400, f"use_beam_search cannot run a session's turn: send it without {SESSION_HEADER}",
                               param="use_beam_search")
            prompts = await self.prompts.off_loop(tokenize, size)
            prompts = self.prompts.truncate(body, prompts)
            max_tokens, prompt_only = self.prompts.limits(body, prompts, chat, principal)
            unparsed = await parse_problem(body, tenant)
            if unparsed:
                status, field, message = unparsed
                if status == 429:
                    raise APIError(429, message, "spec_parse_busy", field, headers={"Retry-After": "5"})
                raise APIError(400, message, param=field)
        except BaseException:
            self.admitter.leave(qos, rid)
            raise
        marks["tokenized"] = time.perf_counter()
        ticket = await self.admitter.admit(principal, rid, sum(map(len, prompts)), max_tokens,
                                           len(prompts) * body.n)
        marks["admitted"] = time.perf_counter()
        thinking = self._reasoning(body) if chat else None
        hidden = thinking is not None and not thinking[2]   # include_reasoning false: no logprobs or ids (vLLM's)
        logprobs = None if hidden else _logprobs(body, chat)
        sampling = {"max_tokens": max_tokens, **body.sampling_values(self.prompts.defaults),
                    "seed": body.seed, "stop": body.stop_list(),
                    "stop_token_ids": body.stop_token_ids or [],
                    "ignore_eos": body.ignore_eos, "include_stop_str_in_output": body.include_stop_str_in_output,
                    "allowed_token_ids": body.allowed_token_ids, "bad_words": body.bad_words,
                    # a model's call tags may be special tokens: the parser reads them (as vLLM's)
                    "skip_special_tokens": body.skip_special_tokens and tools != "auto",
                    "logprobs": logprobs, "min_tokens": body.min_tokens,
                    "logit_bias": body.logit_bias, "thinking_token_budget": body.thinking_token_budget,
                    "repetition_detection": body.repetition_detection and body.repetition_detection.model_dump(),
                    "structured_outputs": body.structured()}
        echo = not chat and body.echo and self.prompts.echo_texts(body, prompts)
        prompt_k = _prompt_logprobs(body, logprobs, echo, chat)
        asked = [k for k in (prompt_k, logprobs if echo else None) if k is not None]
        scored = max(asked) if asked else None       # each prompt's leader scores its tokens
        siblings, beam = [], body.beam_params(max_tokens)     # a beam search: each prompt's leader runs it
        lora = self.served.adapter(body.model)
        salt = self.served.salt(principal.cache_salt, lora, body.cache_salt)
        for ids in prompts:
            hashes = hash_prompt_blocks(ids, self.block_size, salt, parent=self.hash_root)
            for j in range(body.n):          # choice i is prompt i // n's j-th
                i = len(siblings)
                siblings.append(GenerateRequest(
                    request_id=rid if i == 0 else f"{rid}-{i}", tenant=tenant, qos=qos,
                    prompt_token_ids=ids, block_hashes=hashes,
                    sampling={**sampling, "seed": sibling_seed(body.seed, j),
                              "prompt_logprobs": scored if j == 0 else None},
                    cache_salt=principal.cache_salt, request_salt=body.cache_salt, priority=principal.qos.priority,
                    pinned=principal.qos.pinned, session_id=session_id if i == 0 else None, lora=lora,
                    caller=self.caller, stream_interval=principal.qos.stream_interval if body.stream else 0,
                    beam=None if j else beam, prompt_cache_key=body.prompt_cache_key))
        run = GenerationRun(self, siblings, principal, ticket, chat, self.served.answered_name(body.model),
                            logprobs, marks, choices_per_prompt=body.n, echo=echo or None, prompt_only=prompt_only,
                            tool_mode=tools, reasoning=thinking,
                            one_call=chat and body.parallel_tool_calls is False, chat_echo=chat and body.echo_text(),
                            return_token_ids=bool(body.return_token_ids) and not hidden,
                            tokens_as_ids=bool(body.return_tokens_as_token_ids), prompt_logprobs=prompt_k)
        headers = {SESSION_HEADER: session_id} if session_id else {}
        dropped = (truncated or {}).get("tokens", 0)
        if dropped:
            headers[TRUNCATED_HEADER] = str(dropped)
        if body.stream:
            chunks = run.stream_chunks(body.include_usage(), body.continuous_usage())
            response = RunStream(run, sse(chunks) if turn is None else turn.events(chunks))
            response.headers.update(headers)
            return response
        answer = await run.complete()
        if dropped:
            answer.setdefault("kvharbor", {})["truncated_prompt_tokens"] = dropped
        if turn is not None:
            answer = await turn.answer(answer)
        return JSONResponse(answer, headers=headers or None)

    def request_done(self, qos: str, rid: str) -> None:
        """The request left the class queue (called exactly once per admitted request)."""
        self.admitter.leave(qos, rid)


class PremiumGateway(Gateway.__bases__[0]):         # the class serve.ingress wrapped
    """The premium lane (``kvharbor.platform.premium_lane``): the same routes, served by a
    uvicorn server of this replica's own on ``config["premium_port"]`` at ``config["lane_host"]``
    (Serve allows one FastAPI ingress per app, so this deployment is a plain one that serves
    HTTP itself)."""

    is_lane = True

    async def __init__(self, llm, config: dict) -> None:     # async: Serve runs it on the loop
        super().__init__(llm, config)
        host, port = config["lane_host"], config["premium_port"]
        sock = listening_socket(host, port)                     # a busy port fails the start
        self.server_task, self.server = start_server(lambda: self.served_api, sock)
        logger.info("premium lane on %s:%d", host, port)

    def _check_lane(self, principal) -> None:
        check_lane(principal.qos, principal.qos_name)

    def check_health(self) -> None:
        """Serve's health check: a lane whose server stopped is restarted."""
        if self.server_task.done():
            raise RuntimeError("the premium lane's HTTP server stopped")


__all__ = ["Gateway", "PremiumGateway", "api"]
