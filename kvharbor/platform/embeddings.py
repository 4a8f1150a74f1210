"""``POST /v1/embeddings`` (OpenAI's route; vLLM's ``/v1/embeddings``).

Each input becomes one engine request that pools its prompt (``kvharbor.engine.pooling``): it
takes the tenant's key, class, limits and queue place as a generation does, the KV-aware router
sends it where its prefix is cached (a RAG platform embeds the same documents' chunks and
queries again and again), and the replica batches it with generation. Inputs of one request run
side by side, each on the replica its own prefix picks. The vector comes back as float32 bytes
and is answered as a list of floats or, with ``encoding_format: "base64"`` (the OpenAI SDK's
default), as those bytes in base64, little-endian as the SDK reads them.
"""

from __future__ import annotations

import base64
import functools
import sys
import time
import uuid
from array import array
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, Field, PrivateAttr, model_validator

from kvharbor.engine.hashing import hash_prompt_blocks
from kvharbor.engine.model_info import model_config
from kvharbor.engine.pooling import PoolingParams

from .error_body import APIError, FieldError
from .generation import GenerationRun
from .json_types import REQUEST_FIELDS
from .openai_protocol import MAX_PROMPT_TOKEN_IDS, Text, TokenId, TruncateTokens, prompt_shape
from .service_tier import DOC as SERVICE_TIER_DOC, ServiceTier
from .protocol import GenerateRequest

MAX_INPUTS = 2048
"""Inputs per request, as OpenAI's (LangChain's ``OpenAIEmbeddings`` sends up to 1,000)."""


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request, with vLLM's fields. Unknown fields are a 400."""

    model_config = REQUEST_FIELDS
    model: Text = Field(description="Model id, as listed by /v1/models.")
    input: Annotated[Text | list[TokenId] | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
                     | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_INPUTS)],
                     BeforeValidator(functools.partial(prompt_shape, max_prompts=MAX_INPUTS))] = Field(
        description=f"A text, a list of token ids (each in [0, vocabulary size), at most {MAX_PROMPT_TOKEN_IDS}), "
                    f"or a batch: up to {MAX_INPUTS} texts or token-id lists, answered in their order.")
    encoding_format: Literal["float", "base64"] | None = Field("float", description="\"float\": each embedding a list of numbers; \"base64\": its float32 values (little-endian) in base64, as OpenAI's SDK asks by default.")
    dimensions: int | None = Field(None, ge=1, description="Keep the embedding's first this many values (then normalized): only a model trained for it (Matryoshka; its config sets is_matryoshka or matryoshka_dimensions), as vLLM.")
    user: str | None = Field(None, description="An end-user id; accepted and ignored.")
    service_tier: ServiceTier | None = Field(None, description=SERVICE_TIER_DOC + " Not in OpenAI's embeddings API.")
    truncate_prompt_tokens: TruncateTokens = Field(None, ge=-1, description="Keep only each input's last this many tokens (vLLM's); -1: as many as the context holds. Not in OpenAI's API.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (e.g. BOS) to a text input (vLLM's). Not in OpenAI's API.")
    normalize: bool | None = Field(None, description="Scale each embedding to unit length (vLLM's; default true). Not in OpenAI's API.")

    truncation_side: ClassVar[None] = None      # what ``Prompts.truncate`` reads: the last tokens stay
    _names: list[str] | None = PrivateAttr(None)    # see named_inputs

    @model_validator(mode="after")
    def _no_empty_text(self):
        for name, text in self.named_inputs():
            if isinstance(text, str) and not text:
                raise FieldError(name, f"{name} is empty: send some text to embed")
        return self

    def named_inputs(self) -> list[tuple[str, str | list[int]]]:
        """Each input with the name a 400 gives it (``input``, or ``input.<i>`` in a batch;
        ``names`` where a route embeds fields of its own, see ``scoring``)."""
        if self._names is not None:
            return list(zip(self._names, self.input))
        if isinstance(self.input, list) and self.input and not isinstance(self.input[0], int):
            return [(f"input.{i}", x) for i, x in enumerate(self.input)]
        return [("input", self.input)]

    def pooling(self) -> dict:
        """The engine's ``PoolingParams`` fields."""
        return {"dimensions": self.dimensions, "normalize": self.normalize is not False}


def bound_dimensions(schema: dict, config) -> None:
    """The ``dimensions`` the served model takes, in the OpenAPI ``schema`` of this route: only
    null for a model not trained for Matryoshka embeddings, else its sizes (or 1 to its hidden
    size), as ``PoolingParams.check`` enforces."""
    field = schema.get("components", {}).get("schemas", {}).get("EmbeddingRequest", {}) \
        .get("properties", {}).get("dimensions")
    if field is None:
        return
    sizes = getattr(config, "matryoshka_dimensions", None)
    if sizes:
        taken = {"enum": sorted(sizes)}
    elif getattr(config, "is_matryoshka", False):
        taken = {"type": "integer", "minimum": 1, "maximum": config.hidden_size}
    else:
        field.pop("anyOf", None)
        field["type"] = "null"
        return
    field["anyOf"] = [taken, {"type": "null"}]


