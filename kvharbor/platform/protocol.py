"""Messages between the gateway, the router and the replicas (plain dataclasses, picklable)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvharbor.engine.hashing import BlockHash


@dataclass(slots=True)
class GenerateRequest:
    """One generation request, as the gateway hands it to ``LLMReplica.generate``.

    ``block_hashes`` are the prompt's full-block hashes, salted by the tenant's cache scope
    (``cache_salt``), the request's own ``request_salt`` (vLLM's ``cache_salt``) and its adapter;
    the router matches them against the prefix directory and the engine recomputes the same
    hashes (one implementation: :mod:`kvharbor.engine.hashing`).
    """

    request_id: str
    tenant: str
    qos: str
    prompt_token_ids: list[int]
    block_hashes: list[BlockHash]
    sampling: dict                      # SamplingParams fields
    cache_salt: str | None = None
    request_salt: str | None = None     # the body's cache_salt: blocks shared only with its senders
    priority: int = 0                   # higher is more important
    pinned: bool = False                # QoS class reserves pinned KV blocks
    deadline_s: float | None = None     # absolute time.time() after which to give up
    session_id: str | None = None       # X-Session-ID: a turn of this session of ``tenant``
    prompt_cache_key: str | None = None     # OpenAI's: a routing affinity (routing_policy's doc)
    lora: str | None = None             # the LoRA adapter it generates with (None: the base model)
    caller: tuple[str, str] | None = None   # (namespace, actor name) reading the stream, if named
    stream_interval: int = 1            # tokens per event after the first; 0: the rest at the end
    pooling: dict | None = None         # an embedding request: PoolingParams fields (None: it generates)
    beam: dict | None = None            # a beam search: BeamSearchParams fields (actors.beam_runs)
    metadata: dict = field(default_factory=dict)


def session_key(tenant: str, session_id: str) -> str:
    """Compact, tenant-scoped id of a session (16 hex chars) that replicas report and the
    router matches: the same session id of two tenants gives two keys."""
    digest = hashlib.blake2b(f"{tenant}\x00{session_id}".encode(), digest_size=8)
    return digest.hexdigest()


@dataclass(slots=True)
class RoutingStats:
    """What a replica reports through ``record_routing_stats`` (as a dict, see ``as_dict``)."""

    replica_id: str
    block_size: int
    free_shared_blocks: int
    free_pinned_blocks: int
    total_blocks: int
    num_running: int
    num_waiting: int
    queue_by_priority: dict[int, int]   # running + waiting requests by priority
    sessions: list[str] = field(default_factory=list)   # ``session_key``s held here (newest last)
    at: float = 0.0                     # time.time() of the report (0: unknown)
    empty_shared_blocks: int | None = None   # free shared blocks holding no cached prefix
    shared_blocks: int | None = None         # size of the shared region
    direct: list | None = None               # [host, port, token hex] (direct_stream)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}
