"""Shared fixtures. One local Ray cluster per test session, bound to loopback, started lazily."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RAY_METRICS_PORT = 18085


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster on 127.0.0.1 with its metrics endpoint on ``RAY_METRICS_PORT``."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                 _metrics_export_port=RAY_METRICS_PORT, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # noqa: BLE001 - best effort at session end
        pass
    ray.shutdown()


def pytest_configure(config):
    """Triton kernels run in the interpreter when there is no GPU (set before triton loads)."""
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except ImportError:
        pass
