"""LoRA adapters over HTTP, as vLLM serves them: a request's ``model`` names the adapter, its
answer is the offline engine's with that adapter, ``/v1/models`` lists it with its base model,
a tenant's ``allowed_models`` may name it, its prefixes are routed to and reused on the
replica that cached them under the adapter (never the base model's blocks), and adapters come
and go with tenants.yaml."""

from __future__ import annotations

import random
import time

import openai
import pytest

from tests.conftest import DEMO, LORA, TEST_KEYS


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))   # 1 byte = 1 token


def test_an_adapter_answers_what_the_engine_answers_with_it(client, kvharbor_app):
    from kvharbor import LLM, LoRARequest, SamplingParams

    offline = LLM(device="cpu", num_kv_blocks=64)
    prompts = ["Once upon a time", "The ship sailed"]
    sp = SamplingParams(max_tokens=12, temperature=0)
    want = [o.text for o in offline.generate(prompts, sp, lora_request=LoRARequest(LORA, 1, kvharbor_app.lora_path))]
    base = [o.text for o in offline.generate(prompts, sp)]
    assert want != base
    for prompt, text, base_text in zip(prompts, want, base):
        out = client.completions.create(model=LORA, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == text and out.model == LORA
        plain = client.completions.create(model=kvharbor_app.model, prompt=prompt, max_tokens=12, temperature=0)
        assert plain.choices[0].text == base_text
    stream = client.completions.create(model=LORA, prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want[0]


def test_models_lists_the_adapter_with_its_base_model(client, kvharbor_app):
    cards = {m.id: m for m in client.models.list().data}
    assert cards[LORA].parent == kvharbor_app.model and cards[LORA].root == kvharbor_app.lora_path
    assert cards[kvharbor_app.model].parent is None and cards[kvharbor_app.model].root == kvharbor_app.model
    assert client.models.retrieve(LORA).parent == kvharbor_app.model
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="tiny-lora-2", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and LORA in info.value.body["message"]


def test_a_tenant_allowed_only_the_adapter(kvharbor_app):
    only = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=TEST_KEYS["lora_only"], max_retries=0)
    assert only.chat.completions.create(model=LORA, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3).choices[0].message.content is not None
    with pytest.raises(openai.PermissionDeniedError) as info:
        only.completions.create(model=kvharbor_app.model, prompt="hi", max_tokens=3)
    assert info.value.body["code"] == "model_not_allowed" and LORA in info.value.body["message"]


def test_an_adapters_prefix_is_routed_to_and_reused_where_it_was_cached(kvharbor_app):
    """The router matches the adapter's own block hashes: follow-ups sharing a 512-token
    prefix land on the replica that cached it under the adapter, and reuse it; the base model
    with the same prefix reuses nothing (its KV is another model's)."""
    prefix = _text(512, 77)
    with kvharbor_app.client(DEMO["standard"]) as c:
        def complete(model: str, suffix: str) -> dict:
            r = c.post("/v1/completions", json={"model": model, "prompt": prefix + suffix,
                                                "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        first = complete(LORA, "first?")
        time.sleep(1.5)                      # KV events reach the routers
        follow = [complete(LORA, f"then {i}!") for i in range(3)]
        base = complete(kvharbor_app.model, "first?")
    assert {f["kvharbor"]["replica_id"] for f in follow} == {first["kvharbor"]["replica_id"]}
    assert all(f["usage"]["prompt_tokens_details"]["cached_tokens"] >= 496 for f in follow)
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_adapter_added_to_tenants_yaml_is_served_until_it_is_removed(client, kvharbor_app):
    """An edit of tenants.yaml adds an adapter (a path relative to the file): every gateway
    lists and accepts it and the replicas answer with it, without a restart; removed, it is a
    404 again."""
    from kvharbor import LLM, LoRARequest, SamplingParams
    from tests.conftest import write_test_adapter
    from tests.reliability.helpers import edited_tenants

    path = write_test_adapter(kvharbor_app.tenants_path.parent / "hot-lora", seed=11)
    prompts = [f"{_text(40, 300 + i)} and then" for i in range(6)]     # spread over the replicas
    want = [o.text for o in LLM(device="cpu", num_kv_blocks=64).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0), lora_request=LoRARequest("hot", 1, path))]

    def add(doc):
        doc["lora_adapters"] = {"hot": {"path": "hot-lora"}}

    with edited_tenants(kvharbor_app, add):
        loaded = {rid: s["lora_adapters"] for rid, s in kvharbor_app.replica_call("stats").items()}
        assert [a["hot"]["path"] for a in loaded.values()] == [path, path], loaded   # before any request
        for prompt, text in zip(prompts, want):          # (and over both gateways)
            assert "hot" in [m.id for m in client.models.list().data]
            out = client.completions.create(model="hot", prompt=prompt, max_tokens=12, temperature=0)
            assert out.choices[0].text == text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="hot", prompt="Once upon a time", max_tokens=2)
    for stats in kvharbor_app.replica_call("stats").values():             # unloaded everywhere
        assert list(stats["lora_adapters"]) == [LORA]


@pytest.mark.parametrize("key", [DEMO["standard"], DEMO["premium"]], ids=["standard", "premium"])
def test_a_request_for_an_adapter_that_failed_to_load_is_a_400_streamed_or_not(kvharbor_app, key):
    """tenants.yaml lists an adapter whose weights are broken: the gateways serve its name, the
    replicas refuse its requests with the reason. Streamed (through Serve for standard, a
    direct stream for premium) the client gets the same HTTP 400 and JSON body as unstreamed,
    not a 200 stream that carries the error."""
    from tests.conftest import write_test_adapter
    from tests.reliability.helpers import edited_tenants

    broken = kvharbor_app.tenants_path.parent / "broken-lora"
    write_test_adapter(broken, seed=12)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")

    def add(doc):
        doc["lora_adapters"] = {"broken": {"path": "broken-lora"}}

    body = {"model": "broken", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    with edited_tenants(kvharbor_app, add), kvharbor_app.client(key) as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 400, (stream, r.text)
            assert "LoRA adapter 'broken' could not be loaded" in r.json()["error"]["message"], r.text
