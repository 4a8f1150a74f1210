"""``/healthz`` says whether an LLM replica can serve: with direct ingress (the default app)
the gateway serves HTTP before the replicas finish loading, and it used to answer 200 "ok"
while a request sent then waited tens of seconds for a replica."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx

from kvharbor.platform import gateway
from kvharbor.platform.health import RunningReplicas

GatewayClass = gateway.Gateway.__bases__[0]          # the class serve.ingress wrapped


def _status(running: int) -> SimpleNamespace:
    deployment = SimpleNamespace(replica_states={"RUNNING": running} if running else {"STARTING": 2})
    return SimpleNamespace(applications={"app": SimpleNamespace(deployments={"LLMReplica": deployment})})


def _gateway() -> object:
    """A gateway with just what ``healthz`` reads (no Ray, no tenants file)."""
    gw = object.__new__(GatewayClass)
    gw._watcher = object()                            # the tenants watcher counts as started
    gw.registry = SimpleNamespace(version=1, sha256="0" * 64)
    gw.config, gw.model = {}, "kvharbor/tiny-llama"
    gw.llm = SimpleNamespace(app_name="app", deployment_name="LLMReplica")
    gw.llm_replicas = RunningReplicas(gw.llm)
    return gw


def _health(gw) -> tuple[int, dict]:
    response = asyncio.run(gw.healthz())
    return response.status_code, json.loads(response.body)


def test_no_running_llm_replica_is_a_503_that_says_why(monkeypatch):
    monkeypatch.setattr(gateway.serve, "status", lambda: _status(0))
    code, body = _health(_gateway())
    assert code == 503
    assert body["status"] == "unavailable" and body["llm_replicas"] == 0
    assert "no LLM replica is running" in body["detail"]


def test_a_running_replica_is_ok_and_serve_is_asked_at_most_every_ttl(monkeypatch):
    calls = []
    monkeypatch.setattr(gateway.serve, "status", lambda: calls.append(1) or _status(2))
    gw = _gateway()
    answers = [_health(gw) for _ in range(3)]
    for code, body in answers:
        assert code == 200 and body["status"] == "ok" and body["llm_replicas"] == 2
    assert len(calls) == 1                            # the next two answers came from the cache


def test_health_follows_the_replicas_once_its_cached_count_is_older_than_the_ttl(monkeypatch):
    """Starting, then running: a gateway that first saw no replica reports them once its
    cached count is ``ttl_s`` old (and is 503 until then)."""
    running = [0]
    monkeypatch.setattr(gateway.serve, "status", lambda: _status(running[0]))
    gw = _gateway()
    gw.llm_replicas.ttl_s = 0.05
    assert _health(gw)[0] == 503
    running[0] = 2
    assert _health(gw)[0] == 503                      # within the ttl: the cached 0
    time.sleep(0.06)
    code, body = _health(gw)
    assert code == 200 and body["llm_replicas"] == 2


def test_health_does_not_flap_when_serve_cannot_say(monkeypatch):
    def down():
        raise ConnectionError("controller restarting")

    monkeypatch.setattr(gateway.serve, "status", down)
    code, body = _health(_gateway())
    assert code == 200 and body["status"] == "ok" and body["llm_replicas"] is None


def test_the_running_app_reports_its_replicas(kvharbor_app):
    health = httpx.get(kvharbor_app.base_url + "/healthz", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["llm_replicas"] == 2
