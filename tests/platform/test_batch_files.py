"""The Files API's expiry and pages, in the store (a clock the tests move) and through the
official OpenAI client: a file goes when its ``expires_at`` passes (an upload's default 30 days,
or its ``expires_after``; a batch's results after its ``output_expires_after``), and
``files.list`` pages by ``after`` / ``limit`` / ``order`` as OpenAI's does."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvharbor.platform.batch_store import BATCH_FILE_TTL_S, BatchStore
from tests.conftest import DEMO
from tests.platform.test_batch_runner import Clock, jsonl, line, new_batch, run
from tests.platform.test_batches_http import MODEL, finished, request, upload


def test_a_file_goes_when_its_expiry_passes_and_frees_its_bytes():
    clock = Clock()
    store = BatchStore(clock=clock)
    kept = store.add_file("acme", "kept.jsonl", "batch", b"12345")
    brief = store.add_file("acme", "brief.jsonl", "batch", b"123", expires_after_s=3600)
    assert brief["expires_at"] == brief["created_at"] + 3600 and kept["expires_at"] is None
    clock.now += 3599
    assert store.content("acme", brief["id"]) == b"123" and store.used == 8
    clock.now += 1
    assert store.content("acme", brief["id"]) is None            # every read forgets expired files
    assert store.file("acme", brief["id"]) is None and store.delete_file("acme", brief["id"]) is False
    assert store.files("acme") == ([kept], False) and store.room() == (5, store.max_bytes)
    later = store.add_file("acme", "later.jsonl", "batch", b"1", expires_after_s=3600)
    clock.now += 3600
    assert store.files("acme") == ([kept], False)
    assert store.used == 5 and store.file("acme", later["id"]) is None


def test_an_expired_file_makes_room_for_an_upload():
    clock = Clock()
    store = BatchStore(max_bytes=10, clock=clock)
    store.add_file("acme", "a.jsonl", "batch", b"123456", expires_after_s=3600)
    assert store.add_file("acme", "b.jsonl", "batch", b"123456") is None
    clock.now += 3600
    assert store.add_file("acme", "b.jsonl", "batch", b"123456") is not None


def test_a_batchs_results_expire_after_its_output_expires_after():
    clock = Clock()
    store = BatchStore(clock=clock)
    content = jsonl(line("a"), line("b"))
    batch = {**new_batch(store, clock, content), "id": "batch_ttl"}
    store.add_batch("acme", batch, output_expires_after_s=7200)

    async def send(url, body):
        return (200, {"choices": [{"text": "ok"}]}, {}) if body["prompt"] == "a" else (400, {"error": {}}, {})

    run(store, batch, content, send, clock)
    out, err = store.file("acme", batch["output_file_id"]), store.file("acme", batch["error_file_id"])
    assert out["expires_at"] == out["created_at"] + 7200 and err["expires_at"] == err["created_at"] + 7200
    clock.now += 7200
    assert store.file("acme", batch["output_file_id"]) is None and store.file("acme", batch["error_file_id"]) is None
    plain = new_batch(store, clock, content)
    run(store, plain, content, send, clock)
    assert store.file("acme", plain["output_file_id"])["expires_at"] is None     # kept until deleted


def test_files_page_newest_first_or_oldest_first():
    clock = Clock()
    store = BatchStore(clock=clock)
    ids = []
    for i in range(5):
        clock.now += 1
        ids.append(store.add_file("acme", f"{i}.jsonl", "batch", b"x")["id"])
    store.add_file("acme", "out.jsonl", "batch_output", b"x")
    store.add_file("initech", "theirs.jsonl", "batch", b"x")
    page, more = store.files("acme", "batch", None, 2)
    assert [m["id"] for m in page] == ids[::-1][:2] and more
    page, more = store.files("acme", "batch", page[-1]["id"], 10)
    assert [m["id"] for m in page] == ids[::-1][2:] and not more
    page, more = store.files("acme", "batch", ids[1], 2, "asc")
    assert [m["id"] for m in page] == ids[2:4] and more
    assert len(store.files("acme")[0]) == 6


# ---- through HTTP ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["premium"], max_retries=0)


def test_an_upload_expires_after_30_days_or_after_what_it_asks(client):
    content = b'{"custom_id": "a"}\n'
    default = client.files.create(file=("d.jsonl", content), purpose="batch")
    assert default.expires_at == default.created_at + BATCH_FILE_TTL_S
    hour = client.files.create(file=("h.jsonl", content), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600
    assert client.files.retrieve(hour.id).expires_at == hour.expires_at


@pytest.mark.parametrize("form, param", [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "expires_after[anchor]"),
    ({"expires_after[seconds]": "3600"}, "expires_after[anchor]"),
    ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
])
def test_an_expiry_kvharbor_cannot_keep_is_a_400_naming_the_field(kvharbor_app, form, param):
    r = httpx.post(kvharbor_app.base_url + "/v1/files", data={"purpose": "batch", **form},
                   files={"file": ("a.jsonl", b"{}\n")}, headers={"Authorization": f"Bearer {DEMO['premium']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_client_pages_through_files_and_a_batch_sets_its_results_expiry(client):
    ids = [upload(client, [request(str(i), "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})])
           for i in range(5)]
    first = client.files.list(limit=2, purpose="batch")
    assert len(first.data) == 2 and first.has_more
    listed = [f.id for f in client.files.list(limit=2, purpose="batch")]     # the SDK follows `after`
    assert [i for i in listed if i in ids] == ids[::-1]
    oldest_first = [f.id for f in client.files.list(limit=3, order="asc", purpose="batch")]
    assert [i for i in oldest_first if i in ids] == ids
    batch = client.batches.create(input_file_id=ids[0], endpoint="/v1/completions", completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 3600})
    out = client.files.retrieve(finished(client, batch.id).output_file_id)
    assert out.expires_at == out.created_at + 3600
