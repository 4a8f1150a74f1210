"""``Engine.stats()``: one flat dict of counters and gauges, plus a memory breakdown.

Units: blocks, tokens, bytes. Counters (``*_tokens`` totals, ``preemptions``, ``evictions``,
``swap_*``, ``host_blocks_offloaded`` ...) only grow; the rest are gauges of the moment.
"""

from __future__ import annotations

from .block_pool import PINNED, SHARED


def memory_breakdown(engine) -> dict[str, dict[str, int]]:
    """Bytes by location and kind: ``{"device": {"kv_cache", "model_weights", "lora_adapters"},
    "host": {"kv_cache", "model_weights", "lora_adapters"}}``.

    "device" is the engine's device (``stats()["device"]``); on a CPU engine it is host RAM
    too, but stays reported apart from the host KV tier so the two read the same everywhere.
    """
    host_kv = engine.host.data.nbytes if engine.host is not None else 0
    adapters = sum(a.nbytes for a in list(engine.loras.adapters.values()))
    return {"device": {"kv_cache": engine.runner.kv_cache_bytes,
                       "model_weights": engine.runner.weights_bytes, "lora_adapters": adapters},
            "host": {"kv_cache": host_kv, "model_weights": 0, "lora_adapters": 0}}


def lora_requests(engine) -> dict[str, dict[str, int]]:
    """Running and waiting requests of each LoRA adapter: every loaded one (0 when idle),
    and one removed while its requests still run."""
    counts = {name: {"running": 0, "waiting": 0} for name in list(engine.loras.adapters)}
    for state, requests in (("running", engine.scheduler.running), ("waiting", engine.scheduler.waiting)):
        for req in requests:
            if req.lora is not None:
                counts.setdefault(req.lora.name, {"running": 0, "waiting": 0})[state] += 1
    return counts


def _tier_stats(engine) -> dict:
    host, transfer, kv = engine.host, engine.transfer, engine.kv
    return {
        "host_blocks_total": host.num_slots if host else 0,
        "host_blocks_used": host.num_used if host else 0,
        "host_blocks_swapped": host.num_owned if host else 0,
        "host_hit_tokens": kv.host_hits,
        "host_blocks_offloaded": transfer.blocks_to_host if transfer else 0,
        "host_blocks_loaded": transfer.blocks_to_device if transfer else 0,
        "host_blocks_dropped": host.num_dropped if host else 0,
        "swap_outs": kv.swap_outs,
        "swap_ins": kv.swap_ins,
        "preemption_mode": engine.config.preemption_mode,
        "sliding_window": engine.sliding_window or 0,
        "sliding_window_freed_blocks": kv.window_freed,
    }


def engine_stats(engine) -> dict:
    """Everything ``LLM.stats()`` reports (see module doc)."""
    pool = engine.pool
    pinned, shared = pool.region_counts(PINNED), pool.region_counts(SHARED)
    return {
        "blocks_total": len(pool.blocks),
        "blocks_free": pinned["free"] + pinned["cached"] + shared["free"] + shared["cached"],
        "blocks_cached": len(pool.cached),
        "blocks_used": pinned["used"] + shared["used"],
        "shared_blocks_total": shared["total"],
        "shared_blocks_used": shared["used"],
        "shared_blocks_free": shared["free"] + shared["cached"],
        "shared_blocks_empty": shared["free"],
        "pinned_blocks_total": pinned["total"],
        "pinned_blocks_used": pinned["used"],
        "pinned_blocks_reserved_idle": pinned["free"] + pinned["cached"],
        "prompt_tokens": engine.counters["prompt_tokens"],
        "generated_tokens": engine.counters["generated_tokens"],
        "requests_finished": engine.counters["finished"],
        "requests_aborted": engine.counters["aborted"],
        "prefix_query_tokens": engine.kv.prefix_queries,
        "prefix_hit_tokens": engine.kv.prefix_hits,
        "preemptions": engine.scheduler.num_preemptions,
        "steps_interrupted": engine.interrupt.num_interrupted,
        "evictions": pool.num_evictions,
        "spec_draft_tokens": engine.spec.draft_tokens if engine.spec else 0,
        "spec_accepted_tokens": engine.spec.accepted_tokens if engine.spec else 0,
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "block_size": engine.block_size,
        "kv_bytes_per_token": engine.runner.kv_bytes_per_token,
        "kv_cache_dtype": str(engine.runner.kv_cache_dtype).removeprefix("torch."),
        **_tier_stats(engine),
        **engine.sessions.stats(),
        "device": str(engine.device),
        "memory_bytes": memory_breakdown(engine),
        "host_huge_page_bytes_at_start": engine.host_huge_page_bytes,
        "lora_adapters": {name: {"path": a.path, "rank": a.rank, "bytes": a.nbytes}
                          for name, a in engine.loras.adapters.items()},
        "lora_adapters_failed": dict(engine.loras.failed),
    }
