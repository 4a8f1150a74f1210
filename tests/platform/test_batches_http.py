"""The Files and Batch APIs through the official OpenAI client on the running app: a batch's
output file holds, for each line, the answer the same request gets over HTTP (chat,
completions, embeddings), in input order; its failures are in the error file with the body
HTTP gives them; a file that breaks the batch format fails the batch with its lines named;
a cancel stops a running batch with the results so far; a tenant's concurrency limit slows
a batch down without failing a line; tenants see only their own files and batches."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.conftest import DEMO, TEST_KEYS, until_final
from tests.observability.recorder_actor import scrape_until

FINAL = ("completed", "failed", "expired", "cancelled")
MODEL = "kvharbor/tiny-llama"


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def upload(client, lines: list) -> str:
    content = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    meta = client.files.create(file=("requests.jsonl", content), purpose="batch")
    assert meta.bytes == len(content) and meta.purpose == "batch" and meta.filename == "requests.jsonl"
    return meta.id


def request(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def finished(client, batch_id: str, timeout_s: float = 180.0):
    return until_final(lambda: client.batches.retrieve(batch_id), FINAL, timeout_s, 0.2)


def results(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.decode().splitlines()]


def chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
            "temperature": 0, **extra}


def test_each_line_is_answered_as_over_http_in_input_order(client, kvharbor_app):
    prompts = ["Name a colour.", "Count to three.", "Say hello."]
    lines = [request(f"q{i}", "/v1/chat/completions", chat(p)) for i, p in enumerate(prompts)]
    lines.insert(1, request("bad", "/v1/chat/completions", chat("x", max_tokens=-1)))
    lines.append(request("streamed", "/v1/chat/completions", chat("y", stream=True)))
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = finished(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.model == MODEL and done.output_file_id and done.error_file_id
    out = results(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == ["q0", "q1", "q2"]
    for r, prompt in zip(out, prompts):
        answer = openai.types.chat.ChatCompletion.model_validate(r["response"]["body"])
        direct = client.chat.completions.create(**chat(prompt))
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"] == answer.id
        assert answer.choices[0].message.content == direct.choices[0].message.content
        assert answer.usage.prompt_tokens == direct.usage.prompt_tokens
    errors = results(client, done.error_file_id)
    assert [(r["custom_id"], r["response"]["status_code"]) for r in errors] == [("bad", 400), ("streamed", 400)]
    over_http = httpx.post(kvharbor_app.base_url + "/v1/chat/completions", json=chat("x", max_tokens=-1),
                           headers={"Authorization": f"Bearer {DEMO['standard']}"})
    assert errors[0]["response"]["body"] == over_http.json()
    assert errors[1]["response"]["body"]["error"]["param"] == "stream"
    # the gateway counted the batch and its lines (the Tenants dashboard's Batch API row)
    scrape_until([r'^ray_kvharbor_batches_total\{.*status="completed".*tenant="globex"',
                  r'^ray_kvharbor_batch_requests_total\{.*outcome="completed".*tenant="globex"',
                  r'^ray_kvharbor_batch_requests_total\{.*outcome="failed".*tenant="globex"'])


def test_completions_and_embeddings_batches(client):
    prompts = ["The sea is", "Mountains are"]
    batch = client.batches.create(input_file_id=upload(client, [request(
        p, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 5, "temperature": 0}) for p in prompts]),
        endpoint="/v1/completions", completion_window="24h")
    out = results(client, finished(client, batch.id).output_file_id)
    texts = [r["response"]["body"]["choices"][0]["text"] for r in out]
    assert texts == [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
                     for p in prompts]
    batch = client.batches.create(input_file_id=upload(client, [request(
        p, "/v1/embeddings", {"model": MODEL, "input": p, "encoding_format": "float"}) for p in prompts]),
        endpoint="/v1/embeddings", completion_window="24h")
    out = results(client, finished(client, batch.id).output_file_id)
    for r, p in zip(out, prompts):
        direct = client.embeddings.create(model=MODEL, input=p, encoding_format="float").data[0].embedding
        got = r["response"]["body"]["data"][0]["embedding"]
        assert torch.allclose(torch.tensor(got), torch.tensor(direct), atol=1e-4, rtol=0)


def test_a_file_that_breaks_the_format_fails_the_batch_naming_its_lines(client):
    good = request("a", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    file_id = upload(client, [good, good, request("b", "/v1/embeddings", {"model": MODEL, "input": "x"}), "{oops"])
    done = finished(client, client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                                  completion_window="24h").id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.line, e.param) for e in done.errors.data] == [(2, "custom_id"), (3, "url"), (4, None)]
    assert "custom_id 'a'" in done.errors.data[0].message and "/v1/embeddings" in done.errors.data[1].message


def test_a_cancel_stops_a_running_batch_with_its_results_so_far(client):
    lines = [request(f"c{i}", "/v1/completions", {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 64,
                                                  "ignore_eos": True}) for i in range(96)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/completions",
                                  completion_window="24h")
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 96 and counts.failed == 0 and counts.completed < 96
    kept = results(client, done.output_file_id)
    assert len(kept) == counts.completed and all(len(r["response"]["body"]["choices"][0]["text"]) for r in kept)
    assert client.batches.cancel(batch.id).status == "cancelled"        # a final batch stays as it is


def test_a_tenants_concurrency_limit_slows_a_batch_without_failing_a_line(kvharbor_app):
    """Tenant ``two_at_once`` (``max_concurrent_requests: 2``) runs 10 lines 8 at a time: the
    extra ones get 429s from its limits and are sent again until they pass."""
    limited = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=TEST_KEYS["two_at_once"], max_retries=0)
    lines = [request(f"l{i}", "/v1/completions", {"model": MODEL, "prompt": f"Line {i}", "max_tokens": 24,
                                                  "ignore_eos": True}) for i in range(10)]
    done = finished(limited, limited.batches.create(input_file_id=upload(limited, lines),
                                                    endpoint="/v1/completions", completion_window="24h").id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (10, 0)


def test_tenants_see_only_their_own_files_and_batches(client, kvharbor_app):
    other = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["batch"], max_retries=0)
    file_id = upload(client, [request("a", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: other.files.retrieve(file_id), lambda: other.files.content(file_id),
                 lambda: other.files.delete(file_id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in other.files.list()]
    assert batch.id not in [b.id for b in other.batches.list()]
    assert file_id in [f.id for f in client.files.list(purpose="batch")]
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    assert httpx.get(kvharbor_app.base_url + "/v1/batches").status_code == 401
    finished(client, batch.id)
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


@pytest.mark.parametrize("form,status,param", [
    ({"purpose": "fine-tune"}, 400, "purpose"),
    ({}, 400, "purpose"),
])
def test_an_upload_without_purpose_batch_is_a_400(kvharbor_app, form, status, param):
    r = httpx.post(kvharbor_app.base_url + "/v1/files", data=form, files={"file": ("a.jsonl", b"{}\n")},
                   headers={"Authorization": f"Bearer {DEMO['standard']}"})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_an_upload_over_the_body_limit_is_a_413(kvharbor_app):
    r = httpx.post(kvharbor_app.base_url + "/v1/files", data={"purpose": "batch"},
                   files={"file": ("big.jsonl", b"x" * (5 * 2**20))},
                   headers={"Authorization": f"Bearer {DEMO['standard']}"})
    assert r.status_code == 413 and r.json()["error"]["message"], r.text


@pytest.mark.parametrize("change,status,param", [
    ({"input_file_id": "file-unknown"}, 404, "input_file_id"),
    ({"endpoint": "/v1/moderations"}, 400, "endpoint"),
    ({"completion_window": "1h"}, 400, "completion_window"),
    ({"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
])
def test_a_batch_the_server_cannot_run_is_refused_naming_the_field(client, kvharbor_app, change, status, param):
    file_id = upload(client, [request("a", "/v1/completions", {"model": MODEL, "prompt": "x"})])
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h", **change}
    r = httpx.post(kvharbor_app.base_url + "/v1/batches", json=body,
                   headers={"Authorization": f"Bearer {DEMO['standard']}"})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_a_batch_output_file_cannot_start_a_batch(client):
    file_id = upload(client, [request("a", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})])
    done = finished(client, client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                                  completion_window="24h").id)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.batches.create(input_file_id=done.output_file_id, endpoint="/v1/completions", completion_window="24h")
