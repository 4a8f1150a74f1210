"""The latency benchmarks record the machine's noise floor beside their tail ratios."""

import time

from benchmarks.common import noise_floor


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_slow_repetitions_that_wait_are_told_from_ones_that_compute():
    calls = {"n": 0}

    def waits_every_tenth() -> None:
        calls["n"] += 1
        spin(0.002)
        if calls["n"] % 10 == 0:
            time.sleep(0.006)

    r = noise_floor(0.6, work=waits_every_tenth)
    assert 0.05 <= r["share_over_1_4x_p50"] <= 0.15
    assert r["slow_cpu_over_wall"] < 0.6          # slept: the thread was not computing
    assert r["p99_over_p50"] >= 3.0


def test_slow_repetitions_that_compute_longer_burn_their_wall_time():
    calls = {"n": 0}

    def computes_more_every_tenth() -> None:
        calls["n"] += 1
        spin(0.008 if calls["n"] % 10 == 0 else 0.002)

    r = noise_floor(0.6, work=computes_more_every_tenth)
    assert 0.05 <= r["share_over_1_4x_p50"] <= 0.15
    assert r["slow_cpu_over_wall"] > 0.8

