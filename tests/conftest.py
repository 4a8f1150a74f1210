"""Shared fixtures. One local Ray cluster per test session, bound to loopback, started lazily."""

from __future__ import annotations

import os
import time

import pytest

from kvharbor.platform.ingress import free_port

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
# Serve kills a proxy that is not ready in 5 s; on 2 busy cores starting one can take longer.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")



RAY_METRICS_PORT = int(os.environ.get("KVHARBOR_TEST_METRICS_PORT") or free_port())
INGRESS: list[str] = []        # the HTTP ingress this session's cluster was started with


def until_final(retrieve, final: tuple[str, ...], timeout_s: float, every_s: float):
    """Call ``retrieve()`` every ``every_s`` until its answer's ``status`` is in ``final`` or
    ``timeout_s`` passed; the last answer (a batch or background response being polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = retrieve()
        if answer.status in final or time.monotonic() > deadline:
            return answer
        time.sleep(every_s)


def listeners_off_loopback(root_pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP port that ``root_pid`` or a process it
    started listens on at an address other than loopback (Ray's processes are its children:
    GCS, raylet, workers, agents, Serve's replicas)."""
    import psutil

    from kvharbor.platform.loopback import is_loopback

    root = psutil.Process(root_pid)
    pids = {root_pid, *(child.pid for child in root.children(recursive=True))}
    return [(conn.laddr.ip, conn.laddr.port, psutil.Process(conn.pid).name())
            for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids
            and not is_loopback(conn.laddr.ip)]


def assert_served_on_loopback_by(port: int, ingress: str) -> None:
    """Only 127.0.0.1 listens on ``port``, and through ``ingress``: an haproxy process for
    ``haproxy``, anything else (Serve's proxy) for ``proxy``."""
    import psutil

    owners = [(conn.laddr.ip, psutil.Process(conn.pid).name()) for conn in psutil.net_connections(kind="tcp")
              if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid]
    assert owners and all(ip == "127.0.0.1" for ip, _ in owners), owners
    assert all(("haproxy" in name) == (ingress == "haproxy") for _, name in owners), owners


class WrongKey(Exception):
    """What a test's ``authenticate`` raises for a key it does not know (the gate's 401)."""
    status, message, code, headers = 401, "invalid API key", "invalid_api_key", None


def prompt_principal(max_tokens_cap: int | None = None, context_overflow: str = "reject"):
    """The part of a ``Principal`` the gateway's prompt checks read (``Prompts``): the
    tenant's ``max_tokens_per_request`` and ``context_overflow``."""
    from types import SimpleNamespace

    return SimpleNamespace(limits=SimpleNamespace(max_tokens_per_request=max_tokens_cap),
                           config=SimpleNamespace(context_overflow=context_overflow))


async def until(condition, timeout_s: float = 5.0, poll_s: float = 0.005) -> None:
    """Yield to the event loop until ``condition()`` holds; fail the test after ``timeout_s``
    rather than hang."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not met within {timeout_s} s"
        await asyncio.sleep(poll_s)


def asgi_post(app, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]]
              ) -> tuple[int, str, dict, int]:
    """POST ``chunks`` as one body to the ASGI ``app``, one ``http.request`` message each,
    as a socket would see it -> (status, response body, response headers, receive calls). A
    receive after the body gets a disconnect."""
    import asyncio

    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
               for i, c in enumerate(chunks)]
    sent: list[dict] = []
    reads = 0

    async def receive():
        nonlocal reads
        reads += 1
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": headers, "http_version": "1.1"}
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body.decode(), dict(sent[0]["headers"]), reads


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster on 127.0.0.1 with its metrics endpoint on ``RAY_METRICS_PORT``."""
    import ray

    if not ray.is_initialized():
        from kvharbor.platform.ingress import starting_cluster

        with starting_cluster() as mode:     # what `serve run kvharbor.app` runs (KVHARBOR_INGRESS)
            INGRESS.append(mode)
            ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                     _metrics_export_port=RAY_METRICS_PORT, log_to_driver=False,
                     runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # noqa: BLE001 - best effort at session end
        pass
    ray.shutdown()


def pytest_configure(config):
    """Triton kernels run in the interpreter when there is no GPU (set before triton loads).
    The CPU C++ kernels are built now, side by side: the test modules' skip marks would build
    them one after another while pytest collects (a fresh checkout: ~100 s instead of ~50)."""
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except ImportError:
        return
    from kvharbor.kernels import build_cpu_kernels

    build_cpu_kernels()


