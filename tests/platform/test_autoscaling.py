"""Autoscaling the LLM replicas (kvharbor.platform.autoscaling): pinned classes' direct
streams, which Serve's handles and replicas never count, size the deployment too."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError
from ray import serve
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from kvharbor.actors.replica import LLMReplica
from kvharbor.config import PlatformConfig
from kvharbor.platform.autoscaling import DIRECT_STREAMS, POLICY, ongoing_requests_policy
from tests.platform.test_direct_stream import _direct_to, replica_request

APP = "kvh-autoscale-test"
DIRECTORY = "kvh-autoscale-test-directory"


def _context(replicas: int, ongoing: float, direct: dict[str, float], target: float = 2.0):
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target)
    return AutoscalingContext(
        deployment_id=None, deployment_name="LLMReplica", app_name="kvharbor",
        current_num_replicas=replicas, target_num_replicas=replicas,
        running_replicas=[], total_num_requests=ongoing, total_queued_requests=0,
        aggregated_metrics={DIRECT_STREAMS: direct} if direct is not None else {},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=time.time(), config=config)


def test_the_policy_sizes_on_serves_ongoing_requests_plus_open_direct_streams():
    """Serve's default policy sees only its own count: 8 direct streams over 2 replicas read
    as an idle deployment (0 replicas wanted); kvharbor's wants 8 / 2 = 4, and with Serve's 2
    handle requests beside them, 5. Without direct streams both agree."""
    premium_only = _context(2, 0.0, {"r1": 5.0, "r2": 3.0})
    assert replica_queue_length_autoscaling_policy(premium_only)[0] == 0
    assert ongoing_requests_policy(premium_only)[0] == pytest.approx(4.0)
    assert ongoing_requests_policy(_context(2, 2.0, {"r1": 5.0, "r2": 3.0}))[0] == pytest.approx(5.0)
    for direct in ({}, None):
        plain = _context(3, 6.0, direct)
        assert ongoing_requests_policy(plain)[0] == pytest.approx(
            replica_queue_length_autoscaling_policy(plain)[0]) == pytest.approx(3.0)
    assert ongoing_requests_policy(_context(0, 0.0, {}))[0] == 0   # Serve's cold start decides


def test_the_option_takes_serves_fields_as_json_and_sets_kvharbors_policy():
    cfg = PlatformConfig(autoscaling='{"min_replicas": 1, "max_replicas": 4, '
                                     '"target_ongoing_requests": 8}')
    assert cfg.autoscaling == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8,
                               "policy": {"policy_function": POLICY}}
    assert PlatformConfig().autoscaling is None
    refused = {'{"max_replicas": 4': "takes JSON",
               '{"min_replicas": 1, "max_replica": 4}': "unknown fields ['max_replica']",
               '{"min_replicas": 0, "max_replicas": 4}': "at least 1",
               '{"min_replicas": 3, "max_replicas": 2}': "must be greater than or equal",
               '{"max_replicas": 2, "policy": {"policy_function": "x:y"}}': "leave out 'policy'",
               "[1, 2]": "takes an object"}
    for value, says in refused.items():
        with pytest.raises(ValidationError, match=says.replace("[", r"\[").replace("]", r"\]")):
            PlatformConfig(autoscaling=value)
    with pytest.raises(ValidationError, match="either replicas"):
        PlatformConfig(replicas=2, autoscaling={"max_replicas": 4})


def test_a_replica_reports_its_open_direct_streams_to_serves_autoscaler():
    """``record_autoscaling_stats`` (Serve's custom-metrics hook) counts a direct stream while
    it is open and no longer once it ended, as does the ``kvharbor_direct_streams`` gauge; a
    replica without direct streams reports 0."""
    from tests.observability.test_metrics_table import _recorder_with_fakes

    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64}, direct_streams=True)
    replica.metrics = _recorder_with_fakes()

    async def main():
        stats = await replica.record_routing_stats()
        before = replica.record_autoscaling_stats()
        events = aiter(_direct_to(stats, replica_request("a", 24)))
        await anext(events)
        during = replica.record_autoscaling_stats()
        async with replica._engine_lock:
            replica._record_metrics()
        [e async for e in events]
        for _ in range(100):                   # the server's side ends a moment after the frame
            if replica.record_autoscaling_stats()[DIRECT_STREAMS] == 0:
                break
            await asyncio.sleep(0.01)
        return before, during, replica.record_autoscaling_stats()

    before, during, after = asyncio.run(main())
    assert (before, during, after) == ({DIRECT_STREAMS: 0.0}, {DIRECT_STREAMS: 1.0},
                                       {DIRECT_STREAMS: 0.0})
    gauge = replica.metrics._m["kvharbor_direct_streams"].calls
    assert gauge == [(1, {"replica": replica.replica_id})]
    plain = LLMReplica({"device": "cpu", "num_kv_blocks": 16})
    assert plain.record_autoscaling_stats() == {DIRECT_STREAMS: 0.0}
    replica.__del__()
    plain.__del__()


def _replicas(states: tuple[str, ...] = ("RUNNING",)) -> int:
    deployment = serve.status().applications[APP].deployments["LLMReplica"]
    return sum(n for state, n in deployment.replica_states.items() if state in states)


def _wait_for(check, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, what
        time.sleep(0.25)
    return time.monotonic() - start


def test_serve_scales_the_replicas_up_on_direct_streams_alone_and_back_down(kvharbor_app):
    """A deployment built by ``llm_replicas`` from ``autoscaling`` (1 to 2 replicas, target 1
    ongoing request, no delays) gets only premium direct streams: 4 kept open back to back.
    Serve adds the second replica (Serve's own policy would see nothing to scale for), and
    goes back to one once the streams stop."""
    from kvharbor.platform.app import llm_replicas

    cfg = PlatformConfig(num_kv_blocks=512, directory_name=DIRECTORY, autoscaling={
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
        "upscale_delay_s": 0, "downscale_delay_s": 1, "metrics_interval_s": 0.25,
        "look_back_period_s": 1})
    handle = serve.run(llm_replicas(cfg, str(kvharbor_app.tenants_path)), name=APP,
                       route_prefix=None)
    try:
        assert _replicas() == 1
        address = handle.record_routing_stats.remote().result(timeout_s=120)["direct"]
        assert address is not None
        stop = asyncio.Event()

        async def keep_open(worker: int) -> int:
            sent = 0
            while not stop.is_set():
                stream = _direct_to({"direct": address}, replica_request(f"as{worker}-{sent}", 1500))
                sent += 1
                async for _ in stream:
                    if stop.is_set():
                        stream.cancel()
                        break
            return sent

        async def main() -> tuple[float, list[int]]:
            workers = [asyncio.ensure_future(keep_open(w)) for w in range(4)]
            try:
                up = await asyncio.to_thread(_wait_for, lambda: _replicas() == 2, 90,
                                             "Serve never added a replica for the direct streams")
            finally:
                stop.set()
                sent = await asyncio.gather(*workers)
            return up, sent

        up_s, sent = asyncio.run(main())
        assert all(n >= 1 for n in sent)
        _wait_for(lambda: _replicas(("RUNNING", "STARTING", "STOPPING")) == 1, 90,
                  "Serve kept two replicas after the direct streams stopped")
        print(f"scaled up after {up_s:.1f} s; streams sent per worker {sent}")
    finally:
        serve.delete(APP)     # its directory stays (no CPU): routers in this process follow it
