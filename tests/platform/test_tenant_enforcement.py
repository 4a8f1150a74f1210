"""tenants.yaml rules as HTTP clients see them: 401/403/429, limits across 2 gateways,
hot reload under traffic, invalid reloads, pinned prefixes, /admin visibility."""

from __future__ import annotations

import json
import threading
import time

import httpx

import yaml

from tests.conftest import DEMO, TEST_KEYS
from tests.reliability.helpers import edited_tenants, wait_tenants_applied


def _post(app, key: str, prompt: str = "hi", max_tokens: int = 2, **extra) -> httpx.Response:
    with app.client(key) as c:
        return c.post("/v1/completions", json={"model": app.model, "prompt": prompt,
                                                "max_tokens": max_tokens, **extra})


def _seconds(duration: str) -> float:
    """OpenAI's ``20ms`` / ``1.3s`` / ``6m0s`` / ``1h2m5s`` in seconds."""
    if duration.endswith("ms"):
        return float(duration[:-2]) / 1000
    total, number = 0.0, ""
    for ch in duration:
        if ch in "hms":
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
        else:
            number += ch
    return total


def _wait_until(predicate, timeout: float = 20.0, interval: float = 0.3):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def _usage(app, tenant: str) -> dict:
    """``tenant``'s usage on ``/admin/tenants``; a counter not reported yet (a tenant not seen
    yet has none) reads 0."""
    seen = httpx.get(app.base_url + "/admin/tenants", headers={"Authorization": f"Bearer {DEMO['admin']}"},
                     timeout=30).json()["tenants"][tenant]["usage"]
    return {"in_flight": 0, "granted_idle_slots": 0, "admitted_total": 0, "admitted_fast_lane": 0,
            "tokens_today": 0, **seen}


def test_expired_and_unknown_keys_are_401(kvharbor_app):
    r = _post(kvharbor_app, TEST_KEYS["expired"])
    assert r.status_code == 401 and r.json()["error"]["code"] == "expired_api_key"
    assert "expired" in r.json()["error"]["message"]
    assert TEST_KEYS["expired"] not in r.text


def test_model_not_allowed_is_403(kvharbor_app):
    r = _post(kvharbor_app, TEST_KEYS["restricted"])
    assert r.status_code == 403
    assert "may not use model" in r.json()["error"]["message"]


def test_rate_limit_holds_across_two_gateway_replicas(kvharbor_app):
    """Six of ten requests pass, whichever gateway each reaches, and every answer says so in
    OpenAI's headers: the limit, and what is left (5, 4, ... 0 after the sixth) and when it is
    full again, as the admission service counted it."""
    statuses, retry_after, answers = [], [], []
    for _ in range(10):                       # requests_per_minute: 6, shared by both gateways
        r = _post(kvharbor_app, TEST_KEYS["limited_once"], max_tokens=1)
        statuses.append(r.status_code)
        answers.append(r.headers)
        if r.status_code == 429:
            retry_after.append((int(r.headers["retry-after"]), int(r.headers["retry-after-ms"])))
    assert statuses.count(200) == 6, statuses
    assert statuses.count(429) == 4
    assert all(h["x-ratelimit-limit-requests"] == "6" and h["x-ratelimit-limit-tokens"] == "200000"
               for h in answers), answers
    assert [h["x-ratelimit-remaining-requests"] for h in answers[:6]] == ["5", "4", "3", "2", "1", "0"], answers
    resets = [_seconds(h["x-ratelimit-reset-requests"]) for h in answers[:6]]     # 10 s per request used
    assert all(abs(r - 10 * (i + 1)) < 1.5 for i, r in enumerate(resets)), resets
    assert all(199_900 < int(h["x-ratelimit-remaining-tokens"]) < 200_000 for h in answers[:6]), answers
    refused_by_service = [h for h in answers[6:] if "x-ratelimit-remaining-requests" in h]
    assert refused_by_service and all(h["x-ratelimit-remaining-requests"] == "0" for h in refused_by_service)
    # the next request unit comes in 10 s (6 a minute): whole seconds rounded up, and the ms
    assert all(1 <= s <= 10 and (s - 1) * 1000 < ms <= s * 1000 for s, ms in retry_after), retry_after
    # a refused request gave its class-queue place back: nothing of the class is left in flight
    status = httpx.get(kvharbor_app.base_url + "/admin/tenants/status",
                       headers={"Authorization": f"Bearer {DEMO['admin']}"}).json()
    assert status["in_flight_by_qos"].get("standard", 0) == 0, status["in_flight_by_qos"]


