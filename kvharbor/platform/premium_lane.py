"""The premium lane: a gateway process of its own, on a port of its own, for pinned classes.

Under a flood every request of every tenant crosses the gateway's one event loop: HTTP
parsing, the overload guard's 429s, tokenizing, the router, and one loop turn per streamed
chunk on the way out. Premium requests are admitted first by the class queue and scheduled
first by the engine, yet their bytes still wait in that loop behind everyone else's
(``docs/benchmarks.md``: under a 2x flood, 21 ms p50 and ~165 ms over the slowest 10 % from
the client's send to the gateway's first line, and as much again in the router and Ray hops
back).

``build_app(premium_port=P)`` adds a second deployment with the gateway's routes,
``PremiumGateway`` (one replica, its own process), that serves the same API on ``host:P``
(``KVHARBOR_PREMIUM_HOST`` where ``build_app`` runs, loopback by default) besides Serve's
ingress on the app's port. Serve allows one FastAPI ingress per app, so the lane is a plain
deployment that runs its own HTTP server.
Its loop, its router (with its own prefix index, fed by the same KV events) and its fast-lane
grants see only the pinned classes' traffic, so a premium request there never queues behind a
flood's bytes. The engines are shared: the replicas still schedule premium first and keep
its pinned KV region, whichever port a request came in by.

On the lane a generation request of a class that is not pinned is refused before its body is
read (403 ``wrong_endpoint``): the lane stays as idle as its tenants
keep it. Every other route (models, sessions, admin) answers as on the main port, and a
premium tenant may still use the main port (it keeps its priority there, only not the
lane's loop).

The server is uvicorn on the replica's own event loop (as Serve runs its direct ingress),
without uvicorn's signal handlers: the Ray worker keeps its own. Serve's health check
restarts a lane whose server stopped.

Measured (``benchmarks/qos.py --premium-lane lane|main``, 2x flood, four ABBA pairs on a 2-core
VM, ``docs/benchmarks.md``): premium p99 TTFT 273-377 ms through the lane against 440-808 ms
through the main port; the wait before the gateway and on the way back fell from 110-133 to
7-30 ms over the slowest 10 %. What is left is mostly inside the replicas, which the lane
shares with the flood, and the main port's gateway competes with both for the cores (the
process that takes the most CPU under a flood). So with a lane the main port's gateways run
every thread at nice 19 (``main_gateway_nice``; ``lower_process_priority``): in quick 2x
floods through the lane on a 2-core VM, premium p99 TTFT 131-184 ms against 235-381 ms, at
up to 11 % fewer tokens/s (19 % through the direct ingress; ``docs/benchmarks.md``, 2026-12-06).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from kvharbor.platform.error_body import APIError

logger = logging.getLogger("kvharbor.premium_lane")

DEPLOYMENT = "PremiumGateway"
HOST_VAR = "KVHARBOR_PREMIUM_HOST"
DEFAULT_HOST = "127.0.0.1"


def lane_host() -> str:
    """The address the lane listens on: ``KVHARBOR_PREMIUM_HOST``, else loopback."""
    return os.environ.get(HOST_VAR, "").strip() or DEFAULT_HOST


def check_lane(qos, qos_name: str) -> None:
    """Raise 403 ``wrong_endpoint`` unless class ``qos`` is pinned (the lane serves only those).

    Raises:
        APIError: the class is not pinned.
    """
    if qos.pinned:
        return
    raise APIError(403, f"this port is the premium lane: it serves pinned QoS classes only, and "
                        f"this key's class {qos_name!r} is not pinned; send the request to the "
                        "app's main port", "wrong_endpoint")


def lower_process_priority(nice: int) -> list[int]:
    """Run every thread of this process at OS nice value ``nice`` or lower priority (a thread
    already at a higher nice value keeps it; raising a priority needs a privilege). On Linux a nice
    value belongs to a thread and threads started later inherit their starter's; Ray's worker
    processes start their Python threads at 15 and their C++ threads (RPC, I/O) at 0. The main
    port's gateways call it when the app has a lane (``PlatformConfig.main_gateway_nice``): on
    a host whose cores the flood's request path fills, the lane's gateway and the replicas'
    event loops then get them first. -> the nice values of the threads, as set."""
    if nice <= 0:
        return []
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:                             # no procfs: this thread only
        return [os.nice(max(0, nice - os.nice(0)))]
    done = []
    for tid in tids:
        try:
            value = max(nice, os.getpriority(os.PRIO_PROCESS, tid))
            os.setpriority(os.PRIO_PROCESS, tid, value)
            done.append(value)
        except OSError:                         # the thread ended meanwhile
            continue
    return done


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (IPv4 or IPv6 by ``host``).

    Raises:
        RuntimeError: the address is in use or not local.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"premium lane: cannot listen on {host}:{port} ({e.strerror}); pick "
                           "another premium_port") from e
    return sock


def start_server(app_factory, sock: socket.socket) -> tuple[asyncio.Task, object]:
    """Serve ``app_factory()`` (an ASGI app, built when the server starts) on ``sock`` from the
    running loop. -> (the server's task, the ``uvicorn.Server``)."""
    import uvicorn  # noqa: PLC0415 - Serve's own dependency

    server = uvicorn.Server(uvicorn.Config(app_factory, factory=True, lifespan="off",
                                           access_log=False, log_level=None, log_config=None,
                                           timeout_keep_alive=90))
    server.install_signal_handlers = lambda: None          # the Ray worker keeps its own
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    task.add_done_callback(_report_exit)
    return task, server


def _report_exit(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    if task.exception() is not None:
        logger.error("premium lane server stopped: %r", task.exception())
