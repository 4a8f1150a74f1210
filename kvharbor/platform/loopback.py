"""Keep a local Ray cluster on 127.0.0.1: its node address, and every port its processes open.

``ray.init(_node_ip_address="127.0.0.1")`` alone does not do it (Ray 2.60 here): Ray turns a
loopback node address into the host's routable one (``services.resolve_ip_for_localhost``),
so the cluster registers itself on the host's address (192.0.2.2 on these machines), its
processes talk to each other through it, and the GCS, the raylet, every worker's gRPC server
and the metrics agent listen on every interface. Ray keeps a loopback node address only
where it believes multi-node clusters are unsupported: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
set to 0 (its default off Linux). Then every process of the cluster listens on 127.0.0.1.

``on_loopback`` sets that variable for the processes Ray starts (they inherit this process's
environment) and, for the ``ray.init`` that starts the cluster in this process, the module
constant Ray read from it when it was imported (``serve run`` imports Ray before any
kvharbor code runs). Both are put back on exit; the driver keeps the node address it got.
``kvharbor.platform.ingress.starting_cluster`` enters it, so ``serve run kvharbor.app``, the
test session and the benchmarks start their clusters on loopback. When ``ray.init`` would
instead join a running cluster (``RAY_ADDRESS``, or one ``ray start`` started on this host)
on a routable address, a multi-node cluster, ``on_loopback`` changes nothing: with the
switch at 0 this driver would call its own node 127.0.0.1 and Ray would find no node of
that address to join.

Another process that connects to such a cluster without ``on_loopback``
(``ray.init(address="auto")``, ``serve run serve_config.yaml``) needs
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in its environment; without it Ray looks for the
cluster on the host's address and times out.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterator

LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch: 0 keeps a loopback node address (and with it every listening port) local."""

NODE_IP = "127.0.0.1"


@contextlib.contextmanager
def on_loopback() -> Iterator[str]:
    """``with on_loopback() as ip: ray.init(_node_ip_address=ip, ...)`` starts a cluster
    whose node address is ``ip`` (127.0.0.1) and whose processes listen on loopback only."""
    from ray._private import ray_constants  # noqa: PLC0415 - Ray's own copy of the switch

    if joins_routable_cluster():
        yield NODE_IP                    # Ray turns it into this host's address, as it should
        return
    saved_env, saved_flag = os.environ.get(LOOPBACK_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield NODE_IP
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOOPBACK_VAR, None)
        else:
            os.environ[LOOPBACK_VAR] = saved_env


def running_cluster_address() -> str | None:
    """The cluster ``ray.init()`` here would join: the one ``RAY_ADDRESS`` names, else the
    last one ``ray start`` started on this host (Ray's own lookup,
    ``services.get_ray_address_from_environment``); None when it would start one."""
    from ray._private import services  # noqa: PLC0415

    try:
        address = services.get_ray_address_from_environment(None, None)
    except Exception:  # noqa: BLE001 - nothing found to join: a new cluster starts
        return None
    return None if not address or address in ("auto", "local") else address


def joins_routable_cluster() -> bool:
    """Whether ``ray.init()`` here would join a running cluster on a routable address."""
    address = running_cluster_address()
    if address is None:
        return False
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    try:
        return not is_loopback(host)
    except ValueError:                   # a host name
        return host != "localhost"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP, IPv4-mapped IPv6 included) is on the loopback network."""
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def serve_grpc_on_node_address(node: str | None = None) -> None:
    """In a Serve replica on a loopback node: Serve's inter-deployment gRPC server listens
    on the node's address, not on every interface.

    Ray Serve 2.60 starts that server in every replica with the address ``[::]:0`` fixed in
    its code (``ray.serve._private.replica``), whatever the node's address. On a node whose
    address is loopback nothing off this host may call it, so the replica's copy of the
    helper that binds it is wrapped to bind the node's address instead. Call it from the
    deployment's ``__init__`` (Serve starts the server right after). Elsewhere (a node on a
    routable address: other nodes call in) it does nothing.

    Args:
        node: the node's address; None: this process's Ray node (nothing without Ray).
    """
    import ray  # noqa: PLC0415
    from ray.serve._private import replica as serve_replica  # noqa: PLC0415

    if node is None:
        if not ray.is_initialized():
            return
        node = ray.util.get_node_ip_address()
    bind = serve_replica.add_port_to_grpc_server
    if not is_loopback(node) or getattr(bind, "kvharbor_node", None) == node:
        return

    def on_node_address(server, address: str) -> int:
        if address.startswith("[::]:"):
            address = f"{node}:{address.removeprefix('[::]:')}"
        return bind(server, address)

    on_node_address.kvharbor_node = node
    serve_replica.add_port_to_grpc_server = on_node_address
