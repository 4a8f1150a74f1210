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
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .embeddings import MAX_INPUTS, EmbeddingRequest, embed
from .error_body import FieldError
from .openai_protocol import Text, TruncateTokens

Passage = Annotated[Text, Field(min_length=1)]
Passages = Annotated[list[Passage], Field(min_length=1, max_length=MAX_INPUTS - 1)]
_TRUNCATE = "Keep only each text's last this many tokens (vLLM's); -1: as many as the context holds."


class RerankRequest(BaseModel):
    """``POST /rerank`` (also ``/v1/rerank``, ``/v2/rerank``): documents ordered by relevance to a query."""

    model_config = ConfigDict(extra="forbid")
    model: Text = Field(description="Model id, as listed by /v1/models.")
    query: Passage = Field(description="The query.")
    documents: Passages = Field(description=f"The texts to rank (1 to {MAX_INPUTS - 1}).")
    top_n: int | None = Field(0, ge=0, description="Answer only the this many most relevant (0 or null: all).")
    return_documents: bool = Field(True, description="Each result carries its document's text (Cohere's field).")
    truncate_prompt_tokens: TruncateTokens = Field(None, ge=-1, description=_TRUNCATE)
    user: str | None = Field(None, description="An end-user id; accepted and ignored.")


class ScoreRequest(BaseModel):
    """``POST /score`` (also ``/v1/score``): a score per pair, 1:1, 1:N or N:N, as vLLM's."""

    model_config = ConfigDict(extra="forbid")
    model: Text = Field(description="Model id, as listed by /v1/models.")
    text_1: Passage | Passages | None = Field(None, description="The first texts (or queries).")
    text_2: Passage | Passages | None = Field(None, description="The second texts: one per first text, or any number for one.")
    queries: Passage | Passages | None = Field(None, description="vLLM's other name for text_1.")
    documents: Passage | Passages | None = Field(None, description="vLLM's other name for text_2.")
    truncate_prompt_tokens: TruncateTokens = Field(None, ge=-1, description=_TRUNCATE)
    user: str | None = Field(None, description="An end-user id; accepted and ignored.")

    @model_validator(mode="after")
    def _one_pairing(self):
        (first, a), (second, b) = self.sides()
        if (self.text_1 is not None or self.text_2 is not None) and first == "queries":
            raise FieldError("queries", "send text_1 and text_2, or queries and documents, not both pairs")
        for name, side in ((first, a), (second, b)):
            if side is None:
                raise FieldError(name, f"{name} is missing: send text_1 and text_2, or queries and documents")
        n_a, n_b = (len(x) if isinstance(x, list) else 1 for x in (a, b))
        if n_a > 1 and n_a != n_b:
            raise FieldError(second, f"{first} has {n_a} texts: {second} must have as many (pairs), "
                             "or send one in first place (1:N)")
        if n_a + n_b > MAX_INPUTS:
            raise FieldError(second, f"{first} and {second} hold {n_a + n_b} texts; at most {MAX_INPUTS} in all")
        return self

    def sides(self) -> tuple[tuple[str, str | list[str] | None], tuple[str, str | list[str] | None]]:
        if self.queries is not None or self.documents is not None:
            return ("queries", self.queries), ("documents", self.documents)
        return ("text_1", self.text_1), ("text_2", self.text_2)


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
    (first, a), (second, b) = body.sides()
    left, right = _named(first, a), _named(second, b)
    rid, run, vector = await _embedded(gw, principal, body, left + right, marks, size)
    if len(left) == 1:
        left = left * len(right)
    scores = [float(vector(x) @ vector(y)) for (_, x), (_, y) in zip(left, right)]
    prompt = run.prompt_tokens
    return {"id": rid, "object": "list", "created": run.created, "model": run.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
