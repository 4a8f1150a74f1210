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
    loopback.serve_grpc_on_node_address(node)              # twice: wrapped once
    assert serve_replica.add_port_to_grpc_server(object(), "[::]:0") == 1234
    assert calls == [bound]


@pytest.mark.parametrize("address, expected", [("127.0.0.1", True), ("::1", True),
                                               ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
                                               ("::", False), ("192.0.2.2", False)])
def test_is_loopback(address, expected):
    assert loopback.is_loopback(address) is expected