def test_a_reload_that_raises_a_limit_ends_the_refusals_at_once(kvharbor_app):
    """A gateway remembers a requests_per_minute refusal until its Retry-After, but only
    under the tenants file that refused: raising the limit serves the tenant right away."""
    def limit(rpm):
        return lambda doc: doc["tenants"]["limited"].__setitem__("requests_per_minute", rpm)

    with edited_tenants(kvharbor_app, limit(1)):
        statuses = [_post(kvharbor_app, TEST_KEYS["limited"], max_tokens=1).status_code for _ in range(4)]
        assert statuses.count(429) >= 3, statuses
        with edited_tenants(kvharbor_app, limit(10_000)):
            after = [_post(kvharbor_app, TEST_KEYS["limited"], max_tokens=1).status_code for _ in range(8)]
    assert after == [200] * 8, after


def test_max_tokens_per_request_is_400(kvharbor_app):
    r = _post(kvharbor_app, TEST_KEYS["capped"], max_tokens=100)     # its cap is 32
    assert r.status_code == 400
    assert "32" in r.json()["error"]["message"]
    assert _post(kvharbor_app, TEST_KEYS["capped"], max_tokens=32).status_code == 200


def test_a_request_reserves_max_tokens_for_each_of_its_n_choices(kvharbor_app):
    """tokens_per_minute is 300: one or two choices of 64 tokens fit it, eight (512 tokens)
    never will, and the 400 says what the request needs."""
    r = _post(kvharbor_app, TEST_KEYS["metered"], max_tokens=64, n=8)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "8 choices x max_tokens 64" in message and "tokens_per_minute is 300" in message, message
    ok = _post(kvharbor_app, TEST_KEYS["metered"], max_tokens=64, n=2)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
    batch = _post(kvharbor_app, TEST_KEYS["metered"], prompt=["a", "b", "c", "d"], max_tokens=64, n=2)
    assert batch.status_code == 400, batch.text            # 4 prompts x 2 choices: 8 x 64 tokens
    assert "8 choices x max_tokens 64" in batch.json()["error"]["message"], batch.text


