"""Offline parts of the load test: shapes, canary comparison, summary arithmetic. No server."""

from __future__ import annotations

import os
import random

import pytest

from loadtests import canaries, shapes, summary, workload
from loadtests.client import Result
from loadtests.records import Recorder, make_record


def test_overload_steps_to_twice_capacity_then_recovers_and_stops():
    at = lambda t: shapes.users_at("overload", t, 100.0, 5)  # noqa: E731
    assert [at(0), at(24.9), at(25), at(74.9), at(75), at(99.9)] == [5, 5, 10, 10, 5, 5]
    assert at(100) is None


def test_ramp_is_monotone_from_one_to_users_and_steady_is_flat():
    ramp = [shapes.users_at("ramp", t, 50.0, 8) for t in range(50)]
    assert ramp[0] == 1 and ramp[-1] == 8 and ramp == sorted(ramp)
    assert {shapes.users_at("steady", t, 30.0, 4) for t in range(30)} == {4}
    with pytest.raises(ValueError, match="choose one of"):
        shapes.users_at("spike", 0, 10, 1)


def test_parse_duration():
    assert shapes.parse_duration("90") == 90 and shapes.parse_duration("2m") == 120
    assert shapes.parse_duration("1h30m") == 5400 and shapes.parse_duration("20s") == 20
    with pytest.raises(ValueError):
        shapes.parse_duration("soon")


def test_canary_mismatch_is_detected_and_described():
    c = canaries.Canary("x", "premium", "p", 4, expected_text="abcd", expected_tokens=4)
    assert canaries.mismatch(c, "abcd", 4) is None
    assert "first difference at char 2" in canaries.mismatch(c, "abXd", 4)
    assert canaries.mismatch(c, "abcd", 3) is not None         # same text, wrong token count


def test_canary_prompts_start_with_each_tenants_shared_prefix():
    info = workload.read_tenants("tenants.yaml")
    by_name = {c.name: c for c in canaries.canary_prompts(info)}
    assert by_name["premium-pinned"].prompt.startswith(info.premium_prompt)
    assert "Acme" in info.premium_prompt
    assert by_name["standard-document"].prompt.startswith(workload.GLOBEX_PROMPT)
    assert {c.qos for c in by_name.values()} == {"premium", "standard", "batch"}


def _rec(qos: str, status: int = 200, ttft: float | None = 0.1, canary=None, problem=None, **kw) -> dict:
    res = Result(status=status, error=None if status == 200 else "HTTP", text="t", e2e_s=kw.get("e2e", 0.5),
                 ttft_s=ttft, itl_s=0.01 if ttft else None, prompt_tokens=100, cached_tokens=kw.get("cached", 50),
                 completion_tokens=8)
    return make_record(res, workload.TENANT_OF[qos], qos, "chat", ttft is not None, canary, problem)


def test_summary_slo_attainment_hit_rate_and_failures():
    slo = {"premium": 250.0, "standard": 1000.0}
    recs = [_rec("premium", ttft=0.1), _rec("premium", ttft=0.3), _rec("premium", ttft=0.2, cached=100),
            _rec("premium", status=429, ttft=None), _rec("premium", status=500, ttft=None),
            _rec("standard", ttft=2.0, canary="c", problem="canary c: differs")]
    recs[4]["stream"] = True                                     # a failed stream is an SLO miss
    s = summary.summarize(recs, slo)
    p = s["groups"]["acme/premium"]
    assert p["slo"]["n"] == 4 and p["slo"]["attainment"] == 0.5  # 0.1, 0.2 met; 0.3 and the 500 missed
    assert p["rate_limited"] == 1 and p["unexpected_failures"] == 1
    assert p["cache_hit_rate"] == pytest.approx(200 / 300, abs=1e-4)
    assert p["ttft_ms"]["p50"] == pytest.approx(200.0) and p["ttft_ms"]["n"] == 3
    assert s["canaries"] == {"checks": 1, "matched": 0, "mismatches": ["canary c: differs"], "by_name": {"c": 1}}
    assert s["failures"]["unexpected"] == 2 and s["passed"] is False
    assert "SLO" in summary.markdown(s) and "FAILED" in summary.markdown(s)


def test_recorder_counts_unexpected_and_canaries(tmp_path):
    rec = Recorder(tmp_path / "r.jsonl")
    rec.add(_rec("batch", status=429, ttft=None))
    rec.add(_rec("batch", canary="c"))
    assert rec.unexpected == 0 and rec.canary_checks == 1
    rec.add(_rec("batch", canary="c", problem="bad"))
    assert rec.unexpected == 1 and rec.canary_mismatches == ["bad"]
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 3


def test_percentile_interpolates():
    assert summary.percentile([], 50) is None
    assert summary.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert summary.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    xs = [random.random() for _ in range(50)]
    assert summary.percentile(xs, 0) == min(xs) and summary.percentile(xs, 100) == max(xs)


def test_open_loop_rate_follows_the_shape_and_stops():
    assert [shapes.rate_at("steady", t, 100, 4.0) for t in (0, 50, 99.9)] == [4.0, 4.0, 4.0]
    assert [shapes.rate_at("overload", t, 100, 4.0) for t in (10, 30, 70, 80)] == [4.0, 8.0, 8.0, 4.0]
    ramp = [shapes.rate_at("ramp", t, 100, 4.0) for t in range(0, 100, 5)]
    assert ramp == sorted(ramp) and ramp[0] > 0 and ramp[-1] == 4.0
    assert shapes.rate_at("steady", 100, 100, 4.0) is None
    with pytest.raises(ValueError, match="arrival rate"):
        shapes.rate_at("steady", 0, 100, 0)


def test_sse_lines_are_split_across_arbitrary_chunk_boundaries():
    from loadtests.client import _lines

    text = b'data: {"a": 1}\r\n\r\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(text)):
        chunks = [text[i:i + cut] for i in range(0, len(text), cut)]
        assert [line for line in _lines(chunks) if line] == \
            [b'data: {"a": 1}', b'data: {"b": 2}', b"data: [DONE]"], cut


def test_dropped_open_loop_arrivals_are_counted_apart_from_failures():
    dropped = make_record(Result(error="dropped: in-flight cap reached", dropped=True), "acme",
                          "premium", "chat", True)
    ok = make_record(Result(status=200, text="x", completion_tokens=1), "acme", "premium", "chat", False)
    s = summary.summarize([dropped, ok], {"premium": 250})
    assert dropped["status"] == "dropped"
    assert s["failures"]["dropped"] == 1 and s["failures"]["unexpected"] == 0
    assert s["groups"]["acme/premium"]["dropped"] == 1 and s["passed"]


def test_the_locustfile_loads_from_any_directory_with_the_servers_tenants(tmp_path):
    """``locust -f /path/to/loadtests/locustfile.py`` run outside the repository imports its
    helpers and reads the tenants file the server reads there (the packaged example), so
    premium users send acme's pinned system prompt."""
    import subprocess
    import sys
    from pathlib import Path

    locustfile = Path(__file__).resolve().parents[2] / "loadtests" / "locustfile.py"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVH_TENANTS")}
    code = "import runpy, sys; print(runpy.run_path(sys.argv[1])['INFO'].premium_prompt)"
    out = subprocess.run([sys.executable, "-c", code, str(locustfile)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    packaged = workload.read_tenants(Path(__file__).resolve().parents[2] / "kvharbor" / "data" / "tenants.yaml")
    assert packaged.premium_prompt and out.stdout.strip() == packaged.premium_prompt.strip()
