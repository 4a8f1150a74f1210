"""vLLM's ``/score`` and ``/rerank`` (Jina's and Cohere's rerank API) over embeddings.

As vLLM answers them for an embedding model (a bi-encoder), a pair's score is the cosine
similarity of the two texts' embeddings (``embeddings``: each text an engine request of the
tenant's class, routed by its prefix). The prefix cache is what makes this cheap on a RAG
platform: the same documents are reranked against query after query, and each document's blocks
are read from the cache instead of computed again. Cross-encoder rerankers (a classification
head) are not served.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field, model_validator

from .embeddings import MAX_INPUTS, EmbeddingRequest, embed
from .error_body import FieldError
from .json_types import REQUEST_FIELDS
from .openai_protocol import Text, TruncateTokens
from .service_tier import DOC as SERVICE_TIER_DOC, ServiceTier

Passage = Annotated[Text, Field(min_length=1)]
Passages = Annotated[list[Passage], Field(min_length=1, max_length=MAX_INPUTS - 1)]
_TRUNCATE = "Keep only each text's last this many tokens (vLLM's); -1: as many as the context holds."


class RerankRequest(BaseModel):
    """``POST /rerank`` (also ``/v1/rerank``, ``/v2/rerank``): documents ordered by relevance to a query."""

    model_config = REQUEST_FIELDS
    model: Text = Field(description="Model id, as listed by /v1/models.")
    query: Passage = Field(description="The query.")
    documents: Passages = Field(description=f"The texts to rank (1 to {MAX_INPUTS - 1}).")
    top_n: int | None = Field(0, ge=0, description="Answer only the this many most relevant (0 or null: all).")
    return_documents: bool = Field(True, description="Each result carries its document's text (Cohere's field).")
    truncate_prompt_tokens: TruncateTokens = Field(None, ge=-1, description=_TRUNCATE)
    user: str | None = Field(None, description="An end-user id; accepted and ignored.")
    service_tier: ServiceTier | None = Field(None, description=SERVICE_TIER_DOC)


class ScoreRequest(BaseModel):
    """``POST /score`` (also ``/v1/score``): a score per pair of ``text_1`` and ``text_2``, 1:1,
    1:N or N:N, as vLLM's."""

    model_config = REQUEST_FIELDS
    model: Text = Field(description="Model id, as listed by /v1/models.")
    text_1: Passage | Passages = Field(description="The first texts (or one, scored against each of text_2).")
    text_2: Passage | Passages = Field(description="The second texts: one per first text, or any number for one.")
    truncate_prompt_tokens: TruncateTokens = Field(None, ge=-1, description=_TRUNCATE)
    user: str | None = Field(None, description="An end-user id; accepted and ignored.")
    service_tier: ServiceTier | None = Field(None, description=SERVICE_TIER_DOC)

    @model_validator(mode="after")
    def _pairs(self):
        n_1, n_2 = (len(x) if isinstance(x, list) else 1 for x in (self.text_1, self.text_2))
        if n_1 > 1 and n_1 != n_2:
            raise FieldError("text_2", f"text_1 has {n_1} texts: text_2 must have as many (pairs), "
                             "or send one text_1 (1:N)")
        if n_1 + n_2 > MAX_INPUTS:
            raise FieldError("text_2", f"text_1 and text_2 hold {n_1 + n_2} texts; at most {MAX_INPUTS} in all")
        return self


def _rows(vectors: list[bytes]) -> np.ndarray:
    """The vectors as rows (unit length, as ``embed`` normalizes them: cosine = row dot row)."""
    return np.stack([np.frombuffer(v, dtype=np.float32) for v in vectors]).astype(np.float64)


async def _embedded(gw, principal, body, named: list[tuple[str, str]], marks, size):
    """Embed the distinct texts of ``named`` (``(field name, text)``, the name a 400 gives it)."""
    first: dict[str, str] = {}
    for name, text in named:
        first.setdefault(text, name)
    request = EmbeddingRequest(model=body.model, input=list(first), truncate_prompt_tokens=body.truncate_prompt_tokens)
    request._names = list(first.values())
    rid, run, vectors = await embed(gw, principal, request, marks, size, kind="score")
    rows = _rows(vectors)
    index = {text: i for i, text in enumerate(first)}
    return rid, run, lambda text: rows[index[text]]


def _named(field: str, value: str | list[str]) -> list[tuple[str, str]]:
    return [(field, value)] if isinstance(value, str) else [(f"{field}.{i}", v) for i, v in enumerate(value)]


async def serve_rerank(gw, principal, body: RerankRequest, marks: dict[str, float], size: int | None) -> dict:
    docs = _named("documents", body.documents)
    rid, run, vector = await _embedded(gw, principal, body, [("query", body.query)] + docs, marks, size)
    query = vector(body.query)
    scores = [float(vector(text) @ query) for _, text in docs]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or None]
    prompt = run.prompt_tokens
    return {"id": rid, "model": run.model, "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "results": [{"index": i, "relevance_score": scores[i],
                         "document": {"text": body.documents[i]} if body.return_documents else None}
                        for i in order]}


async def serve_score(gw, principal, body: ScoreRequest, marks: dict[str, float], size: int | None) -> dict:
    left, right = _named("text_1", body.text_1), _named("text_2", body.text_2)
    rid, run, vector = await _embedded(gw, principal, body, left + right, marks, size)
    if len(left) == 1:
        left = left * len(right)
    scores = [float(vector(x) @ vector(y)) for (_, x), (_, y) in zip(left, right)]
    prompt = run.prompt_tokens
    return {"id": rid, "object": "list", "created": run.created, "model": run.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
