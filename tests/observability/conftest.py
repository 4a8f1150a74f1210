"""Fixtures for observability tests: a throwaway Prometheus scraping Ray's metrics port."""

from __future__ import annotations

import shutil

import pytest

from tests.observability.promql import Prometheus
from tests.observability.recorder_actor import metrics_port


@pytest.fixture(scope="module")
def prometheus(ray_cluster, tmp_path_factory):
    """A real ``prometheus`` on a free loopback port scraping Ray's metrics port every 1 s."""
    if shutil.which("prometheus") is None:
        pytest.skip("needs the `prometheus` binary (apt-get install prometheus)")
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{metrics_port()}")
    try:
        prom.wait_ready()
        yield prom
    finally:
        prom.stop()