def test_hot_reload_under_traffic_fails_nothing(kvharbor_app):
    path = kvharbor_app.tenants_path
    original = path.read_text()
    results: list[int] = []
    stop = threading.Event()

    def traffic():
        with kvharbor_app.client(DEMO["standard"]) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": "steady",
                                                    "max_tokens": 6, "ignore_eos": True})
                results.append(r.status_code)

    workers = [threading.Thread(target=traffic) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        time.sleep(2)
        data = yaml.safe_load(original)
        data["tenants"]["newcomer"] = {"qos": "batch", "keys": [{"hash": _hash("kvh-test-newcomer")}]}
        edited = yaml.safe_dump(data, sort_keys=False)
        path.write_text(edited)
        wait_tenants_applied(kvharbor_app, edited)          # by both gateways
        assert _post(kvharbor_app, "kvh-test-newcomer").status_code == 200
        time.sleep(2)
    finally:
        stop.set()
        for w in workers:
            w.join()
        path.write_text(original)
        wait_tenants_applied(kvharbor_app, original)
    assert len(results) >= 6
    assert set(results) == {200}, results


def test_invalid_reload_is_rejected_and_old_config_keeps_serving(kvharbor_app):
    path = kvharbor_app.tenants_path
    original = path.read_text()
    admin = {"Authorization": f"Bearer {DEMO['admin']}"}
    try:
        path.write_text(original.replace("priority: 100", "priority: high", 1))
        status = _wait_until(lambda: (s := httpx.get(kvharbor_app.base_url + "/admin/tenants/status",
                                                     headers=admin).json()).get("last_error") and s)
        assert "priority" in status["last_error"]
        assert _post(kvharbor_app, DEMO["premium"]).status_code == 200
    finally:
        path.write_text(original)
    _wait_until(lambda: httpx.get(kvharbor_app.base_url + "/admin/tenants/status",
                                  headers=admin).json()["last_error"] is None)


def test_admin_sees_all_tenants_and_a_tenant_only_itself(kvharbor_app):
    _post(kvharbor_app, DEMO["batch"])
    admin = httpx.get(kvharbor_app.base_url + "/admin/tenants",
                      headers={"Authorization": f"Bearer {DEMO['admin']}"}).json()
    assert {"acme", "globex", "initech"} <= set(admin["tenants"])
    mine = httpx.get(kvharbor_app.base_url + "/admin/tenants",
                     headers={"Authorization": f"Bearer {DEMO['batch']}"}).json()
    assert list(mine["tenants"]) == ["initech"]
    assert "usage" in mine["tenants"]["initech"]
    r = httpx.get(kvharbor_app.base_url + "/admin/tenants/status",
                  headers={"Authorization": f"Bearer {DEMO['batch']}"})
    assert r.status_code == 403
    assert httpx.get(kvharbor_app.base_url + "/admin/tenants").status_code == 401
    # the status lists every class of the tenants file, idle ones at 0
    status = httpx.get(kvharbor_app.base_url + "/admin/tenants/status",
                       headers={"Authorization": f"Bearer {DEMO['admin']}"}).json()
    classes = yaml.safe_load(open(kvharbor_app.tenants_path))["qos_classes"]
    assert set(status["in_flight_by_qos"]) >= set(classes), status["in_flight_by_qos"]


def test_premium_requests_take_the_fast_lane_and_are_accounted(kvharbor_app):
    """Through both gateways: premium requests are admitted from the gateways' grants (no
    admission call), the admission actor still counts every one, and once the tenant goes
    quiet every granted slot is back (in_flight and granted_idle_slots 0)."""
    def usage() -> dict:
        return _usage(kvharbor_app, "acme")

    before = _wait_until(lambda: (u := usage())["in_flight"] == 0 and u)
    for i in range(12):
        r = _post(kvharbor_app, DEMO["premium"], prompt=f"fast lane {i}", max_tokens=1)
        assert r.status_code == 200, r.text
    after = _wait_until(lambda: (u := usage())["in_flight"] == u["granted_idle_slots"] == 0
                        and u["admitted_total"] == before["admitted_total"] + 12 and u)
    fast = after["admitted_fast_lane"] - before["admitted_fast_lane"]
    assert 6 <= fast <= 12, (before, after)      # the first request per gateway takes the calls


def test_pinned_system_prompt_survives_a_flood(kvharbor_app):
    import random

    config = yaml.safe_load(kvharbor_app.tenants_path.read_text())
    system = config["tenants"]["acme"]["pinned_prefixes"][0]
    rng = random.Random(7)
    with kvharbor_app.client(DEMO["standard"]) as c:          # ~2,500 blocks of other traffic
        for i in range(40):
            text = "".join(chr(rng.randrange(97, 123)) for _ in range(1000))
            assert c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": text,
                                                   "max_tokens": 1}).status_code == 200
    with kvharbor_app.client(DEMO["premium"]) as c:
        for question in ("Where is my order?", "Cancel my plan"):
            r = c.post("/v1/chat/completions", json={
                "model": kvharbor_app.model, "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
            assert r.status_code == 200
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            pinned_tokens = (len(system.encode()) + len("<|system|>\n\n")) // 16 * 16
            assert cached >= pinned_tokens, (cached, pinned_tokens)


def _hash(key: str) -> str:
    from kvharbor.tenants import hash_key

    return hash_key(key)


def test_a_tenants_tokens_today_are_the_tokens_its_responses_report(kvharbor_app):
    """The daily budget charges what was used: once a tenant's requests are done (and its
    gateways' grants are back), ``tokens_today`` grew by exactly the prompt and completion
    tokens the responses reported, streamed or not, n > 1 included."""
    def usage() -> dict:
        return _usage(kvharbor_app, "globex")

    before = _wait_until(lambda: (u := usage())["in_flight"] == u["granted_idle_slots"] == 0 and u)
    used = 0
    for i, extra in enumerate([{}, {"n": 2}, {"stream": True, "stream_options": {"include_usage": True}}]):
        r = _post(kvharbor_app, DEMO["standard"], prompt=f"count the tokens of request {i}",
                  max_tokens=5 + i, ignore_eos=True, **extra)
        assert r.status_code == 200, r.text
        if extra.get("stream"):
            chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
            reported = json.loads(chunks[-1])["usage"]
        else:
            reported = r.json()["usage"]
        assert reported["completion_tokens"] == (5 + i) * extra.get("n", 1)
        used += reported["total_tokens"]
    _wait_until(lambda: (u := usage())["in_flight"] == u["granted_idle_slots"] == 0
                and u["tokens_today"] == before["tokens_today"] + used, timeout=30)
