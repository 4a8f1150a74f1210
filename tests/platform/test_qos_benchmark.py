"""The QoS benchmark's client (benchmarks/qos_load.py): its capacity estimate is the service rate
of a full pipeline, not a burst's makespan; its timed phases run without the client's GC; each
tenant keeps its own connections, refused requests included."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading

import pytest
import uvicorn

from benchmarks import qos_load


def test_the_capacity_of_a_burst_is_its_steady_completion_rate():
    # 96 requests served at 40/s once the prefills are done (0.5 s), then 6 long stragglers
    ends = [0.5 + i / 40 for i in range(90)] + [4.0 + i for i in range(6)]
    assert qos_load.steady_rate(ends) == pytest.approx(40.0, rel=0.02)
    assert len(ends) / max(ends) < 11       # what the last completion gave: a quarter of it


def test_a_tiny_burst_falls_back_to_its_makespan():
    assert qos_load.steady_rate([1.0, 2.0, 4.0]) == pytest.approx(0.75)


def test_a_timed_phase_pauses_the_clients_garbage_collector_and_restores_it():
    assert gc.isenabled()
    with qos_load.client_gc_paused() as collections:
        assert not gc.isenabled()          # no collection can stall the client mid-phase
        assert collections == []
    assert gc.isenabled()


def test_with_the_gc_left_on_the_phase_records_each_collection(monkeypatch):
    monkeypatch.setenv("KVH_CLIENT_GC", "on")
    with qos_load.client_gc_paused() as collections:
        assert gc.isenabled()
        gc.collect()
    assert len(collections) == 1 and collections[0] >= 0.0
    assert gc.isenabled()


def test_the_client_keeps_one_connection_per_tenant_when_it_is_refused():
    """Refused (429) requests leave their connection open for the next one, and each tenant
    sends through a pool of its own: 4 refused requests of 2 tenants use 2 connections."""
    peers: list[tuple[str, int]] = []

    async def refuse(scope, receive, send):
        if scope["type"] != "http":
            return
        peers.append(tuple(scope["client"]))
        while (await receive()).get("more_body"):
            pass
        body = b'{"error": {"message": "over the limit", "code": "rate_limited"}}'
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(refuse, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(1000):
            if server.started:
                break
            threading.Event().wait(0.01)
        assert server.started, "the local HTTP server did not start within 10 s"
        jobs = [qos_load.Job(at, qos, "/v1/completions", {"prompt": "hi"})
                for at, qos in ((0.0, "premium"), (0.1, "batch"), (0.2, "premium"), (0.3, "batch"))]
        outcomes, _, _ = asyncio.run(qos_load.open_loop(
            f"http://127.0.0.1:{sock.getsockname()[1]}", jobs, window_s=0.4, grace_s=5.0))
    finally:
        server.should_exit = True
        thread.join(10)
    assert [o.error for o in outcomes] == ["HTTP 429"] * 4
    assert len(peers) == 4 and len(set(peers)) == 2


def test_a_premium_rate_of_its_own_leaves_the_other_classes_arrivals_as_they_were():
    from loadtests.workload import TenantsInfo

    info = TenantsInfo()
    mixed = qos_load.poisson_jobs(20.0, 60.0, 3, info)
    sparse = qos_load.poisson_jobs(20.0, 60.0, 3, info, premium_rate=0.5)
    others = [(j.at_s, j.qos) for j in mixed if j.qos != "premium"]
    assert [(j.at_s, j.qos) for j in sparse if j.qos != "premium"] == others
    premium = [j.at_s for j in sparse if j.qos == "premium"]
    assert 15 <= len(premium) <= 50                          # 0.5/s over 60 s: 30 expected
    assert [j.at_s for j in sparse] == sorted(j.at_s for j in sparse)
    only = qos_load.poisson_jobs(20.0, 60.0, 3, info, "premium", premium_rate=0.5)
    assert [j.at_s for j in only] == premium


def test_the_benchmarks_tenants_copy_lifts_limits_and_sets_premiums_step_target(tmp_path):
    """``qos.py --premium-step-target-ms`` reaches the deployed (lifted) tenants file, which
    still validates; without it premium keeps tenants.yaml's default (half its SLO)."""
    from benchmarks.qos import lifted_tenants, parse_args
    from kvharbor.tenants.loader import load_tenants_file

    args = parse_args(["--premium-step-target-ms", "30"])
    shorter = load_tenants_file(lifted_tenants(tmp_path, None, 100, args.premium_step_target_ms))
    assert shorter.qos_classes["premium"].step_target_ms == 30
    assert all(c.max_queue == 100 for c in shorter.qos_classes.values())
    (tmp_path / "default").mkdir()
    default = load_tenants_file(lifted_tenants(tmp_path / "default"))
    assert default.qos_classes["premium"].step_target_ms is None
    assert parse_args([]).premium_step_target_ms is None
