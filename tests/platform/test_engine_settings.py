"""`serve run kvharbor:build_app key=value` reaches every replica's engine (no Ray needed)."""

from __future__ import annotations

import pytest

from kvharbor.config import EngineConfig, PlatformConfig
from kvharbor.platform.app import engine_kwargs


def test_replicas_get_the_engine_settings_the_app_is_given():
    cfg = PlatformConfig(enforce_eager=True, eviction_policy="lfu", block_size=32,
                         preemption_mode="swap", host_kv_blocks=64, device="cuda", reasoning_parser="qwen3")
    on_gpu = engine_kwargs(cfg, on_gpu=True)
    assert on_gpu["enforce_eager"] is True and on_gpu["device"] == "cuda"
    assert (on_gpu["eviction_policy"], on_gpu["block_size"], on_gpu["preemption_mode"],
            on_gpu["host_kv_blocks"]) == ("lfu", 32, "swap", 64)
    assert engine_kwargs(cfg, on_gpu=False)["device"] == "cpu"      # no GPU found: CPU replicas
    engine = EngineConfig(**on_gpu)                                   # every key is a valid field
    assert engine.enforce_eager and engine.eviction_policy == "lfu"
    assert engine.reasoning_parser == "qwen3"           # structured outputs wait for </think> there
    vllm_names = PlatformConfig(max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.5,
                                enable_prefix_caching=False)          # vLLM's serve flags
    assert {k: v for k, v in engine_kwargs(vllm_names, on_gpu=True).items() if k in (
        "max_model_len", "max_num_seqs", "gpu_memory_utilization", "enable_prefix_caching")} == {
        "max_model_len": 1024, "max_num_seqs": 8, "gpu_memory_utilization": 0.5, "enable_prefix_caching": False}


@pytest.mark.parametrize("args, message", [
    ({"max_model_len": "5000"}, "max_model_len=5000 exceeds the model's context of 4096"),
    ({"override_generation_config": '{"top_p": 0}'}, "top_p must be in"),
])
def test_an_option_the_model_cannot_run_is_refused_before_ray_starts(monkeypatch, args, message):
    import kvharbor.platform.app as app

    def started(*args, **kwargs):
        raise AssertionError("Ray was started before the options were checked against the model")

    monkeypatch.setattr(app, "_init_ray_on_loopback", started)
    with pytest.raises(ValueError, match=message):
        app.build_app(args)


def test_null_on_the_command_line_means_none():
    cfg = PlatformConfig(overload_lag_ms="null", low_priority_prefill_cap="None", replicas="3")
    assert cfg.overload_lag_ms is None and cfg.low_priority_prefill_cap is None and cfg.replicas == 3
    assert PlatformConfig(overload_lag_ms="5").overload_lag_ms == 5.0
    assert PlatformConfig().overload_lag_ms == 10.0                   # the guard is on by default


def test_direct_streams_need_the_kv_router():
    assert PlatformConfig().uses_direct_streams                       # on by default
    assert not PlatformConfig(router="pow2").uses_direct_streams      # no route_direct there
    assert not PlatformConfig(direct_streams=False).uses_direct_streams


@pytest.mark.parametrize("field, value", [("device", "tpu"), ("device", "cuda:1"), ("router", "kvv"),
                                          ("attention_backend", "cudnn"), ("dtype", "fp64"),
                                          ("kv_cache_dtype", "int4")])
def test_an_option_the_replicas_cannot_run_is_refused_before_the_cluster_starts(field, value):
    """``serve run kvharbor:build_app device=tpu`` ran CPU replicas (device=cuda:1 too: only
    'auto' and 'cuda' looked for GPUs); attention_backend=cudnn failed each replica's start."""
    with pytest.raises(ValueError, match=rf"{field}\n.*should match pattern"):
        PlatformConfig(**{field: value})


def test_cuda_asked_for_on_a_cluster_without_gpus_is_refused(monkeypatch):
    from kvharbor.platform import app

    monkeypatch.setattr(app, "_gpus", lambda: 0)
    with pytest.raises(ValueError, match="device='cuda' but the Ray cluster has no GPUs"):
        app.llm_replicas(PlatformConfig(device="cuda"), "tenants.yaml")


def test_the_engine_refuses_unknown_backends_dtypes_and_model_paths():
    for field, value in [("attention_backend", "cudnn"), ("dtype", "fp64"), ("kv_cache_dtype", "int4"),
                         ("model_path", "onnx")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})
    assert EngineConfig(attention_backend="cpu", dtype="bfloat16", kv_cache_dtype="fp8_e4m3").dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"      # vLLM's name for it
    assert PlatformConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"


def test_served_model_name_takes_distinct_names_apart_from_the_adapters():
    assert PlatformConfig(served_model_name="qwen, qwen-latest").served_model_name == ["qwen", "qwen-latest"]
    for bad, why in [({"served_model_name": "a,a"}, "distinct, non-empty"),
                     ({"served_model_name": "a,"}, "distinct, non-empty"),
                     ({"served_model_name": "x", "lora_modules": "x=/ckpt/x"}, "both name x")]:
        with pytest.raises(ValueError, match=why):
            PlatformConfig(**bad)


@pytest.mark.parametrize("args, message", [
    ({"lora_modules": "support=/ckpt/support,legal"}, "name=path pairs"),
    ({"lora_modules": "=/ckpt/x"}, "name=path pairs"),
    ({"lora_modules": "x="}, "name=path pairs"),
    ({"speculative_config": '{"prompt_lookup_min": 3, "prompt_lookup_max": 2}'},
     r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"),
])
def test_a_malformed_command_line_option_says_what_to_fix(args, message):
    with pytest.raises(ValueError, match=message):
        PlatformConfig(**args)
    assert PlatformConfig(lora_modules="support=/ckpt/support, legal=/ckpt/legal").lora_modules == {
        "support": "/ckpt/support", "legal": "/ckpt/legal"}


@pytest.mark.parametrize("value, want", [("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("2M", 2 * 2**20),
                                         ("4096", 4096), (4096, 4096), ("auto", None)])
def test_token_counts_take_vllms_suffixes(value, want):
    """``max_model_len=32k`` as vLLM's ``--max-model-len 32k`` (k: 1,000, K: 1,024; ``auto``:
    the model's own), also for ``max_num_batched_tokens``."""
    assert PlatformConfig(max_model_len=value).max_model_len == EngineConfig(max_model_len=value).max_model_len == want
    if want is not None:
        assert PlatformConfig(max_num_batched_tokens=value).max_num_batched_tokens == want


def test_a_binary_suffix_takes_no_decimals():
    with pytest.raises(ValueError, match="no decimals with K, M or G .* did you mean 1.5k"):
        PlatformConfig(max_model_len="1.5K")


def test_rays_prefix_router_is_a_peer_for_the_builtin_models_only():
    """``router=ray_prefix`` puts Ray Serve's PrefixCacheAffinityRouter (reading the builtin
    models' byte-tokenized prompts as text) in front of the replicas, for side-by-side runs."""
    import importlib

    from kvharbor.platform.app import ROUTERS

    cfg = PlatformConfig(router="ray_prefix")
    module, name = ROUTERS[cfg.router].split(":")
    router = getattr(importlib.import_module(module), name)
    assert router.__mro__[1].__name__ == "PrefixCacheAffinityRouter"
    assert not cfg.uses_direct_streams
    with pytest.raises(ValueError, match="builtin models"):
        PlatformConfig(router="ray_prefix", model="/ckpt/qwen3")
