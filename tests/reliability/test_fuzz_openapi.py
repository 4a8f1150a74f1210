"""Schemathesis fuzzes the gateway from its own OpenAPI schema: no 5xx, responses as declared.

Requests carry the key of a temporary ``fuzz`` tenant (standard class, no rate limits,
``max_tokens_per_request: 4``), so generated requests stay cheap: a larger ``max_tokens``
is a 400 and an absent one is capped at 4 tokens. Examples per route are bounded
(``MAX_EXAMPLES``) to keep the run around a minute on 2 cores.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection,
                                 not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

from kvharbor.tenants.keys import hash_key
from tests.reliability.helpers import edited_tenants

MAX_EXAMPLES = 40
FUZZ_KEY = "kvh-fuzz-tenant-key-for-tests-only"


@schemathesis.check
def error_names_the_problem(ctx, response, case) -> bool | None:
    """Every 4xx is the OpenAI error body with a message; a 400 for a field names that field
    (``param`` set and in the message), else the message says what about the body is wrong."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    err = body["error"]
    assert set(body) == {"error"} and isinstance(err["message"], str) and err["message"], body
    assert err["type"] and err["code"], body
    if response.status_code == 400 and err["param"] is not None:
        assert err["param"].split(".")[-1] in err["message"], err
    elif response.status_code == 400:
        assert any(w in err["message"] for w in ("JSON", "body", "max_tokens", "logprobs", "prompt")), err
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, error_names_the_problem]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
CASES = [("POST", "/v1/completions", POSITIVE), ("POST", "/v1/completions", NEGATIVE),
         ("POST", "/v1/chat/completions", POSITIVE), ("POST", "/v1/chat/completions", NEGATIVE),
         ("POST", "/v1/responses", POSITIVE), ("POST", "/v1/responses", NEGATIVE),
         ("POST", "/v1/embeddings", POSITIVE), ("POST", "/v1/embeddings", NEGATIVE),
         ("POST", "/rerank", POSITIVE), ("POST", "/rerank", NEGATIVE),
         ("POST", "/score", POSITIVE), ("POST", "/score", NEGATIVE),
         ("GET", "/v1/responses/{response_id}", POSITIVE), ("DELETE", "/v1/responses/{response_id}", POSITIVE),
         ("POST", "/tokenize", POSITIVE), ("POST", "/tokenize", NEGATIVE),
         ("POST", "/detokenize", POSITIVE), ("POST", "/detokenize", NEGATIVE),
         ("GET", "/v1/models", POSITIVE), ("GET", "/v1/models/{model_id}", POSITIVE),
         ("POST", "/v1/files", POSITIVE), ("GET", "/v1/files", POSITIVE), ("GET", "/v1/files/{file_id}", POSITIVE),
         ("GET", "/v1/files/{file_id}/content", POSITIVE), ("DELETE", "/v1/files/{file_id}", POSITIVE),
         ("POST", "/v1/batches", NEGATIVE), ("GET", "/v1/batches", POSITIVE),
         ("GET", "/v1/batches/{batch_id}", POSITIVE), ("POST", "/v1/batches/{batch_id}/cancel", POSITIVE),
         ("GET", "/healthz", POSITIVE),
         ("GET", "/admin/tenants", POSITIVE), ("GET", "/admin/tenants/status", POSITIVE)]
"""(method, path, mode); the GET routes take no input, so they have no invalid variant."""


def _add_fuzz_tenant(doc) -> None:
    doc["tenants"]["fuzz"] = {
        "keys": [{"hash": hash_key(FUZZ_KEY), "label": "reliability tests"}],
        "qos": "standard", "cache_scope": "private", "requests_per_minute": None,
        "tokens_per_minute": None, "daily_token_budget": None, "max_concurrent_requests": 64,
        "max_tokens_per_request": 4}


