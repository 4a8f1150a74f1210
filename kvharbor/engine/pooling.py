"""Embeddings: a request that pools its prompt instead of generating (vLLM's ``LLM.embed``,
``/v1/embeddings``).

A decoder-only embedding model (Qwen3-Embedding, gte-Qwen2, e5-mistral: a Qwen3 / Qwen2 /
Mistral causal LM checkpoint) embeds a text as the final hidden state of its last token (after
the model's last norm), scaled to unit length: vLLM's default for such a model (``LAST``
pooling, ``normalize``). kvharbor runs one as an ordinary request whose prompt is computed
through the paged KV cache, so it is batched with generation, scheduled by its class, and its
prompt blocks are read from and written to the prefix cache like any prompt's; at the step that
computes its last token, the runner keeps that row's hidden state and the engine answers it
(``Engine._account``) instead of sampling. A prefix-cache hit changes nothing in the vector:
the last token is always computed, over the cached K/V of the rest.

Mean pooling, which needs every position's hidden state, is not offered: a prompt read from the
cache has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import RequestOutput


@dataclass(slots=True)
class PoolingParams:
    """vLLM's ``PoolingParams`` for embeddings.

    ``dimensions``: keep the vector's first ``dimensions`` values (Matryoshka embeddings: only
    for a model whose config says it was trained for it, ``is_matryoshka`` or
    ``matryoshka_dimensions``, as vLLM requires). ``normalize``: scale to unit L2 length
    (after the cut), vLLM's default for embeddings.
    """

    dimensions: int | None = None
    normalize: bool = True

    def check(self, config) -> None:
        """Raise ValueError when the model of HF ``config`` cannot answer these params."""
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is None:
            return
        if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
        sizes = getattr(config, "matryoshka_dimensions", None)
        if not (getattr(config, "is_matryoshka", False) or sizes):
            raise ValueError("this model does not support matryoshka representation (its config sets "
                             "neither is_matryoshka nor matryoshka_dimensions): leave dimensions unset")
        if sizes and self.dimensions not in sizes:
            raise ValueError(f"this model supports dimensions {sorted(sizes)}, got {self.dimensions}")
        if not 1 <= self.dimensions <= config.hidden_size:
            raise ValueError(f"dimensions must be in [1, {config.hidden_size}] (the model's hidden size), "
                             f"got {self.dimensions}")

    def embed(self, hidden):
        """The embedding of one prompt from its last token's final hidden state (a tensor
        ``[hidden]``): a float32 tensor on the CPU (``LLM.embed`` lists it, the replica sends its
        bytes). (torch is imported here: this module is torch-free for the replica's callers, as
        ``kvharbor.engine.request``.)"""
        import torch  # noqa: PLC0415

        v = hidden.float()
        if self.dimensions is not None:
            v = v[:self.dimensions]
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.cpu()


def check_pooling(pooling: PoolingParams, sampling, session_id: str | None, config) -> None:
    """Raise ValueError for an embedding request ``Engine.add_request`` cannot take."""
    if not isinstance(pooling, PoolingParams):
        raise ValueError(f"pooling must be a PoolingParams, got {type(pooling).__name__}")
    pooling.check(config)
    if session_id is not None:
        raise ValueError("an embedding request is not a turn of a session: leave session_id unset")
    if sampling.prompt_logprobs is not None or sampling.max_tokens != 1:
        raise ValueError("an embedding request computes its prompt only: sample with "
                         "SamplingParams(max_tokens=1) and no prompt_logprobs")


class PooledOutput(RequestOutput):
    """The engine's output for an embedding request: finished, no tokens, its ``embedding`` (a
    float32 tensor on the CPU, ``PoolingParams.embed``)."""

    __slots__ = ("embedding",)

    def __init__(self, request_id: str, prompt_token_ids: list[int], num_cached_tokens: int,
                 embedding) -> None:
        super().__init__(request_id, prompt_token_ids, [], "", "stop", num_cached_tokens)
        self.embedding = embedding

    def __reduce__(self):
        return PooledOutput, (self.request_id, self.prompt_token_ids, self.num_cached_tokens, self.embedding)


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's names; ``num_cached_tokens``: the prompt
    tokens read from the prefix cache)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
