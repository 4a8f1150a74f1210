"""Sessions over HTTP: X-Session-ID on both generation routes, DELETE /v1/sessions/{id}, errors."""

from __future__ import annotations

import time
import uuid

import pytest

from kvharbor.engine.hashing import hash_prompt_blocks, model_root
from kvharbor.engine.model_identity import model_identity
from tests.conftest import DEMO, TEST_KEYS

ROOT = model_root(model_identity("kvharbor/tiny-llama"))   # the test app's model
SYSTEM = {"role": "system", "content": "You are terse."}


def _chat(client, model, messages, session_id=None, max_tokens=24):
    headers = {"X-Session-ID": session_id} if session_id else {}
    r = client.post("/v1/chat/completions", headers=headers, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


def test_turn_two_reuses_turn_one_and_delete_ends_the_session(kvharbor_app):
    sid = f"chat-{uuid.uuid4().hex[:8]}"
    model = kvharbor_app.model
    with kvharbor_app.client(DEMO["standard"]) as c:
        messages = [SYSTEM, {"role": "user", "content": f"Tell me about ships {sid}."}]
        first = _chat(c, model, messages, sid)
        assert first.headers["x-session-id"] == sid
        one = first.json()
        history = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
        messages += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And the tides?"}]
        two = _chat(c, model, messages, sid).json()
        # prompt and output of turn 1, every full block (the last sampled token is never computed)
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= (history - 1) // 16 * 16
        assert two["kvharbor"]["replica_id"] == one["kvharbor"]["replica_id"]
        # another tenant cannot end it (sessions belong to a tenant) ...
        with kvharbor_app.client(TEST_KEYS["private2"]) as other:
            r = other.delete(f"/v1/sessions/{sid}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        # ... its owner can, once
        r = c.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 200, r.text
        assert r.json()["deleted"] is True and r.json()["blocks_released"] >= (history - 1) // 16
        r = c.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 404 and "no session" in r.json()["error"]["message"]


def test_completions_take_the_header_too(kvharbor_app):
    sid = f"cmpl-{uuid.uuid4().hex[:8]}"
    with kvharbor_app.client(DEMO["batch"]) as c:
        prompt = list(range(40, 140))
        r = c.post("/v1/completions", headers={"X-Session-ID": sid}, json={
            "model": kvharbor_app.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200 and r.headers["x-session-id"] == sid
        info = kvharbor_app.replica_call("stats")
        assert sum(s["sessions_active"] for s in info.values()) >= 1
        assert c.delete(f"/v1/sessions/{sid}").status_code == 200


def test_a_session_takes_one_prompt_not_a_batch(kvharbor_app):
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.post("/v1/completions", headers={"X-Session-ID": "batch-1"}, json={
            "model": kvharbor_app.model, "prompt": ["one", "two"], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "one prompt" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"


def test_a_128_character_session_id_is_accepted(kvharbor_app):
    sid = "a" * 128                                    # the longest id; 129 is refused below
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.post("/v1/chat/completions", headers={"X-Session-ID": sid}, json={
            "model": kvharbor_app.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-session-id"] == sid, r.text
        assert c.delete(f"/v1/sessions/{sid}").status_code == 200


def test_two_session_headers_are_a_400(kvharbor_app):
    """Two X-Session-ID headers name two conversations: the request is refused, not served
    under either."""
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.post("/v1/chat/completions", headers=[("X-Session-ID", "one"), ("X-Session-ID", "two")],
                   json={"model": kvharbor_app.model, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_session_id" and "not 2" in err["message"]


@pytest.mark.parametrize("value", ["", "has space", "x" * 129, "-leading-dash", "a/b"])
def test_bad_session_header_is_a_400_json(kvharbor_app, value):
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.post("/v1/chat/completions", headers={"X-Session-ID": value}, json={
            "model": kvharbor_app.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_session_id" and err["param"] == "X-Session-ID"


def test_bad_session_id_in_delete_path_is_a_400_and_needs_a_key(kvharbor_app):
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.delete("/v1/sessions/" + "x" * 200)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"
    with kvharbor_app.client("not-a-key") as c:
        r = c.delete("/v1/sessions/abc")
        assert r.status_code == 401 and "error" in r.json()


def test_fork_starts_a_new_session_from_the_cached_state(kvharbor_app):
    sid, new = f"f-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    model = kvharbor_app.model
    with kvharbor_app.client(DEMO["standard"]) as c:
        messages = [SYSTEM, {"role": "user", "content": f"Fork me {sid}."}]
        one = _chat(c, model, messages, sid).json()
        r = c.post(f"/v1/sessions/{sid}/fork", json={"session_id": new})
        assert r.status_code == 200, r.text
        assert r.json()["forked_from"] == sid and r.json()["blocks"] > 0
        assert c.delete(f"/v1/sessions/{sid}").status_code == 200      # the fork keeps the blocks
        time.sleep(1.5)      # the replicas' routing stats (0.5 s period) list the new session
        history = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
        messages += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Go on."}]
        two = _chat(c, model, messages, new).json()
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= (history - 1) // 16 * 16
        assert c.post(f"/v1/sessions/{sid}/fork", json={"session_id": "x1"}).status_code == 404
        again = c.post(f"/v1/sessions/{new}/fork", json={"session_id": new})
        assert again.status_code == 409 and again.json()["error"]["code"] == "session_exists"
        bad = c.post(f"/v1/sessions/{new}/fork", json={"session_id": "no spaces"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_session_id"
        assert c.delete(f"/v1/sessions/{new}").status_code == 200


def test_admin_flush_makes_the_next_identical_request_cold_everywhere(kvharbor_app):
    body = {"model": kvharbor_app.model, "prompt": list(range(60, 160)), "max_tokens": 2,
            "temperature": 0}
    blocks = hash_prompt_blocks(body["prompt"], 16, "group:partners", parent=ROOT)    # globex's scope
    hashes = set(blocks)
    with kvharbor_app.client(DEMO["standard"]) as c:
        c.post("/v1/completions", json=body)
        kvharbor_app.wait_indexed(blocks)        # either gateway's router finds it
        warm = c.post("/v1/completions", json=body).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
        assert c.post("/admin/cache/flush").status_code == 403
    with kvharbor_app.client(DEMO["admin"]) as admin:
        r = admin.post("/admin/cache/flush")
        assert r.status_code == 200, r.text
        assert r.json()["replicas"] == 2 and r.json()["device_blocks"] >= 6
    for info in kvharbor_app.replica_call("check_integrity").values():   # asserts invariants too
        assert not hashes & set(info["cached"])
    with kvharbor_app.client(DEMO["standard"]) as c:
        cold = c.post("/v1/completions", json=body).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _completion_cached(kvharbor_app, key, body) -> int:
    with kvharbor_app.client(key) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_admin_flush_with_a_tenant_or_scope_filter_drops_only_that_scope(kvharbor_app):
    body = {"model": kvharbor_app.model, "prompt": list(range(70, 170)), "max_tokens": 2,
            "temperature": 0}
    partners, private = DEMO["standard"], TEST_KEYS["private2"]     # globex: shared:partners
    for key in (partners, private, partners, private):
        _completion_cached(kvharbor_app, key, body)
    assert _completion_cached(kvharbor_app, private, body) >= 96
    with kvharbor_app.client(DEMO["admin"]) as admin:
        for bad, status in (({"tenant": "private2", "scope": "public"}, 400), ({"tenant": "nobody"}, 404),
                            ({"scope": "shared:nobody"}, 404), ({"scope": "team"}, 400)):
            r = admin.post("/admin/cache/flush", json=bad)
            assert r.status_code == status and "error" in r.json(), (bad, r.text)
        r = admin.post("/admin/cache/flush", json={"tenant": "private2"})
        assert r.status_code == 200 and r.json()["tenant"] == "private2", r.text
        assert r.json()["device_blocks"] >= 6
    assert _completion_cached(kvharbor_app, partners, body) >= 96         # other scope: warm
    assert _completion_cached(kvharbor_app, private, body) == 0           # flushed: cold
    with kvharbor_app.client(DEMO["admin"]) as admin:
        r = admin.post("/admin/cache/flush", json={"scope": "shared:partners"})
        assert r.status_code == 200 and r.json()["scope"] == "shared:partners", r.text
    partner_hashes = set(hash_prompt_blocks(body["prompt"], 16, "group:partners", parent=ROOT))
    for info in kvharbor_app.replica_call("check_integrity").values():
        assert not partner_hashes & set(info["cached"])
    assert _completion_cached(kvharbor_app, partners, body) == 0
