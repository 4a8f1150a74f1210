"""``POST /v1/embeddings`` through the official OpenAI client: each input's vector is the one the
engine computes offline (``LLM.embed``), as floats or as the SDK's default base64, in input
order, for the base model and its LoRA adapter; a repeated document is read from the prefix
cache (usage says so); bad input is a 400 naming the field, an unknown model a 404, a missing
key a 401."""

from __future__ import annotations

import base64
import uuid
from array import array

import openai
import pytest
import torch

from kvharbor import LLM, LoRARequest
from kvharbor.engine.hashing import hash_prompt_blocks, model_root
from kvharbor.engine.model_identity import model_identity
from tests.conftest import DEMO, LORA

ROOT = model_root(model_identity("kvharbor/tiny-llama"))   # the test app's model
SCOPE = "group:partners"                                    # the standard demo key's cache scope
ATOL = 1e-4


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


@pytest.fixture(scope="module")
def offline(kvharbor_app):
    return LLM(model=kvharbor_app.model, device="cpu", num_kv_blocks=128)


def close(got, want) -> bool:
    return torch.allclose(torch.tensor(got), torch.tensor(want), atol=ATOL, rtol=0)


def test_each_input_is_the_engines_embedding_in_input_order(client, offline, kvharbor_app):
    texts = ["Paris is in France.", "Lima is in Peru.", "The Nile flows north."]
    floats = client.embeddings.create(model=kvharbor_app.model, input=texts, encoding_format="float")
    packed = client.embeddings.create(model=kvharbor_app.model, input=texts)     # the SDK asks base64
    want = offline.embed(texts)
    assert floats.object == "list" and floats.model == kvharbor_app.model
    assert [d.index for d in floats.data] == [0, 1, 2] and {d.object for d in floats.data} == {"embedding"}
    for f, p, w in zip(floats.data, packed.data, want):
        assert len(f.embedding) == offline.hf_model.config.hidden_size
        assert close(f.embedding, w.outputs.embedding) and close(p.embedding, w.outputs.embedding)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(w.prompt_token_ids) for w in want)
    with kvharbor_app.client(DEMO["standard"]) as c:        # base64 on the wire: float32, little-endian
        wire = c.post("/v1/embeddings", json={"model": kvharbor_app.model, "input": texts[0],
                                              "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert isinstance(wire, str)
    assert close(array("f", base64.b64decode(wire)).tolist(), want[0].outputs.embedding)
    one = client.embeddings.create(model=kvharbor_app.model, input=want[1].prompt_token_ids, encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, want[1].outputs.embedding)
    raw = kvharbor_app.client(DEMO["standard"]).post("/v1/embeddings", json={
        "model": kvharbor_app.model, "input": [w.prompt_token_ids for w in want], "normalize": False,
        "truncate_prompt_tokens": 5})
    assert raw.status_code == 200, raw.text
    cut = offline.embed([w.prompt_token_ids[-5:] for w in want])
    assert raw.json()["usage"]["prompt_tokens"] == 15
    for d, w in zip(raw.json()["data"], cut):
        norm = torch.tensor(d["embedding"]).norm().item()
        assert norm > 2.0 and close([x / norm for x in d["embedding"]], w.outputs.embedding)


def test_a_repeated_document_is_read_from_the_prefix_cache(client, kvharbor_app):
    doc = f"Embedding cache check {uuid.uuid4().hex}. " * 6           # > 6 blocks, sent by no other test
    first = client.embeddings.create(model=kvharbor_app.model, input=doc, encoding_format="float")
    ids = offline_ids(doc)
    kvharbor_app.wait_indexed(hash_prompt_blocks(ids, 16, SCOPE, parent=ROOT))
    again = client.embeddings.create(model=kvharbor_app.model, input=doc, encoding_format="float")
    assert first.usage.prompt_tokens == len(ids)
    # every whole block but one holding the last token, which is always computed
    assert again.usage.model_extra["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16
    assert close(again.data[0].embedding, first.data[0].embedding)


def offline_ids(text: str) -> list[int]:
    from kvharbor.engine.tokenizer import byte_tokenizer

    return byte_tokenizer()(text)["input_ids"]


def test_the_lora_adapter_embeds_with_its_weights(offline, kvharbor_app):
    key = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)
    text = "Adapters change the vector."
    base = key.embeddings.create(model=kvharbor_app.model, input=text, encoding_format="float").data[0].embedding
    tuned = key.embeddings.create(model=LORA, input=text, encoding_format="float").data[0].embedding
    want = offline.embed(text, lora_request=LoRARequest(LORA, 1, kvharbor_app.lora_path))[0]
    assert close(tuned, want.outputs.embedding) and not close(tuned, base)


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),          # refused as OpenAI does, whatever the tokenizer adds
    ({"input": []}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input.1"),
    ({"input": [1, 2, 999999]}, 400, "input"),
    ({"input": ["a"] * 2049}, 400, "input"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "stream": True}, 400, "stream"),
    ({"input": "x" * 5000}, 400, "input"),
    ({"input": "hi", "model": "no/such-model"}, 404, "model"),
])
def test_bad_input_is_a_clear_error(kvharbor_app, body, status, param):
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.post("/v1/embeddings", json={"model": kvharbor_app.model, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    if "" in ([body["input"]] if isinstance(body["input"], str) else body["input"]):
        assert "is empty" in r.json()["error"]["message"]


def test_a_premium_key_embeds_on_its_direct_path_and_the_lane(offline, kvharbor_app):
    """Pinned classes' requests go straight to the replica (direct streams) on the main port,
    and the premium lane serves this route too."""
    text = "Premium tenants embed too."
    want = offline.embed(text)[0].outputs.embedding
    for lane in (False, True):
        with kvharbor_app.client(DEMO["premium"], lane=lane) as c:
            r = c.post("/v1/embeddings", json={"model": kvharbor_app.model, "input": [text, text],
                                               "encoding_format": "float"})
        assert r.status_code == 200, r.text
        assert [close(d["embedding"], want) for d in r.json()["data"]] == [True, True]


def test_dimensions_on_a_model_without_matryoshka_and_a_missing_key(kvharbor_app):
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.post("/v1/embeddings", json={"model": kvharbor_app.model, "input": "hi", "dimensions": 8})
    assert r.status_code == 400 and "matryoshka" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "dimensions"
    with kvharbor_app.client("not-a-key") as c:
        assert c.post("/v1/embeddings", json={"model": kvharbor_app.model, "input": "hi"}).status_code == 401


def test_rerank_orders_documents_by_the_cosine_of_their_embeddings(offline, kvharbor_app):
    query, docs = "rivers of Europe", ["The Rhine and the Danube.", "A recipe for bread.", "rivers of Europe!",
                                       "Mountains of Asia."]
    vectors = [torch.tensor(o.outputs.embedding) for o in offline.embed([query] + docs)]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    with kvharbor_app.client(DEMO["standard"]) as c:
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = c.post(path, json={"model": kvharbor_app.model, "query": query, "documents": docs, "top_n": 3})
            assert r.status_code == 200, r.text
            got = r.json()["results"]
            assert [x["index"] for x in got] == sorted(range(4), key=lambda i: -want[i])[:3]
            assert [x["relevance_score"] for x in got] == pytest.approx(sorted(want, reverse=True)[:3], abs=ATOL)
            assert [x["document"]["text"] for x in got] == [docs[x["index"]] for x in got]
        bare = c.post("/rerank", json={"model": kvharbor_app.model, "query": query, "documents": docs,
                                       "return_documents": False}).json()
        assert len(bare["results"]) == 4 and {x["document"] for x in bare["results"]} == {None}
        assert bare["usage"]["prompt_tokens"] == sum(len(offline.encode(t)) for t in [query] + docs)
        again = c.post("/v1/score", json={"model": kvharbor_app.model, "text_1": query, "text_2": docs[:2]}).json()
        assert [d["score"] for d in again["data"]] == pytest.approx(want[:2], abs=ATOL)
        pairs = c.post("/score", json={"model": kvharbor_app.model, "text_1": [query, docs[1]],
                                       "text_2": [docs[1], docs[1]]}).json()
        assert [d["score"] for d in pairs["data"]] == pytest.approx([want[1], 1.0], abs=ATOL)
        for path, body, param in [
                ("/rerank", {"query": "", "documents": docs}, "query"),
                ("/rerank", {"query": query, "documents": []}, "documents"),
                ("/rerank", {"query": query, "documents": ["ok", ""]}, "documents.1"),
                ("/rerank", {"query": query, "documents": docs, "top_n": -1}, "top_n"),
                ("/score", {"text_1": [query, query], "text_2": docs}, "text_2"),
                ("/score", {"text_1": query}, "text_2"),
                ("/score", {"text_1": query, "text_2": query, "documents": docs}, "documents"),
                ("/score", {}, "text_1"),
                ("/score", {"text_1": query, "text_2": "x" * 5000}, "text_2"),
                ("/rerank", {"query": query, "documents": ["ok", "x" * 5000, "x" * 5000]}, "documents.1")]:
            r = c.post(path, json={"model": kvharbor_app.model, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with kvharbor_app.client("not-a-key") as c:
        assert c.post("/rerank", json={"model": kvharbor_app.model, "query": query, "documents": docs}).status_code == 401


def test_the_schema_says_which_dimensions_the_served_model_takes(kvharbor_app):
    from types import SimpleNamespace

    from kvharbor.platform.embeddings import bound_dimensions

    with kvharbor_app.client(DEMO["standard"]) as c:
        served = c.get("/openapi.json").json()["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert served["dimensions"]["type"] == "null" and "anyOf" not in served["dimensions"]   # tiny-llama: none

    def bounded(**config) -> dict:
        schema = {"components": {"schemas": {"EmbeddingRequest": {"properties": {
            "dimensions": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}}}}}}
        bound_dimensions(schema, SimpleNamespace(hidden_size=64, **config))
        return schema["components"]["schemas"]["EmbeddingRequest"]["properties"]["dimensions"]

    assert bounded(matryoshka_dimensions=[32, 16])["anyOf"][0] == {"enum": [16, 32]}
    assert bounded(is_matryoshka=True)["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 64}
    assert bounded() == {"type": "null"}