APP_PORT = int(os.environ.get("KVHARBOR_TEST_APP_PORT") or free_port())
LANE_PORT = free_port()        # the session app's premium lane (build_app premium_port)
DEMO = {"premium": "kvh-demo-premium", "standard": "kvh-demo-standard",
        "batch": "kvh-demo-batch", "admin": "kvh-demo-admin"}


TEST_KEYS = {"limited": "kvh-test-limited", "restricted": "kvh-test-restricted",
             "expired": "kvh-test-expired", "private2": "kvh-test-private2",
             "capped": "kvh-test-capped", "truncating": "kvh-test-truncating",
             "metered": "kvh-test-metered", "lora_only": "kvh-test-lora-only",
             "limited_once": "kvh-test-limited-once", "two_at_once": "kvh-test-two-at-once"}
LORA = "tiny-lora"
"""The LoRA adapter the session app serves beside tiny-llama (``write_test_adapter``)."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_test_adapter(path, seed: int = 7) -> str:
    """A PEFT LoRA checkpoint of tiny-llama (r 8, every projection, random A and B) at ``path``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from kvharbor.engine.models import load_model

    model = load_model("kvharbor/tiny-llama", torch.float32, torch.device("cpu")).model
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=LORA_TARGETS)
    get_peft_model(model, config).save_pretrained(str(path))
    return str(path)


def add_test_tenants(path) -> None:
    """Tenants the platform tests need besides the three demo ones."""
    import yaml

    from kvharbor.tenants import hash_key

    data = yaml.safe_load(path.read_text())
    tenants = data["tenants"]
    tenants["limited"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["limited"])}],
                          "requests_per_minute": 6}
    # The same limit for one test alone: it counts exactly 6 of 10, which another test's use of
    # "limited" within the same minute would break (it did, with the files run in another order).
    tenants["limited_once"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["limited_once"])}],
                               "requests_per_minute": 6}
    tenants["restricted"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["restricted"])}],
                             "allowed_models": ["some/other-model"]}
    tenants["expired"] = {"qos": "batch", "keys": [{"hash": hash_key(TEST_KEYS["expired"]),
                                                    "expires": "2020-01-01T00:00:00Z"}]}
    tenants["capped"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["capped"])}],
                         "max_tokens_per_request": 32}
    tenants["metered"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["metered"])}],
                          "tokens_per_minute": 300}
    tenants["truncating"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["truncating"])}],
                             "context_overflow": "truncate_oldest"}
    tenants["private2"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["private2"])}],
                           "cache_scope": "private"}
    tenants["lora_only"] = {"qos": "standard", "keys": [{"hash": hash_key(TEST_KEYS["lora_only"])}],
                            "allowed_models": [LORA]}
    tenants["two_at_once"] = {"qos": "batch", "keys": [{"hash": hash_key(TEST_KEYS["two_at_once"])}],
                              "max_concurrent_requests": 2}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


REPLICA_PREFIX = "SERVE_REPLICA::kvharbor#LLMReplica#"
"""Ray actor name of an LLMReplica replica, before its unique id."""


