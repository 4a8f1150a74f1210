"""The latency benchmarks record the machine's noise floor beside their tail ratios.

The clocks are fakes the work advances, so the figures do not depend on the test machine's
own load."""

import types

import pytest

import benchmarks.common as common


@pytest.fixture()
def clock(monkeypatch):
    c = types.SimpleNamespace(wall=0.0, cpu=0.0, calls=0)
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: c.wall,
                                                              thread_time=lambda: c.cpu))
    return c


def work_of(clock, slow_wall: float, slow_cpu: float):
    """Work of 2 ms; every tenth call takes ``slow_wall`` of wall and ``slow_cpu`` of CPU."""
    def work() -> None:
        clock.calls += 1
        slow = clock.calls % 10 == 0
        clock.wall += slow_wall if slow else 0.002
        clock.cpu += slow_cpu if slow else 0.002
    return work


def test_slow_repetitions_that_wait_are_told_from_ones_that_compute(clock):
    r = common.noise_floor(1.0, work=work_of(clock, slow_wall=0.008, slow_cpu=0.002))
    assert r["share_over_1_4x_p50"] == pytest.approx(0.1, abs=0.01)
    assert r["slow_cpu_over_wall"] == pytest.approx(0.25)    # slept: the thread waited
    assert r["p50_ms"] == pytest.approx(2.0) and r["p99_over_p50"] == pytest.approx(4.0)


def test_slow_repetitions_that_compute_longer_burn_their_wall_time(clock):
    r = common.noise_floor(1.0, work=work_of(clock, slow_wall=0.008, slow_cpu=0.008))
    assert r["share_over_1_4x_p50"] == pytest.approx(0.1, abs=0.01)
    assert r["slow_cpu_over_wall"] == pytest.approx(1.0)


def test_an_even_machine_has_no_slow_repetitions(clock):
    r = common.noise_floor(1.0, work=work_of(clock, slow_wall=0.002, slow_cpu=0.002))
    assert r["share_over_1_4x_p50"] == 0 and r["slow_cpu_over_wall"] is None
    assert r["p99_over_p50"] == pytest.approx(1.0)
