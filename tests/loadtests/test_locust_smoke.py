"""CI smoke: a short headless Locust run against the session's kvharbor app (tiny model).

Runs ``python -m loadtests.run`` in a subprocess (Locust monkey-patches the process it runs in,
and this one hosts the session's Ray driver). Bounded: the shape stops the test after
``--duration``; the runner kills Locust if it overstays.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(app, out: Path, duration: str, users: int, *extra: str) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "loadtests.run", "--host", app.base_url, "--shape", "steady",
           "--duration", duration, "--users", str(users), "--out", str(out),
           "--tenants", str(app.tenants_path), "--stop-timeout", "45", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return proc.returncode, summary, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.timeout(280)
def test_short_load_run_passes_with_canaries_and_slo_figures(kvharbor_app, tmp_path):
    rc, s, log = _run(kvharbor_app, tmp_path, "20s", 3)
    assert rc == 0, log
    assert s["failures"]["unexpected"] == 0, s["failures"]
    canaries = s["canaries"]
    assert canaries["checks"] >= 3 and canaries["matched"] == canaries["checks"], canaries
    groups = s["groups"]
    assert {g["qos"] for g in groups.values()} == {"premium", "standard", "batch"}
    slo = {g["qos"]: g["slo"] for g in groups.values()}
    assert slo["premium"]["ttft_slo_ms"] == 250 and slo["standard"]["ttft_slo_ms"] == 1000
    for g in groups.values():
        assert g["ok"] > 0 and 0.0 <= g["slo"]["attainment"] <= 1.0, g
        assert g["ttft_ms"]["p50"] is not None and g["throughput"]["requests_per_s"] > 0
    assert groups["acme/premium"]["cache_hit_rate"] > 0        # the pinned system prompt is reused
    assert (tmp_path / "latency_over_time.png").stat().st_size > 0
    assert (tmp_path / "hit_rate_over_time.png").stat().st_size > 0
    assert "SLO attained" in (tmp_path / "summary.md").read_text()


@pytest.mark.timeout(260)
def test_a_wrong_canary_expectation_fails_the_run(kvharbor_app, tmp_path):
    from loadtests import canaries, workload

    info = workload.read_tenants(kvharbor_app.tenants_path)
    wrong = canaries.canary_prompts(info)
    for c in wrong:                        # expectations no model would produce
        c.expected_text, c.expected_tokens = "not what the model says", c.max_tokens
    canaries.save(wrong, tmp_path / "wrong.json")
    rc, s, log = _run(kvharbor_app, tmp_path / "out", "4s", 3, "--canaries", str(tmp_path / "wrong.json"))
    assert rc == 1, log
    assert s["passed"] is False and s["canaries"]["checks"] >= 1
    assert s["canaries"]["matched"] == 0 and "first difference" in s["canaries"]["mismatches"][0]
    assert "CANARY MISMATCH" in log


@pytest.mark.timeout(260)
def test_open_loop_keeps_arriving_while_answers_are_slow(kvharbor_app, tmp_path):
    """8 arrivals/s with at most 1 open: a closed loop would slow down to the server's pace;
    the open loop keeps its Poisson arrivals and records the ones it could not send as dropped."""
    rc, s, log = _run(kvharbor_app, tmp_path, "8s", 1, "--arrival-rate", "8", "--max-in-flight", "1")
    assert rc == 0, log
    total = s["total"]
    assert s["arrival_rate"] == 8.0 and s["failures"]["unexpected"] == 0, s["failures"]
    assert 30 <= total["requests"] <= 110, total           # Poisson(64) within ~4 sigma
    assert total["dropped"] > 0 and total["ok"] >= 2, total
    assert total["ok"] + total["dropped"] + total["rate_limited"] == total["requests"]
    assert {g["qos"] for g in s["groups"].values()} == {"premium", "standard", "batch"}
    assert s["canaries"]["checks"] >= 1 and s["canaries"]["matched"] == s["canaries"]["checks"]
