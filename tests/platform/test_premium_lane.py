"""The premium lane (``build_app premium_port``): pinned classes get a gateway of their own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kvharbor.platform.error_body import APIError
from kvharbor.platform.premium_lane import check_lane, listening_socket
from kvharbor.tenants.schema import QoSClassConfig
from tests.conftest import DEMO

PROMPT = {"prompt": "The lighthouse keeper counted the ships", "max_tokens": 8, "temperature": 0,
          "ignore_eos": True}


def test_only_pinned_classes_pass_the_lane_check():
    check_lane(QoSClassConfig(priority=100, pinned=True), "premium")
    with pytest.raises(APIError) as err:
        check_lane(QoSClassConfig(priority=50), "standard")
    assert err.value.status == 403 and err.value.code == "wrong_endpoint"
    assert "'standard' is not pinned" in err.value.message


def test_the_lane_serves_premium_the_same_tokens_as_the_main_port(kvharbor_app):
    body = {"model": kvharbor_app.model, **PROMPT}
    with kvharbor_app.client(DEMO["premium"]) as main, kvharbor_app.client(DEMO["premium"], lane=True) as lane:
        on_main = main.post("/v1/completions", json=body)
        on_lane = lane.post("/v1/completions", json=body)
        assert on_main.status_code == 200, on_main.text
        assert on_lane.status_code == 200, on_lane.text
        assert on_lane.json()["choices"][0]["text"] == on_main.json()["choices"][0]["text"]
        assert on_lane.json()["usage"]["completion_tokens"] == 8
        with lane.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]) if c["choices"])
        assert text == on_main.json()["choices"][0]["text"]


@pytest.mark.parametrize("key", [DEMO["standard"], DEMO["batch"]])
def test_the_lane_refuses_other_classes_before_reading_the_body(kvharbor_app, key):
    with kvharbor_app.client(key, lane=True) as lane:
        r = lane.post("/v1/completions", json={"model": kvharbor_app.model, **PROMPT})
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "wrong_endpoint"
        # a body over the size limit: refused for the port (403), not for its size (413)
        big = lane.post("/v1/completions", content=b"x" * (5 * 1024 * 1024),
                        headers={"content-type": "application/json"})
        assert big.status_code == 403 and big.json()["error"]["code"] == "wrong_endpoint"
    with kvharbor_app.client(key) as main:                         # the main port serves them
        assert main.post("/v1/completions", json={"model": kvharbor_app.model, **PROMPT}).status_code == 200


def test_the_lane_answers_the_other_routes_and_says_what_it_is(kvharbor_app):
    with kvharbor_app.client(DEMO["standard"], lane=True) as lane, kvharbor_app.client(DEMO["standard"]) as main:
        assert lane.get("/v1/models").json()["data"][0]["id"] == kvharbor_app.model
        assert lane.post("/v1/completions", json={"model": kvharbor_app.model}).status_code == 403
        on_lane, on_main = lane.get("/healthz").json(), main.get("/healthz").json()
    port = int(kvharbor_app.lane_url.rsplit(":", 1)[1])
    assert on_lane["premium_lane"] is True and on_main["premium_lane"] is False
    assert on_lane["premium_port"] == on_main["premium_port"] == port


def test_the_lane_listens_on_loopback_unless_a_host_is_named(monkeypatch):
    """An empty or blank ``KVHARBOR_PREMIUM_HOST`` (a template left unfilled) is loopback, never
    "" (every interface)."""
    from kvharbor.platform.premium_lane import HOST_VAR, lane_host

    for value in (None, "", "  "):
        if value is None:
            monkeypatch.delenv(HOST_VAR, raising=False)
        else:
            monkeypatch.setenv(HOST_VAR, value)
        assert lane_host() == "127.0.0.1"
    monkeypatch.setenv(HOST_VAR, " ::1 ")
    assert lane_host() == "::1"


def test_the_lane_binds_an_ipv6_host_and_a_busy_port_fails_its_start_by_name():
    """``::1`` (as ``KVHARBOR_PREMIUM_HOST`` may name) gets an IPv6 socket; a port another
    server listens on fails the lane's start with the address and what to change."""
    taken = listening_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port} .*another premium_port"):
            listening_socket("127.0.0.1", port)
    finally:
        taken.close()
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this host has no IPv6 loopback")
    v6 = listening_socket("::1", 0)
    assert v6.family == socket.AF_INET6
    v6.close()


def _thread_nices(title: str) -> dict[int, list[int]]:
    """pid -> the nice value of each of its threads, for the processes whose title is ``title``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            first = open(f"/proc/{pid}/cmdline").read().split("\0")[0].strip()
            if first != title and not first.startswith(title + "."):     # ".method" while busy
                continue
            nices = [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:                                  # the process or a thread ended
            continue
        found[int(pid)] = nices
    return found


def test_the_main_port_gateways_run_below_the_lane(kvharbor_app):
    """With a lane, every thread of the main port's gateways runs at nice 19 (``main_gateway_nice``),
    so the flood's request path leaves the cores to premium's; the lane's keep Ray's values."""
    main = _thread_nices("ray::ServeReplica:kvharbor:Gateway")
    lane = _thread_nices("ray::ServeReplica:kvharbor:PremiumGateway")
    assert len(main) == 2 and len(lane) == 1, (main, lane)
    (lane_nices,) = lane.values()
    assert min(lane_nices) < 19                          # Ray's own: 15 and 0
    for nices in main.values():
        assert set(nices) == {19}, nices


def test_lower_process_priority_lowers_every_thread_of_the_process_only():
    code = """
import os, threading
from kvharbor.platform.premium_lane import lower_process_priority
started, stop = threading.Event(), threading.Event()
def other():
    started.set(); stop.wait()
t = threading.Thread(target=other); t.start(); started.wait()
os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 7)       # one thread above the target
print(sorted(lower_process_priority(5)), lower_process_priority(0))
print(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.getpriority(os.PRIO_PROCESS, t.native_id))
late = []
t2 = threading.Thread(target=lambda: late.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
t2.start(); t2.join(); print(late[0])
stop.set(); t.join()
"""
    assert os.getpriority(os.PRIO_PROCESS, 0) < 5
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[5, 7] []"                       # each thread at 5 at least; 0: nothing
    assert out[1] == "7 5"
    assert out[2] == "7"                                # a later thread inherits its starter's
    assert os.getpriority(os.PRIO_PROCESS, 0) < 5       # this process is untouched
