"""The exported metrics equal what the responses and the engines say (scraped by Prometheus).

A known mix goes through HTTP for tenants used only here (``truth-*``): requests that finish
ok (repeated prompts, so some prompt tokens come from the prefix cache), streamed ones, one
the client drops after its first chunk (aborted), 400s refused before admission, and 429s
from a tenant limited to 2 requests per minute. Prometheus must then report, per tenant:
finished requests by status = the responses' outcomes, 429s by limit = the 429 responses,
prompt / cached / generated tokens = the sums of the responses' ``usage``; and, per replica,
the KV block gauges = ``LLMReplica.stats()`` once the replicas are idle.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvharbor.tenants.keys import hash_key
from tests.reliability.helpers import edited_tenants, rand_text, replica_stats, wait_idle

pytestmark = pytest.mark.slow

KEYS = {"truth-a": "kvh-truth-a-key-for-tests", "truth-b": "kvh-truth-b-key-for-tests",
        "truth-lim": "kvh-truth-lim-key-for-tests", "truth-drop": "kvh-truth-drop-key-for-tests"}


def _add_tenants(doc) -> None:
    for name, key in KEYS.items():
        doc["tenants"][name] = {"keys": [{"hash": hash_key(key)}], "qos": "standard",
                                "cache_scope": "private",
                                "requests_per_minute": 2 if name == "truth-lim" else None}


class Tally:
    """What the HTTP responses said, per tenant."""

    def __init__(self) -> None:
        self.status: dict[tuple[str, str], int] = {}
        self.tokens: dict[tuple[str, str], int] = {}

    def add(self, tenant: str, status: str, usage: dict | None = None) -> None:
        self.status[tenant, status] = self.status.get((tenant, status), 0) + 1
        if usage:
            for name, value in (("prompt", usage["prompt_tokens"]), ("generated", usage["completion_tokens"]),
                                ("cached", usage["prompt_tokens_details"]["cached_tokens"])):
                self.tokens[tenant, name] = self.tokens.get((tenant, name), 0) + value


def _post(app, tenant: str, body: dict) -> httpx.Response:
    return httpx.post(app.base_url + "/v1/completions", json={"model": app.model, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def _streamed_usage(app, tenant: str, body: dict) -> dict:
    with httpx.stream("POST", app.base_url + "/v1/completions", timeout=120,
                      json={"model": app.model, "stream": True, "stream_options": {"include_usage": True}, **body},
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


def _drop_after_first_chunk(app, tenant: str) -> None:
    with httpx.stream("POST", app.base_url + "/v1/completions", timeout=120,
                      json={"model": app.model, "prompt": rand_text(40, 99), "max_tokens": 2000,
                            "ignore_eos": True, "stream": True},
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())


def _drive(app) -> Tally:
    tally = Tally()
    shared = rand_text(200, 7)                     # 200 tokens: 12 full blocks, cached after the first
    for tenant in ("truth-a", "truth-b"):
        for i in range(3):
            r = _post(app, tenant, {"prompt": shared + rand_text(5, i), "max_tokens": 4 + i, "ignore_eos": True})
            assert r.status_code == 200, r.text
            tally.add(tenant, "ok", r.json()["usage"])
        tally.add(tenant, "ok", _streamed_usage(app, tenant, {"prompt": shared, "max_tokens": 3, "ignore_eos": True}))
        assert _post(app, tenant, {"prompt": "x", "max_tokens": 5000}).status_code == 400
        assert _post(app, tenant, {"prompt": "x", "frequency_penalty": 3}).status_code == 400
    _drop_after_first_chunk(app, "truth-drop")      # its tokens were used but no usage was sent
    tally.add("truth-drop", "aborted")
    for i in range(5):
        r = _post(app, "truth-lim", {"prompt": rand_text(10, 50 + i), "max_tokens": 2})
        tally.add("truth-lim", "ok" if r.status_code == 200 else f"http{r.status_code}",
                  r.json()["usage"] if r.status_code == 200 else None)
    assert tally.status["truth-lim", "ok"] == 2 and tally.status["truth-lim", "http429"] == 3, tally.status
    assert tally.tokens["truth-a", "cached"] > 0
    return tally


def _by(prometheus, expr: str, *labels: str) -> dict[tuple, float]:
    return {tuple(s["metric"].get(label, "") for label in labels): float(s["value"][1])
            for s in prometheus.query(expr)}


def _wait_equal(read, want, timeout_s: float = 45.0):
    """Poll ``read()`` until it equals ``want``; a 0 in ``want`` is a series that may not exist
    (a Ray counter exports nothing until its first increment)."""
    want = {k: v for k, v in want.items() if v != 0}
    deadline = time.monotonic() + timeout_s
    got = {k: v for k, v in read().items() if v != 0}
    while got != want and time.monotonic() < deadline:
        time.sleep(1.0)
        got = {k: v for k, v in read().items() if v != 0}
    assert got == want, (got, want)


def test_exported_counts_tokens_and_blocks_equal_the_responses_and_engines(kvharbor_app, prometheus):
    with edited_tenants(kvharbor_app, _add_tenants):
        tally = _drive(kvharbor_app)
    sel = '{tenant=~"truth-.*"}'
    want_status = {(t, s): float(n) for (t, s), n in tally.status.items() if not s.startswith("http")}
    _wait_equal(lambda: _by(prometheus, f"sum by (tenant, status) (ray_kvharbor_requests_total{sel})",
                            "tenant", "status"), want_status)
    _wait_equal(lambda: _by(prometheus, f"sum by (tenant, reason) (ray_kvharbor_rate_limited_total{sel})",
                            "tenant", "reason"), {("truth-lim", "requests_per_minute"): 3.0})
    want_tokens = {(t, n): float(v) for (t, n), v in tally.tokens.items()}
    for name in ("prompt", "cached", "generated"):
        metric = {"prompt": "prompt_tokens", "cached": "cached_prompt_tokens", "generated": "generated_tokens"}[name]
        want = {k: v for k, v in want_tokens.items() if k[1] == name}
        expr = f'sum by (tenant) (ray_kvharbor_{metric}_total{{tenant=~"truth-(a|b|lim)"}})'
        _wait_equal(lambda: {(t, name): v for (t,), v in _by(prometheus, expr, "tenant").items()}, want)
    wait_idle(kvharbor_app)
    stats = {s["replica_id"]: s for s in replica_stats(kvharbor_app)}
    want_blocks = {}
    for rid, s in stats.items():
        want_blocks[rid, "used"] = float(s["shared_blocks_used"])
        want_blocks[rid, "free+cached"] = float(s["shared_blocks_free"])

    def read_blocks():
        got = _by(prometheus, 'sum by (replica, state) (ray_kvharbor_kv_blocks{region="shared"})', "replica", "state")
        out = {}
        for (rid, state), v in got.items():
            if rid in stats:
                key = (rid, "used") if state == "used" else (rid, "free+cached") if state in ("free", "cached") else None
                if key:
                    out[key] = out.get(key, 0.0) + v
        return out
    _wait_equal(read_blocks, want_blocks)
