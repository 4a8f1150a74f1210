"""OpenAI's ``service_tier``: "flex" runs a request at the lowest QoS class, never above its
key's; the answer says so; the premium lane refuses it; Batch API lines are sent as flex."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from kvharbor.platform.error_body import APIError
from kvharbor.platform.service_tier import answered_tier, lowest_class, tiered
from kvharbor.tenants import TenantRegistry
from tests.conftest import DEMO
from tests.observability.recorder_actor import scrape_until

TENANTS = Path(__file__).resolve().parents[2] / "tenants.yaml"


@pytest.fixture(scope="module")
def registry():
    return TenantRegistry(TENANTS)


def test_flex_runs_at_the_lowest_class_and_never_above_the_keys(registry):
    classes = registry.config.qos_classes
    assert lowest_class(classes) == "batch"
    premium, standard, batch = (registry.authenticate(DEMO[k]) for k in ("premium", "standard", "batch"))
    for principal in (premium, standard):
        flex = tiered(principal, "flex", classes)
        assert (flex.qos_name, flex.qos) == ("batch", classes["batch"])
        assert not flex.qos.pinned and flex.qos.priority < principal.qos.priority
        assert (flex.tenant, flex.limits, flex.cache_salt) == (principal.tenant, principal.limits, principal.cache_salt)
        assert answered_tier(flex) == "flex" and answered_tier(principal) == "default"
        for tier in (None, "auto", "default"):
            assert tiered(principal, tier, classes) is principal
    assert tiered(batch, "flex", classes) is batch and answered_tier(batch) == "default"


def test_the_lowest_class_is_by_priority_not_by_name():
    class Q:
        def __init__(self, priority):
            self.priority = priority

    assert lowest_class({"a": Q(5), "z": Q(1), "m": Q(3)}) == "z"
    assert lowest_class({"b": Q(1), "a": Q(1)}) == "a"


def test_a_lowered_request_is_refused_on_the_premium_lane(registry):
    classes = registry.config.qos_classes
    premium = registry.authenticate(DEMO["premium"])
    assert tiered(premium, "default", classes, lane=True) is premium
    with pytest.raises(APIError) as err:
        tiered(premium, "flex", classes, lane=True)
    assert (err.value.status, err.value.code, err.value.param) == (403, "wrong_endpoint", "service_tier")
    assert "main port" in err.value.message


@pytest.fixture(scope="module")
def premium(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["premium"], max_retries=0)


def test_a_flex_request_is_served_at_the_lowest_class_and_says_so(premium, kvharbor_app):
    chat = {"model": kvharbor_app.model, "messages": [{"role": "user", "content": "Name a river."}],
            "max_tokens": 4, "temperature": 0}
    flex = premium.chat.completions.create(**chat, service_tier="flex")
    default = premium.chat.completions.create(**chat)
    assert (flex.service_tier, default.service_tier) == ("flex", "default")
    assert flex.choices[0].message.content == default.choices[0].message.content
    text = premium.completions.create(model=kvharbor_app.model, prompt="A river", max_tokens=3,
                                      extra_body={"service_tier": "flex"})     # not in the SDK's legacy API
    assert text.service_tier == "flex"
    response = premium.responses.create(model=kvharbor_app.model, input="Name a lake.", max_output_tokens=4,
                                        service_tier="flex", store=False)
    assert response.service_tier == "flex"
    assert premium.embeddings.create(model=kvharbor_app.model, input="a river", extra_body={"service_tier": "flex"}).data
    # the premium tenant's flex requests are counted at the lowest class (what its queue, engine
    # priority and the dashboards used), its others at its own
    scrape_until([r'^ray_kvharbor_requests_total\{.*qos="batch".*status="ok".*tenant="acme"',
                  r'^ray_kvharbor_requests_total\{.*qos="premium".*status="ok".*tenant="acme"'])


def _events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_a_streamed_flex_answer_says_so_on_every_chunk_and_response(kvharbor_app):
    with kvharbor_app.client(DEMO["standard"]) as http:
        chunks = _events(http, "/v1/completions", {"model": kvharbor_app.model, "prompt": "The sea",
                                                   "max_tokens": 3, "service_tier": "flex"})
        events = _events(http, "/v1/responses", {"model": kvharbor_app.model, "input": "The sea",
                                                 "max_output_tokens": 3, "service_tier": "flex", "store": False})
    assert chunks and {c["service_tier"] for c in chunks} == {"flex"}
    responses = [e["response"] for e in events if "response" in e]
    assert len(responses) >= 3 and {r["service_tier"] for r in responses} == {"flex"}


@pytest.mark.parametrize("tier", ["priority", "scale", "fast"])
def test_a_tier_above_the_keys_class_is_a_400_naming_the_field(premium, kvharbor_app, tier):
    with pytest.raises(openai.BadRequestError) as info:
        premium.chat.completions.create(model=kvharbor_app.model, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2, service_tier=tier)
    assert info.value.body["param"] == "service_tier", info.value.body


def test_the_premium_lane_refuses_a_flex_request_and_serves_the_others(kvharbor_app):
    body = {"model": kvharbor_app.model, "prompt": "hi", "max_tokens": 2}
    with kvharbor_app.client(DEMO["premium"], lane=True) as lane:
        refused = lane.post("/v1/completions", json={**body, "service_tier": "flex"})
        embeddings = lane.post("/v1/embeddings", json={"model": kvharbor_app.model, "input": "hi",
                                                       "service_tier": "flex"})
        served = lane.post("/v1/completions", json={**body, "service_tier": "default"})
    assert refused.status_code == embeddings.status_code == 403, (refused.text, embeddings.text)
    assert refused.json()["error"]["param"] == embeddings.json()["error"]["param"] == "service_tier"
    assert served.status_code == 200 and served.json()["service_tier"] == "default"