class Embedding(BaseModel):
    object: Literal["embedding"] = Field(description="Object type.")
    index: int = Field(description="The input's position in the request.")
    embedding: list[float] | str = Field(description="The vector, or its float32 bytes in base64.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of all inputs.")
    total_tokens: int = Field(description="The same (nothing is generated).")
    prompt_tokens_details: dict[str, int] = Field(description="cached_tokens: those read from the prefix cache.")


class EmbeddingResponse(BaseModel):
    id: str = Field(description="Request id.")
    object: Literal["list"] = Field(description="Object type.")
    created: int = Field(description="Unix seconds.")
    model: str = Field(description="Model id.")
    data: list[Embedding] = Field(description="One embedding per input, in input order.")
    usage: EmbeddingUsage = Field(description="Token counts.")


class EmbeddingRun(GenerationRun):
    """The engine requests of one embeddings request (``GenerationRun``'s routing, retries,
    metrics and admission release; no tokens, so no time to first token)."""

    async def vectors(self) -> list[bytes]:
        """Each input's embedding (float32 bytes), in input order."""
        found: list[bytes | None] = [None] * len(self.reqs)
        async with self.accounted():
            async for index, event in self.all_events():
                found[index] = event.get("embedding", found[index])
            if None in found:
                raise APIError(503, "a replica ended an input's request before its embedding; retry the request",
                               "replica_failed", headers={"Retry-After": "1"})
        return found


def _encoded(vector: bytes, encoding: str | None) -> list[float] | str:
    if encoding == "base64":
        if sys.byteorder != "little":
            v = array("f", vector)
            v.byteswap()
            vector = v.tobytes()
        return base64.b64encode(vector).decode("ascii")
    return array("f", vector).tolist()


async def serve_embeddings(gw, principal, body: EmbeddingRequest, marks: dict[str, float], size: int | None) -> dict:
    """The answer to ``body`` from ``principal``, through ``gw`` (a ``Gateway``)."""
    rid, run, vectors = await embed(gw, principal, body, marks, size)
    prompt = run.prompt_tokens
    return {"id": rid, "object": "list", "created": run.created, "model": run.model,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt,
                      "prompt_tokens_details": {"cached_tokens": run.cached_tokens}}}


async def embed(gw, principal, body: EmbeddingRequest, marks: dict[str, float], size: int | None,
                kind: str = "embd") -> tuple[str, EmbeddingRun, list[bytes]]:
    """``(request id, its run, each input's vector as float32 bytes)``: ``body``'s inputs
    embedded for ``principal`` (key, queue place, admission, routing) through ``gw``."""
    tenant, qos = principal.tenant, principal.qos_name
    rid = f"{kind}-{uuid.uuid4().hex}"
    await gw.admitter.early(principal, rid)
    marks["queued"] = time.perf_counter()
    try:
        named = body.named_inputs()
        prompts = await gw.prompts.off_loop(lambda: gw.prompts.ids_of(named, body.add_special_tokens), size)
        prompts = gw.prompts.truncate(body, prompts)
        gw.prompts.check_lengths([name for name, _ in named], prompts, "shorten it or set truncate_prompt_tokens")
        try:                                # the engine checks them too; here the 400 names the field
            PoolingParams(**body.pooling()).check(model_config(gw.model))
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions") from None
    except BaseException:
        gw.admitter.leave(qos, rid)
        raise
    marks["tokenized"] = time.perf_counter()
    ticket = await gw.admitter.admit(principal, rid, sum(map(len, prompts)), 0, len(prompts))
    marks["admitted"] = time.perf_counter()
    lora = gw.served.adapter(body.model)
    salt = gw.served.salt(principal.cache_salt, lora)
    requests = [GenerateRequest(
        request_id=rid if i == 0 else f"{rid}-{i}", tenant=tenant, qos=qos, prompt_token_ids=ids,
        block_hashes=hash_prompt_blocks(ids, gw.block_size, salt, parent=gw.hash_root),
        sampling={"max_tokens": 1, "temperature": 0.0}, cache_salt=principal.cache_salt,
        priority=principal.qos.priority, pinned=principal.qos.pinned, lora=lora, caller=gw.caller,
        stream_interval=0, pooling=body.pooling()) for i, ids in enumerate(prompts)]
    run = EmbeddingRun(gw, requests, principal, ticket, False, gw.served.answered_name(body.model),
                       marks=marks, choices_per_prompt=1, prompt_only=True)
    return rid, run, await run.vectors()
