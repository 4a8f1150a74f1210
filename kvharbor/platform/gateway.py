"""Gateway: the OpenAI-compatible HTTP ingress. Everything that depends on the tenant.

Per request: API key -> tenant (401) -> model check (404/403) -> tokenize and length checks
(400) -> admission: rate limits, budgets, concurrency, class queue (429) -> block hashes
salted by the tenant's cache scope -> ``LLMReplica.generate`` through the KV-aware router ->
JSON or SSE back, with ``usage.prompt_tokens_details.cached_tokens``.
"""


import asyncio
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from kvharbor.engine.hashing import hash_prompt_blocks
from kvharbor.engine.models import load_tokenizer, model_context_length
from kvharbor.observability.metrics import get_metrics
from kvharbor.platform.generation import GenerationRun, sse
from kvharbor.platform.openai_protocol import (APIError, ChatRequest, CompletionRequest,
                                               error_response)
from kvharbor.platform.protocol import GenerateRequest
from kvharbor.tenants import ActorAdmission, TenantError, TenantRegistry, get_or_create_admission_actor

logger = logging.getLogger("kvharbor.gateway")

api = FastAPI(title="kvharbor", version="0.1.0",
              description="OpenAI-compatible, tenant-aware LLM serving on Ray Serve.")


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message = "request body is not valid JSON (UTF-8 encoded)"
    elif tuple(first.get("loc", ())) == ("body",):
        message = "request body must be a JSON object (UTF-8 encoded) with the fields of this route"
    return error_response(400, message, param=where or None)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@api.exception_handler(TenantError)
async def _tenant_error(request: Request, exc: TenantError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.code)


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s", request.url.path)
    return error_response(500, "internal error; the request was not completed", "server_error")


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


@serve.ingress(api)
class Gateway:
    """Serve ingress deployment (options are set in ``kvharbor.platform.app``)."""

    def __init__(self, llm, config: dict) -> None:
        self.llm = llm
        self.config = config
        self.model = config["model"]
        self.registry = TenantRegistry(config["tenants"])
        self.tokenizer = load_tokenizer(self.model)
        self.context = min(config.get("max_model_len") or 10**9, model_context_length(self.model))
        self.block_size = config["block_size"]
        self.max_body_bytes = config["max_body_bytes"]
        self.admission = ActorAdmission(get_or_create_admission_actor())
        self.metrics = get_metrics()
        self.in_flight: dict[str, int] = {}
        self._watcher: asyncio.Task | None = None
        demo = self.registry.active_demo_keys()
        if demo:
            logger.warning("demo API keys are active for %s; revoke them in %s before exposing "
                           "this server", ", ".join(demo), config["tenants"])

    # ---- plumbing ------------------------------------------------------------------------
    def _start_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self.registry.watch(1.0))

    def _authenticate(self, request: Request):
        self._start_watcher()
        length = int(request.headers.get("content-length") or 0)
        if length > self.max_body_bytes:
            raise APIError(413, f"request body is {length} bytes; the limit is {self.max_body_bytes}",
                           "request_too_large")
        return self.registry.authenticate(_bearer(request))

    def _check_model(self, principal, model: str) -> None:
        if model != self.model:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model!r} "
                           "(see GET /v1/models)", "model_not_found", "model")
        self.registry.check_model(principal, model)

    # ---- routes --------------------------------------------------------------------------
    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "model": self.model, "tenants_version": self.registry.version}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authenticate(request)
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "kvharbor", "max_model_len": self.context}]}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        principal = self._authenticate(request)
        self._check_model(principal, body.model)
        if isinstance(body.prompt, str):
            ids = list(self.tokenizer(body.prompt)["input_ids"])
        else:
            ids = list(body.prompt)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return await self._serve(principal, body, ids, chat=False, request=request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatRequest, request: Request):
        principal = self._authenticate(request)
        self._check_model(principal, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return await self._serve(principal, body, ids, chat=True, request=request)

    @api.get("/admin/tenants")
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

    @api.get("/admin/tenants/status")
    async def admin_status(self, request: Request) -> dict:
        self._start_watcher()
        key = _bearer(request)
        if not self.registry.is_admin(key):
            self.registry.authenticate(key)          # 401 for bad keys first
            raise APIError(403, "this route needs an admin key", "permission_denied")
        return {**self.registry.status(), "demo_keys_active": self.registry.active_demo_keys()}

    # ---- generation ----------------------------------------------------------------------
    async def _serve(self, principal, body, ids: list[int], chat: bool, request: Request):
        tenant, qos = principal.tenant, principal.qos_name
        max_tokens = self._max_tokens(body, ids, chat, principal)
        queue_limit = principal.qos.max_queue
        if self.in_flight.get(qos, 0) >= queue_limit:
            self.metrics.rate_limited(tenant, "queue_full")
            raise APIError(429, f"QoS class {qos!r} has {queue_limit} requests queued (max_queue); "
                           "retry later", "queue_full", headers={"Retry-After": "1"})
        admission = await self.admission.try_admit(tenant, principal.limits, len(ids), max_tokens)
        if not admission.ok:
            if admission.status == 429:
                self.metrics.rate_limited(tenant, admission.limit or "other")
            headers = {"Retry-After": str(max(1, round(admission.retry_after_s or 1)))} \
                if admission.status == 429 else {}
            raise APIError(admission.status, admission.reason, admission.limit or "rate_limited",
                           headers=headers)
        gen_request = GenerateRequest(
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", tenant=tenant, qos=qos,
            prompt_token_ids=ids, block_hashes=hash_prompt_blocks(ids, self.block_size, principal.cache_salt),
            sampling={"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                      "top_k": body.top_k, "seed": body.seed, "stop": body.stop_list(),
                      "ignore_eos": body.ignore_eos},
            cache_salt=principal.cache_salt, priority=principal.qos.priority, pinned=principal.qos.pinned)
        run = GenerationRun(self, gen_request, principal, admission.ticket, chat, body.model)
        self.in_flight[qos] = self.in_flight.get(qos, 0) + 1
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(run.stream_chunks(include_usage)), media_type="text/event-stream")
        return JSONResponse(await run.complete())

    def _max_tokens(self, body, ids: list[int], chat: bool, principal) -> int:
        room = self.context - len(ids)
        if not ids:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        if room < 1:
            raise APIError(400, f"prompt is {len(ids)} tokens; the model's context is {self.context} "
                           "tokens: shorten the prompt", "context_length_exceeded", "prompt")
        if body.max_tokens is None:
            cap = principal.limits.max_tokens_per_request or 256
            return max(1, min(room, 16 if not chat else cap, cap))
        if body.max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {body.max_tokens}", param="max_tokens")
        if body.max_tokens > room:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({body.max_tokens}) exceeds the "
                           f"model's context of {self.context} tokens; lower max_tokens to at most {room}",
                           "context_length_exceeded", "max_tokens")
        return body.max_tokens

    def request_done(self, qos: str) -> None:
        self.in_flight[qos] = max(0, self.in_flight.get(qos, 0) - 1)


__all__ = ["Gateway", "api"]
