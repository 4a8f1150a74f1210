"""The cluster kvharbor starts listens on loopback only: its HTTP entry point, and every port
of Ray's processes (GCS, raylet, workers, agents) and of Serve's replicas.

Ray 2.60 turns ``--node-ip-address=127.0.0.1`` into the host's address and then binds its
servers on all interfaces; ``kvharbor.platform.loopback`` keeps them on loopback.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
import yaml

from kvharbor.platform import loopback
from tests.conftest import listeners_off_loopback

ROOT = Path(__file__).resolve().parents[2]


def listening_addresses(port: int) -> set[str]:
    """Local addresses of every TCP socket listening on ``port`` on this machine."""
    return {c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_http_entry_point_listens_on_loopback_only(kvharbor_app):
    addresses = listening_addresses(urlparse(kvharbor_app.base_url).port)
    assert addresses, "nothing listens on the app's port"
    assert all(map(loopback.is_loopback, addresses)), f"the HTTP entry point listens on {sorted(addresses)}"


def test_the_serve_config_binds_http_to_loopback():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    assert config["applications"][0]["import_path"] == "kvharbor:build_app"


def test_the_cluster_registers_and_listens_on_loopback_only(kvharbor_app):
    """With the app deployed (gateways, the premium lane, LLM replicas, directory, admission
    and queue actors): the node's address is 127.0.0.1 and no process of the cluster listens
    on another address (before, Ray registered the host's address and its GCS, raylet,
    workers and Serve's per-replica gRPC servers listened on every interface)."""
    import ray

    assert [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]] == ["127.0.0.1"]
    assert listeners_off_loopback(os.getpid()) == []


@pytest.mark.parametrize("node, bound", [("127.0.0.1", "127.0.0.1:0"), ("10.1.2.3", "[::]:0")],
                         ids=["loopback-node", "routable-node"])
def test_serves_grpc_server_binds_the_node_address_only_on_a_loopback_node(monkeypatch, node, bound):
    """Serve's inter-deployment gRPC server (``[::]:0`` in Serve's code) binds 127.0.0.1 on a
    loopback node; on a routable one other nodes call in, so it is left as Serve has it."""
    from ray.serve._private import replica as serve_replica

    calls = []
    monkeypatch.setattr(serve_replica, "add_port_to_grpc_server",
                        lambda server, address: calls.append(address) or 1234)
    loopback.serve_grpc_on_node_address(node)
    wrapped = serve_replica.add_port_to_grpc_server
    loopback.serve_grpc_on_node_address(node)              # twice: wrapped once
    assert serve_replica.add_port_to_grpc_server is wrapped
    assert serve_replica.add_port_to_grpc_server(object(), "[::]:0") == 1234
    assert calls == [bound]


@pytest.mark.parametrize("address, expected", [("127.0.0.1", True), ("::1", True),
                                               ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
                                               ("::", False), ("192.0.2.2", False)])
def test_is_loopback(address, expected):
    assert loopback.is_loopback(address) is expected


@pytest.mark.parametrize("address, changed", [(None, True), ("127.0.0.1:6379", True),
                                              ("10.1.2.3:6379", False), ("[::1]:6379", True),
                                              ("localhost:6379", True), ("head-node:6379", False),
                                              ("ray://10.1.2.3:10001", False),
                                              ("ray://127.0.0.1:10001", True), ("local", True)],
                         ids=["starts-a-cluster", "joins-a-loopback-one", "joins-a-routable-one",
                              "ipv6-loopback", "localhost", "host-name", "ray-client",
                              "ray-client-loopback", "local"])
def test_on_loopback_leaves_a_routable_cluster_to_ray(monkeypatch, address, changed):
    """Joining a running cluster on a routable address (a multi-node one, named by
    RAY_ADDRESS or left by ``ray start``): Ray's switch is left alone, else this driver would
    call its node 127.0.0.1 and Ray would find no such node to join ("No node info found
    matching attributes: '127.0.0.1'", seen with ``ray start --head`` then ``serve run``)."""
    from ray._private import ray_constants

    if address is None:
        monkeypatch.setattr(loopback, "running_cluster_address", lambda: None)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)    # Ray's default on Linux
    before = ray_constants.ENABLE_RAY_CLUSTER
    with loopback.on_loopback() as ip:
        assert ip == "127.0.0.1"
        assert ray_constants.ENABLE_RAY_CLUSTER is (not changed and before)
        assert (os.environ.get(loopback.LOOPBACK_VAR) == "0") is changed
    assert ray_constants.ENABLE_RAY_CLUSTER is before


def test_a_cluster_ray_cannot_find_means_a_new_one_starts(monkeypatch):
    """Ray's lookup raises when ``RAY_ADDRESS=auto`` finds no cluster: ``ray.init`` would fail
    or start one, and the cluster is not a routable one to leave alone."""
    from ray._private import services

    def lookup(*args):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(services, "get_ray_address_from_environment", lookup)
    assert loopback.running_cluster_address() is None and not loopback.joins_routable_cluster()


def test_serve_run_joins_a_running_cluster_with_serves_port_on_the_apps(monkeypatch):
    """``ray start`` then ``serve run kvharbor.app``: the cluster keeps the ingress it was
    started with (Serve's proxy unless its flags were set there), so Serve's HTTP port must
    be the app's. It was a free port (kvharbor's direct-ingress default, which only a cluster
    kvharbor starts has): nothing answered on 8000. No port check either: an app already
    deployed there may hold it (a redeploy)."""
    from types import SimpleNamespace

    from kvharbor.platform import app

    calls = []                       # stand-ins for app.py's Ray and Serve (not Ray's modules)
    monkeypatch.setattr(app, "ray", SimpleNamespace(is_initialized=lambda: False,
                                                    init=lambda **kw: calls.append(("init", kw))))
    monkeypatch.setattr(app, "serve", SimpleNamespace(start=lambda **kw: calls.append(("serve.start", kw))))
    monkeypatch.setattr(app, "check_port_free", lambda port: calls.append(("check", port)))
    monkeypatch.setattr(app, "running_cluster_address", lambda: "127.0.0.1:6379")
    assert app._init_ray_on_loopback(None, "direct") is None
    assert [name for name, _ in calls] == ["init", "serve.start"]
    assert calls[1][1]["http_options"] == {"host": "127.0.0.1", "port": app.HTTP_PORT}