def live_replica_ids() -> list[str]:
    """Unique ids of the live LLMReplica replicas, from Ray's named actors (a replica still
    starting is listed too).

    (Not ``ray.util.state.list_actors``: it finds the cluster by scanning the host and fails
    when other Ray clusters run beside this one.)
    """
    import ray

    return sorted(a["name"][len(REPLICA_PREFIX):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(REPLICA_PREFIX))


class RunningApp:
    """The kvharbor app deployed once per test session on 127.0.0.1:APP_PORT."""

    def __init__(self, tenants_path, base_url: str, model: str, lane_url: str | None = None,
                 lora_path: str | None = None) -> None:
        self.tenants_path = tenants_path
        self.lora_path = lora_path      # the checkpoint of the LoRA adapter it serves (LORA)
        self.base_url = base_url
        self.lane_url = lane_url        # the premium lane (PremiumGateway), when deployed
        self.model = model

    def client(self, key: str = DEMO["premium"], timeout: float = 120.0, lane: bool = False):
        """An httpx client with ``key``, to the main port or (``lane``) the premium lane."""
        import httpx

        return httpx.Client(base_url=self.lane_url if lane else self.base_url, timeout=timeout,
                            headers={"Authorization": f"Bearer {key}"})

    def replica_handle(self):
        """Serve's cached handle of this process (one router for the session)."""
        from ray import serve

        return serve.get_deployment_handle("LLMReplica", app_name="kvharbor")

    def replica_ids(self) -> list[str]:
        """Unique ids of the running LLMReplica replicas (as the router and directory use them)."""
        return live_replica_ids()

    def replica_call(self, method: str, timeout: float = 60.0, learn_s: float = 15.0) -> dict:
        """``{replica_id: result}`` of ``LLMReplica.<method>(replica_id=id)`` on every live
        replica; a result from another replica is an error.

        The KV-aware router sends a call that names ``replica_id`` to that replica if it knows
        it, and this process's router learns of a new replica (one replacing a killed one)
        through Serve's long poll, a moment after ``serve.status()`` lists it. So a call
        answered by another replica is asked again for up to ``learn_s``.

        (Until 2026-11-27 this process's router sometimes never learned of a replacement:
        two unit tests patched ``ray.is_initialized`` to False for 50 ms, every actor call
        another thread made meanwhile tried ``ray.init()`` and raised, and Serve's shared
        long-poll client in this process died on that error in its next poll. The tests now
        patch ``index_follower.ray_initialized``; this helper no longer works around it with
        fresh handles.)
        """
        out = {}
        handle = self.replica_handle()
        for rid in self.replica_ids():
            deadline = time.monotonic() + learn_s
            while True:
                result = getattr(handle, method).remote(replica_id=rid).result(timeout_s=timeout)
                if result["replica_id"] == rid or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert result["replica_id"] == rid, (
                f"{method} for replica {rid} answered by {result['replica_id']}: this process's "
                f"router did not learn of {rid} within {learn_s} s")
            out[rid] = result
        return out

    def directory(self):
        import ray

        return ray.get_actor("kvharbor-prefix-directory", namespace="kvharbor")

    def flush_caches(self) -> None:
        """Empty every replica's prefix cache (``POST /admin/cache/flush``) and wait until the
        routers have the replicas' new stats (reported every 0.5 s). New prefixes go to the
        emptier cache first, so a test that expects them spread over both replicas needs
        caches alike; earlier tests leave them filled unevenly."""
        with self.client(DEMO["admin"]) as admin:
            r = admin.post("/admin/cache/flush")
            assert r.status_code == 200, r.text
        time.sleep(1.5)

    def wait_indexed(self, block_hashes, timeout: float = 30.0) -> None:
        """Wait until the directory lists every block of ``block_hashes`` on one replica,
        then past a router's idle poll: the index is eventually consistent, so a test that
        needs the next request to hit waits for it instead of guessing a delay. A router
        that routed nothing for a second polls every 0.2 s (``idle_poll_interval_s``), not
        every 20 ms, and the next request may reach the other gateway's router."""
        import ray

        hashes, deadline = list(block_hashes), time.monotonic() + timeout
        while True:
            matches = ray.get(self.directory().match.remote(hashes))
            if any(m.device_blocks >= len(hashes) for m in matches.values()):
                break
            assert time.monotonic() < deadline, f"the directory never indexed {len(hashes)} blocks"
            time.sleep(0.05)
        time.sleep(0.5)


@pytest.fixture(scope="session")
def kvharbor_app(ray_cluster, tmp_path_factory):
    """2 gateways + the premium lane + 2 LLM replicas (tiny-llama and the LoRA adapter LORA, CPU,
    speculative decoding on) + directory, with a writable tenants.yaml."""
    import shutil
    from pathlib import Path

    from ray import serve

    from kvharbor.platform.app import build_app, wait_until_healthy

    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    shutil.copy(Path(__file__).resolve().parent.parent / "tenants.yaml", tenants)
    add_test_tenants(tenants)
    serve.start(http_options={"host": "127.0.0.1", "port": APP_PORT})
    adapter = write_test_adapter(tmp_path_factory.mktemp("lora") / LORA)
    app = build_app({"replicas": 2, "tenants": str(tenants), "num_kv_blocks": 768,
                     "gateway_replicas": 2, "premium_port": LANE_PORT,
                     "lora_modules": {LORA: adapter},
                     # n-gram drafts on every replica: the HTTP tests run through drafted steps
                     "speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'})
    serve.run(app, name="kvharbor", route_prefix="/", blocking=False)
    base, lane = f"http://127.0.0.1:{APP_PORT}", f"http://127.0.0.1:{LANE_PORT}"
    wait_until_healthy(base, timeout_s=240)
    wait_until_healthy(lane, timeout_s=60)
    yield RunningApp(tenants, base, "kvharbor/tiny-llama", lane, adapter)
    serve.delete("kvharbor")
