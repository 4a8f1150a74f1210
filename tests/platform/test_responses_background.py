"""Background responses (``background: true``): answered at once as queued, run by the gateway,
read back with GET until done: the same answer as in the foreground, continued with
previous_response_id; cancelled by any gateway replica, never overwritten by the run's answer;
lost runners and failures end ``failed``; bad combinations are 400s. Also a stored response's
input items (``GET /v1/responses/{id}/input_items``), served by the same router."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from kvharbor.engine.model_info import load_tokenizer
from kvharbor.platform.response_store import RUNNING, STALE_S, ResponseStore
from tests.conftest import DEMO, TEST_KEYS, until_final

FINAL = ("completed", "incomplete", "failed", "cancelled")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _response(rid: str, status: str) -> dict:
    return {"id": rid, "object": "response", "status": status, "background": True, "output": []}


def test_the_store_runs_cancels_finishes_and_declares_lost_runners():
    clock = Clock()
    store = ResponseStore(clock=clock)
    store.put("acme", _response("resp_a", "queued"), [{"role": "user", "content": "hi"}])
    assert store.beat("acme", "resp_a") == "in_progress" and store.beat("globex", "resp_a") is None
    assert store.get("acme", "resp_a")[0]["status"] == "in_progress"
    assert store.cancel("globex", "resp_a") is None                      # another tenant's: not found
    assert store.cancel("acme", "resp_a")["status"] == "cancelled"
    assert store.beat("acme", "resp_a") == "cancelled"                   # the runner learns it
    assert store.finish("acme", _response("resp_a", "completed"), []) is False
    assert store.get("acme", "resp_a")[0]["status"] == "cancelled"       # the answer did not overwrite it

    store.put("acme", _response("resp_b", "queued"), [])
    assert store.finish("acme", {**_response("resp_b", "completed"), "output": ["x"]}, ["h"])
    assert store.get("acme", "resp_b") == ({**_response("resp_b", "completed"), "output": ["x"]}, ["h"])
    assert store.cancel("acme", "resp_b")["status"] == "completed"       # a finished one stays

    store.put("acme", _response("resp_c", "queued"), [])
    clock.now += STALE_S - 1
    assert store.get("acme", "resp_c")[0]["status"] == "queued"
    clock.now += 2
    lost = store.get("acme", "resp_c")[0]
    assert lost["status"] == "failed" and lost["error"]["code"] == "runner_lost"
    assert store.beat("acme", "resp_c") is None                          # a late runner is told so


def _books_balance(store: ResponseStore) -> None:
    """``used`` is the kept entries' sizes, and only kept running responses have a heartbeat
    (an evicted, deleted, cancelled or lost one leaves none behind: memory stays bounded)."""
    assert store.used == sum(entry[3] for entry in store._entries.values()) <= store.max_bytes
    assert all(store._entries[rid][1]["status"] in RUNNING for rid in store._beats)


def test_a_runner_that_keeps_reporting_is_never_declared_lost():
    clock = Clock()
    store = ResponseStore(clock=clock)
    store.put("acme", _response("resp_long", "queued"), [])
    for _ in range(3):                                   # a 90 s run, one report a STALE_S - 1
        clock.now += STALE_S - 1
        assert store.beat("acme", "resp_long") == "in_progress"
    clock.now += STALE_S - 1
    assert store.get("acme", "resp_long")[0]["status"] == "in_progress"
    clock.now += 2                                       # now it stopped reporting
    assert store.get("acme", "resp_long")[0]["status"] == "failed"
    _books_balance(store)


def test_the_stores_books_balance_through_every_way_an_entry_ends():
    clock = Clock()
    store = ResponseStore(max_bytes=1000, clock=clock)
    store.put("acme", _response("r_again", "completed"), [{"content": "x" * 100}])
    store.put("acme", _response("r_again", "completed"), [])          # stored again: one entry
    assert len(store) == 1
    _books_balance(store)
    for rid in ("r_cancel", "r_delete", "r_lost", "r_evict"):
        store.put("acme", _response(rid, "queued"), [])
    assert store.cancel("acme", "r_cancel")["status"] == "cancelled"
    assert store.delete("acme", "r_delete")
    clock.now += STALE_S + 1
    assert store.get("acme", "r_lost")[0]["status"] == "failed"
    _books_balance(store)
    store.put("acme", {"id": "big", "text": "x" * 700}, [])           # evicts the oldest
    assert store.get("acme", "r_again") is None
    _books_balance(store)


def test_an_entry_that_fits_exactly_is_kept_with_the_others():
    one = len('{"id": "a"}') + len("[]") * 2                         # 15 bytes
    store = ResponseStore(max_bytes=3 * one)
    for rid in "abc":
        assert store.put("acme", {"id": rid}, [])
    assert len(store) == 3 and store.used == store.max_bytes          # full, none evicted
    exact = ResponseStore(max_bytes=one)
    assert exact.put("acme", {"id": "a"}, []) and exact.get("acme", "a") is not None


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def _done(client, rid: str, timeout_s: float = 120.0):
    return until_final(lambda: client.responses.retrieve(rid), FINAL, timeout_s, 0.1)


def test_a_background_response_is_the_foreground_answer_read_back_later(client, kvharbor_app):
    ask = {"model": kvharbor_app.model, "input": "Name three rivers.", "max_output_tokens": 8, "temperature": 0}
    queued = client.responses.create(**ask, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background is True and not queued.output
    done = _done(client, queued.id)
    foreground = client.responses.create(**ask, store=False)
    assert done.status == foreground.status and done.id == queued.id and done.background
    assert done.output_text == foreground.output_text and done.usage.output_tokens == foreground.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(done.id).data] == ["Name three rivers."]
    follow = client.responses.create(model=kvharbor_app.model, input="And a lake?", max_output_tokens=4,
                                     previous_response_id=done.id, store=False)
    assert follow.usage.input_tokens > foreground.usage.input_tokens      # the stored conversation was used


def test_a_cancel_stops_a_running_response_and_stays(client, kvharbor_app):
    eos = load_tokenizer(kvharbor_app.model).eos_token_id
    queued = client.responses.create(model=kvharbor_app.model, input="Count.", max_output_tokens=1500,
                                     background=True, extra_body={"logit_bias": {str(eos): -100}})
    time.sleep(0.5)
    with httpx.Client(base_url=kvharbor_app.base_url, headers={"Authorization": f"Bearer {DEMO['standard']}"}) as http:
        assert http.post(f"/v1/responses/{queued.id}/cancel").status_code == 200    # any gateway replica
        other = httpx.post(f"{kvharbor_app.base_url}/v1/responses/{queued.id}/cancel",
                           headers={"Authorization": f"Bearer {DEMO['premium']}"})
    assert other.status_code == 404
    assert client.responses.cancel(queued.id).status == "cancelled"      # idempotent
    time.sleep(2.5)                                                      # past the runner's next report
    assert client.responses.retrieve(queued.id).status == "cancelled"


def test_a_cancelled_run_gives_back_what_it_held(kvharbor_app):
    """The run stops, not only its record: a tenant allowed 2 requests at once that cancels its 2
    long background responses is served again within a few seconds (their generations of
    4,000 tokens would hold both places for far longer)."""
    two = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=TEST_KEYS["two_at_once"], max_retries=0)
    eos = load_tokenizer(kvharbor_app.model).eos_token_id
    runs = [two.responses.create(model=kvharbor_app.model, input=f"Count {i}.", max_output_tokens=4000,
                                 background=True, extra_body={"logit_bias": {str(eos): -100}}) for i in range(2)]
    time.sleep(1.0)
    with pytest.raises(openai.RateLimitError):                            # both places are taken
        two.responses.create(model=kvharbor_app.model, input="hi", max_output_tokens=2, store=False)
    assert [two.responses.cancel(r.id).status for r in runs] == ["cancelled", "cancelled"]
    deadline, served = time.monotonic() + 6.0, None
    while served is None and time.monotonic() < deadline:
        try:
            served = two.responses.create(model=kvharbor_app.model, input="hi", max_output_tokens=2, store=False)
        except openai.RateLimitError:
            time.sleep(0.25)
    assert served is not None and served.usage.output_tokens == 2


def test_a_foreground_response_cannot_be_cancelled(client, kvharbor_app):
    done = client.responses.create(model=kvharbor_app.model, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(done.id)
    assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_what_would_have_been_an_error_ends_the_response_failed(kvharbor_app):
    """The tenant's max_tokens_per_request (32) is checked after tokenizing: in the background the
    response ends failed with the foreground's 400 message, in this API's names."""
    capped = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=TEST_KEYS["capped"], max_retries=0)
    queued = capped.responses.create(model=kvharbor_app.model, input="hi", max_output_tokens=100, background=True)
    failed = _done(capped, queued.id)
    assert failed.status == "failed" and failed.error is not None, failed
    assert "max_output_tokens=100" in failed.error.message, failed.error


@pytest.mark.parametrize("extra", [{"store": False}, {"stream": True}])
def test_background_needs_store_and_no_stream(kvharbor_app, extra):
    with kvharbor_app.client(DEMO["standard"]) as http:
        r = http.post("/v1/responses", json={"model": kvharbor_app.model, "input": "hi", "background": True, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text


def test_the_store_pages_a_responses_input_items():
    store = ResponseStore()
    items = [{"id": f"msg_{i}", "type": "message"} for i in range(5)]
    store.put("acme", _response("resp_i", "completed"), [], items)
    assert store.input_items("acme", "resp_i", None, 2, "asc") == (items[:2], True)
    assert store.input_items("acme", "resp_i", "msg_1", 10, "asc") == (items[2:], False)
    assert store.input_items("acme", "resp_i", None, 2, "desc") == ([items[4], items[3]], True)
    assert store.input_items("acme", "resp_i", "msg_3", 2, "desc") == ([items[2], items[1]], True)
    assert store.input_items("globex", "resp_i", None, 2, "asc") is None
    store.put("acme", _response("resp_i", "completed"), [], items[:1])    # stored again: its own items
    assert store.input_items("acme", "resp_i", None, 10, "asc") == (items[:1], False)
    assert store.delete("acme", "resp_i") and store.input_items("acme", "resp_i", None, 2, "asc") is None


def test_a_stored_responses_input_items_are_listed_as_sent(client, kvharbor_app):
    sent = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Another?"}], "id": "msg_mine"}]
    done = client.responses.create(model=kvharbor_app.model, input=sent, max_output_tokens=2)
    listed = client.responses.input_items.list(done.id, order="asc")
    assert [(i.role, i.content[0].type, i.content[0].text) for i in listed.data] == [
        ("user", "input_text", "Name a colour."), ("assistant", "output_text", "Blue."),
        ("user", "input_text", "Another?")]
    assert listed.data[2].id == "msg_mine" and all(i.id for i in listed.data) and not listed.has_more
    newest_first = client.responses.input_items.list(done.id, limit=2)
    assert [i.id for i in newest_first.data] == [listed.data[2].id, listed.data[1].id] and newest_first.has_more
    rest = client.responses.input_items.list(done.id, limit=2, after=newest_first.data[-1].id)
    assert [i.id for i in rest.data] == [listed.data[0].id] and not rest.has_more
    plain = client.responses.create(model=kvharbor_app.model, input="hi", max_output_tokens=2)
    assert [(i.role, i.content[0].text) for i in client.responses.input_items.list(plain.id).data] == [("user", "hi")]
    other = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["premium"], max_retries=0)
    unstored = client.responses.create(model=kvharbor_app.model, input="hi", max_output_tokens=2, store=False)
    for reader, rid in ((other, done.id), (client, unstored.id)):
        with pytest.raises(openai.NotFoundError):
            reader.responses.input_items.list(rid)
