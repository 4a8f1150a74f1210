"""The Serve application: ``serve run kvharbor.app`` or ``serve run kvharbor:build_app k=v ...``.

    Gateway (FastAPI ingress) ──handle──▶ LLMReplica x N  (KVAwareRouter picks one)
    PremiumGateway (premium_port) ─handle─┘      └─ KV events ─▶ PrefixDirectory actor
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import httpx

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvharbor.actors.prefix_directory import get_or_create_directory
from kvharbor.actors.replica import LLMReplica
from kvharbor.config import EngineConfig, PlatformConfig
from kvharbor.engine.model_info import model_context_length, sampling_defaults
from kvharbor.platform import premium_lane
from kvharbor.platform.gateway import Gateway, PremiumGateway
from kvharbor.platform.ingress import check_port_free, http_options, requested_mode, starting_cluster
from kvharbor.platform.loopback import on_loopback, running_cluster_address
from kvharbor.tenants import default_tenants_path, load_tenants_file

logger = logging.getLogger("kvharbor")

METRICS_PORT = int(os.environ.get("KVHARBOR_METRICS_PORT", "8080"))
HTTP_PORT = int(os.environ.get("KVHARBOR_HTTP_PORT", "8000"))
ROUTERS = {"kv": "kvharbor.platform.router:KVAwareRouter",
           "round_robin": "kvharbor.platform.router:RoundRobinRouter", "pow2": None,
           "ray_prefix": "kvharbor.platform.ray_prefix_router:RayPrefixRouter"}


INGRESS_NAMES = {"haproxy": "HAProxy to the gateway replicas", "proxy": "Serve's proxy",
                 "direct": "the gateway replica itself"}


def _init_ray_on_loopback(overload_lag_ms: float | None, mode: str) -> str | None:
    """Start a local Ray bound to 127.0.0.1 when nothing started one (``serve run``), with
    ingress ``mode`` (``kvharbor.platform.ingress``: ``direct``, the gateway itself; ``proxy``,
    Serve's proxy; ``haproxy``) and HTTP on 127.0.0.1:``KVHARBOR_HTTP_PORT`` (8000). With
    HAProxy, Serve's own default host is every interface; kvharbor keeps it on loopback.
    Serve's proxy gets the gateways' overload lag target (``overload_lag_ms``; None: no guard
    there either). Returns the ingress, or None when Ray was already running.

    A cluster already running (``ray start``, or ``RAY_ADDRESS``) is joined as it was started:
    its ingress is what its environment set (Serve's proxy unless the flags were set there),
    so Serve's HTTP port is ``KVHARBOR_HTTP_PORT``; returns None then too."""
    if ray.is_initialized():
        return None
    if running_cluster_address() is not None:
        with on_loopback() as node_ip:          # a loopback cluster is joined on 127.0.0.1
            ray.init(namespace="serve", _node_ip_address=node_ip, log_to_driver=True)
        serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
        return None
    check_port_free(HTTP_PORT)                  # before a cluster starts that cannot serve it
    with starting_cluster(mode, overload_lag_ms=overload_lag_ms, port=HTTP_PORT) as mode:
        ray.init(namespace="serve", include_dashboard=False, _node_ip_address="127.0.0.1",
                 _metrics_export_port=METRICS_PORT, log_to_driver=True)
    serve.start(http_options=http_options(mode, HTTP_PORT))
    logger.info("kvharbor: HTTP on 127.0.0.1:%d through %s", HTTP_PORT, INGRESS_NAMES[mode])
    if mode == "haproxy":
        logger.warning("kvharbor: through HAProxy, a non-streaming request whose client gives up "
                       "may run to max_tokens (HAProxy misses the close when the request's body "
                       "came in its own TCP segment; see scripts/haproxy_client_abort.py). "
                       "Streaming requests are aborted.")
    return mode


def ingress_for(gateway_replicas: int) -> str:
    """The ingress a cluster started here runs: ``KVHARBOR_INGRESS``, else ``direct`` for one
    gateway replica (nothing between the client and the gateway) and Serve's proxy for more
    (it balances over them).

    Raises:
        ValueError: ``direct`` asked for with more than one gateway replica.
    """
    mode = requested_mode(default="direct" if gateway_replicas == 1 else "proxy")
    if mode == "direct" and gateway_replicas != 1:
        raise ValueError(f"KVHARBOR_INGRESS=direct serves one gateway replica on the port, and "
                         f"gateway_replicas is {gateway_replicas}: set it to 1, or use "
                         "KVHARBOR_INGRESS=haproxy (or proxy) to balance over several")
    return mode


def _gpus() -> int:
    """The GPUs of the Ray cluster, as Ray detected them when its nodes started: each replica
    asks Ray for ``num_gpus=1``, so Ray's count is the one placement goes by (torch's count
    would see only this node's, and importing torch here costs seconds before Ray starts)."""
    return int(ray.cluster_resources().get("GPU", 0))


def engine_kwargs(cfg: PlatformConfig, on_gpu: bool) -> dict:
    """The ``EngineConfig`` fields every replica gets: each field the two configs share, with
    the device resolved to 'cuda' or 'cpu'."""
    shared = [name for name in PlatformConfig.model_fields if name in EngineConfig.model_fields]
    engine = {name: getattr(cfg, name) for name in shared}
    engine["device"] = "cuda" if on_gpu else "cpu"
    return engine


def build_app(args: dict | None = None):
    """Build the kvharbor application from ``PlatformConfig`` fields (strings are parsed)."""
    cfg = PlatformConfig(**(args or {}))
    defaults = sampling_defaults(cfg.model, cfg.generation_config, cfg.override_generation_config)
    if cfg.max_model_len and cfg.max_model_len > (context := model_context_length(cfg.model)):
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's context of {context} "
                         "tokens; lower it or leave it unset (the model's)")
    _init_ray_on_loopback(cfg.overload_lag_ms, ingress_for(cfg.gateway_replicas))
    tenants = Path(cfg.tenants) if cfg.tenants else default_tenants_path()
    load_tenants_file(tenants)                          # fail fast, with file/line/field
    tenants = str(tenants.resolve())
    replica = llm_replicas(cfg, tenants)
    config = {"model": cfg.model, "chat_template": cfg.chat_template, "lora_modules": cfg.lora_modules,
              "sampling_defaults": defaults, "max_model_len": cfg.max_model_len,
              "served_model_name": cfg.served_model_name,
              "tool_call_parser": cfg.tool_call_parser if cfg.enable_auto_tool_choice else None,
              "reasoning_parser": cfg.reasoning_parser,
              "tenants": tenants, "block_size": cfg.block_size,
              "max_body_bytes": cfg.max_body_bytes, "overload_lag_ms": cfg.overload_lag_ms,
              "premium_port": cfg.premium_port, "direct_streams": cfg.uses_direct_streams,
              "main_gateway_nice": cfg.main_gateway_nice}
    lane = None
    if cfg.premium_port is not None:           # a gateway of its own for pinned classes
        lane = serve.deployment(PremiumGateway).options(
            name=premium_lane.DEPLOYMENT, num_replicas=1, max_ongoing_requests=1024,
            ray_actor_options={"num_cpus": 0.25}).bind(
                replica, {**config, "lane_host": premium_lane.lane_host()})
    gateway = serve.deployment(Gateway).options(
        name="Gateway", num_replicas=cfg.gateway_replicas, max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": 0.25})
    return gateway.bind(replica, config, lane)


def llm_replicas(cfg: PlatformConfig, tenants: str):
    """The ``LLMReplica`` deployment of ``cfg``, bound: its engine, its request router and its
    size (a fixed ``replicas``, or Serve's autoscaling with kvharbor's policy). Creates the
    prefix directory actor when it does not exist; Ray must be running."""
    gpus = _gpus() if cfg.device in ("auto", "cuda") else 0
    if cfg.device == "cuda" and not gpus:
        raise ValueError("device='cuda' but the Ray cluster has no GPUs (ray.cluster_resources()); "
                         "use device='cpu', or 'auto' to take GPUs when there are some")
    on_gpu = gpus > 0 and cfg.device != "cpu"
    engine = engine_kwargs(cfg, on_gpu)
    get_or_create_directory(cfg.directory_name, namespace="kvharbor", detached=True)
    router_class = ROUTERS[cfg.router]          # PlatformConfig's pattern admits only these
    scaling = ({"autoscaling_config": cfg.autoscaling} if cfg.autoscaling else
               {"num_replicas": cfg.replicas or (gpus if on_gpu else 2)})
    options = {"name": "LLMReplica", **scaling, "max_ongoing_requests": 512,
               "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
               "ray_actor_options": {"num_gpus": 1} if on_gpu else {"num_cpus": cfg.replica_cpus}}
    if router_class is not None:
        kwargs = {"directory_name": cfg.directory_name, "directory_namespace": "kvharbor"} \
            if cfg.router == "kv" else {}
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class, request_router_kwargs=kwargs,
            request_routing_stats_period_s=0.5)
    return serve.deployment(LLMReplica).options(**options).bind(
        engine, tenants, cfg.directory_name, None if on_gpu else cfg.cpu_threads,
        0 if on_gpu else cfg.cpu_replica_nice, cfg.uses_direct_streams)


def __getattr__(name: str):
    """``kvharbor.app``: the default application, built on first access."""
    if name == "app":
        return build_app({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wait_until_healthy(base_url: str, timeout_s: float = 240.0) -> None:
    """Block until ``base_url``/healthz answers 200 (the gateway and its replicas are up).

    Raises:
        TimeoutError: no healthy answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"kvharbor at {base_url} did not become healthy in {timeout_s:.0f} s")
