"""The app's CPU replicas run with their weights and KV cache in huge pages."""

from __future__ import annotations

import pytest

from tests.engine.test_host_memory import _thp_mode
from tests.reliability.helpers import replica_stats


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="the kernel gives no transparent huge pages")
def test_every_replica_streams_its_weights_from_huge_pages(kvharbor_app):
    """A replica is a Ray worker process that imports the engine before torch allocates, so
    its weights and KV cache get huge pages as an in-process LLM's do (decode at a few rows
    streams every weight each token: 4 KB pages cost a third of the bandwidth on the VM)."""
    stats = replica_stats(kvharbor_app)
    assert stats and all(s["device"] == "cpu" for s in stats)
    # Each holds tiny-llama's weights and packed copies and its KV cache: more than 16 MB.
    assert all(s["host_huge_page_bytes_at_start"] >= 16 << 20 for s in stats), stats