class LiveSchema:
    """The gateway's OpenAPI schema (loaded with httpx) and the base URL to send cases to."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model = base_url, model
        self.schema = schemathesis.openapi.from_dict(httpx.get(base_url + "/openapi.json", timeout=30).json())

    def __getitem__(self, path: str):
        return self.schema[path]


@pytest.fixture(scope="module")
def gateway_schema(kvharbor_app):
    """The live schema, with the ``fuzz`` tenant active while the module runs."""
    with edited_tenants(kvharbor_app, _add_fuzz_tenant):
        yield LiveSchema(kvharbor_app.base_url, kvharbor_app.model)


@pytest.mark.parametrize("method,path,mode", CASES, ids=lambda v: getattr(v, "value", v))
def test_route_conforms_to_its_schema(gateway_schema, method, path, mode):
    """Generated requests (valid, or invalid for ``NEGATIVE``) get no 5xx and a declared answer."""
    operation = gateway_schema[path][method]
    checks = CHECKS + ([negative_data_rejection] if mode is NEGATIVE else [])
    headers = {"Authorization": f"Bearer {FUZZ_KEY}"}
    statuses: dict[int, int] = {}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def run(case) -> None:
        if mode is POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = gateway_schema.model      # else nearly every case is a 404
            _only_assistants_call_tools(case.body.get("messages"))
        response = _send(case, gateway_schema.base_url, headers)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=checks)

    run()
    print(f"{method} {path} {mode.value}: statuses {statuses}")
    if mode is POSITIVE and method == "POST" and "{" not in path:   # (an id in the path: a random one is unknown)
        assert statuses.get(200, 0) > 0, statuses       # the route's work was reached


def _only_assistants_call_tools(messages) -> None:
    """The rule the schema states in words but JSON Schema cannot give the generator: only an
    assistant message carries tool_calls, and only one with tool_calls may have null content
    (without this nearly every generated chat case is a 400 on it)."""
    for m in messages if isinstance(messages, list) else ():
        if isinstance(m, dict) and m.get("role") != "assistant":
            m.pop("tool_calls", None)
        if isinstance(m, dict) and m.get("content") is None and not m.get("tool_calls"):
            m["content"] = "Hello"


def _send(case, base_url: str, headers: dict) -> httpx.Response:
    """Send a generated case with httpx (schemathesis' own ``requests`` transport trips over
    the ``urllib3-future`` package installed here). JSON goes out ASCII-escaped, so lone
    surrogates reach the server as ``\\udXXX`` escapes, as a real client would send them."""
    kw = case.as_transport_kwargs(base_url=base_url, headers=headers)
    content = kw.get("data")
    if "json" in kw:
        content = json.dumps(kw["json"]).encode()
        kw["headers"].setdefault("Content-Type", "application/json")
    if "files" in kw:                       # multipart: httpx builds the body and its boundary
        kw["headers"].pop("Content-Type", None)
        files = [(name, (filename, _raw(value))) for name, (filename, value) in kw["files"]]
        request = httpx.Request(kw["method"], kw["url"], headers=kw["headers"], params=kw.get("params"),
                                data=kw.get("data"), files=files)
        request.read()                      # the checks read the sent body back
        with httpx.Client(timeout=60) as client:
            return client.send(request)
    return httpx.request(kw["method"], kw["url"], headers=kw["headers"], params=kw.get("params"),
                         content=content, timeout=60)



def _raw(value) -> bytes:
    """A generated multipart part's bytes (text or a number or object goes as JSON text;
    lone surrogates as their escapes, as in the JSON bodies)."""
    if isinstance(value, bytes):
        return value
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "backslashreplace")

def test_schema_declares_the_openai_error_body(kvharbor_app):
    spec = httpx.get(kvharbor_app.base_url + "/openapi.json").json()
    post = spec["paths"]["/v1/completions"]["post"]
    assert {"400", "401", "404", "413", "429", "503"} <= set(post["responses"])
    assert "422" not in post["responses"]
    ref = post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ErrorResponse")
    assert "text/event-stream" in post["responses"]["200"]["content"]


def test_schema_bounds_token_ids_by_the_served_vocabulary(kvharbor_app):
    """A client (or a fuzzer) reading /openapi.json learns which token ids the model has."""
    from kvharbor.engine.model_info import load_tokenizer

    schemas = httpx.get(kvharbor_app.base_url + "/openapi.json").json()["components"]["schemas"]
    top = len(load_tokenizer(kvharbor_app.model)) - 1
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[1]["items"] == {"type": "integer", "minimum": 0, "maximum": top}
    assert prompt[3]["items"]["items"] == prompt[1]["items"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == prompt[1]["items"]
    assert "x-token-id" not in json.dumps(schemas)
