"""`serve run kvharbor:build_app key=value` reaches every replica's engine (no Ray needed)."""

from __future__ import annotations

from kvharbor.config import EngineConfig, PlatformConfig
from kvharbor.platform.app import engine_kwargs


def test_replicas_get_the_engine_settings_the_app_is_given():
    cfg = PlatformConfig(enforce_eager=True, eviction_policy="lfu", block_size=32,
                         preemption_mode="swap", host_kv_blocks=64, device="cuda")
    on_gpu = engine_kwargs(cfg, on_gpu=True)
    assert on_gpu["enforce_eager"] is True and on_gpu["device"] == "cuda"
    assert (on_gpu["eviction_policy"], on_gpu["block_size"], on_gpu["preemption_mode"],
            on_gpu["host_kv_blocks"]) == ("lfu", 32, "swap", 64)
    assert engine_kwargs(cfg, on_gpu=False)["device"] == "cpu"      # no GPU found: CPU replicas
    engine = EngineConfig(**on_gpu)                                   # every key is a valid field
    assert engine.enforce_eager and engine.eviction_policy == "lfu"


def test_null_on_the_command_line_means_none():
    cfg = PlatformConfig(overload_lag_ms="null", low_priority_prefill_cap="None", replicas="3")
    assert cfg.overload_lag_ms is None and cfg.low_priority_prefill_cap is None and cfg.replicas == 3
    assert PlatformConfig(overload_lag_ms="5").overload_lag_ms == 5.0
    assert PlatformConfig().overload_lag_ms == 10.0                   # the guard is on by default


def test_direct_streams_need_the_kv_router():
    assert PlatformConfig().uses_direct_streams                       # on by default
    assert not PlatformConfig(router="pow2").uses_direct_streams      # no route_direct there
    assert not PlatformConfig(direct_streams=False).uses_direct_streams
