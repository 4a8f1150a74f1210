"""The QoS benchmark's capacity estimate (benchmarks/qos_load.py): the service rate of a full pipeline, not a burst's makespan."""

from __future__ import annotations

import pytest

from benchmarks import qos_load


def test_the_capacity_of_a_burst_is_its_steady_completion_rate():
    # 96 requests served at 40/s once the prefills are done (0.5 s), then 6 long stragglers
    ends = [0.5 + i / 40 for i in range(90)] + [4.0 + i for i in range(6)]
    assert qos_load.steady_rate(ends) == pytest.approx(40.0, rel=0.02)
    assert len(ends) / max(ends) < 11       # what the last completion gave: a quarter of it


def test_a_tiny_burst_falls_back_to_its_makespan():
    assert qos_load.steady_rate([1.0, 2.0, 4.0]) == pytest.approx(0.75)
