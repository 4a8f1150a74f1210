"""The gateway's error handlers on a small FastAPI app (no Ray): each kind of failure is an
OpenAI-shaped JSON error with the status a client can act on, never a stack trace.

The HTTP tests (``tests/reliability/test_bad_input.py``) cover the common refusals through the
running app; these cover what no request of the app can reach on purpose: an unexpected
exception, a control-plane actor that does not answer, a union field's alternatives, a
model-level check."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from ray.exceptions import RayActorError

from kvharbor.platform.api_errors import install_error_handlers
from kvharbor.platform.body_limit import BodyLimitMiddleware
from kvharbor.tenants.errors import ForbiddenError
from tests.reliability.helpers import assert_openai_error


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str | list[int]
    n: int = 1

    @field_validator("n")
    @classmethod
    def _n_positive(cls, n: int) -> int:
        if n < 1:
            raise ValueError("n must be at least 1")
        return n

    @model_validator(mode="after")
    def _n_fits_the_prompt(self):
        if self.n > 4:
            raise ValueError("n must be at most 4 for this prompt")
        return self


def _client() -> TestClient:
    api = FastAPI()
    install_error_handlers(api)
    api.add_middleware(BodyLimitMiddleware, default_bytes=256)

    @api.post("/v1/items")
    async def items(body: Body) -> dict:
        return {"n": body.n}

    @api.get("/v1/raise/{kind}")
    async def fail(kind: str) -> dict:
        raise {"bug": KeyError("secret_internal_name"), "timeout": TimeoutError("no answer"),
               "actor": RayActorError(), "forbidden": ForbiddenError("the key may not use this model")}[kind]

    return TestClient(api, raise_server_exceptions=False)


def test_an_unexpected_exception_is_a_500_that_reveals_nothing_and_is_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="kvharbor.gateway"):
        r = _client().get("/v1/raise/bug")
    err = assert_openai_error(r, 500, "server_error", ("internal error",))
    assert "secret_internal_name" not in r.text and "KeyError" not in r.text, err
    assert any(rec.exc_info and "/v1/raise/bug" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("kind", ["timeout", "actor"])
def test_a_control_plane_actor_that_does_not_answer_is_a_503_to_retry(kind):
    r = _client().get(f"/v1/raise/{kind}")
    assert_openai_error(r, 503, "admission_unavailable", ("retry",))
    assert r.headers["retry-after"] == "1"


def test_a_tenant_error_keeps_its_status_and_code():
    assert_openai_error(_client().get("/v1/raise/forbidden"), 403, "permission_denied", ("may not use",))


def test_a_union_fields_alternatives_are_named_once_each():
    """``prompt: str | list[int]`` given a number fails once per alternative: the message names
    both, by the field's name (no pydantic type tags), and the param is the field."""
    err = assert_openai_error(_client().post("/v1/items", json={"prompt": 3.5}), 400)
    assert err["param"] == "prompt"
    assert err["message"] == "prompt: Input should be a valid string or prompt: Input should be a valid list"


def test_only_the_first_bad_fields_problems_are_named_and_without_pydantics_prefix():
    err = assert_openai_error(_client().post("/v1/items", json={"prompt": 3.5, "n": "x"}), 400)
    assert "n:" not in err["message"] and err["message"].count("prompt: ") == 2
    err = assert_openai_error(_client().post("/v1/items", json={"prompt": "hi", "n": 0}), 400)
    assert (err["param"], err["message"]) == ("n", "n: n must be at least 1")


def test_a_list_items_error_names_its_index_and_a_model_check_has_no_pydantic_prefix():
    err = assert_openai_error(_client().post("/v1/items", json={"prompt": [1, "x"]}), 400)
    assert err["param"] == "prompt"
    assert err["message"] == ("prompt: Input should be a valid string or prompt.1: Input should be a "
                              "valid integer, unable to parse string as an integer")
    err = assert_openai_error(_client().post("/v1/items", json={"prompt": "hi", "n": 5}), 400)
    assert err["message"] == "n must be at most 4 for this prompt"


def test_unknown_fields_and_bodies_that_are_not_objects_say_what_to_send():
    err = assert_openai_error(_client().post("/v1/items", json={"prompt": "hi", "temprature": 1}), 400,
                              "unknown_field", ("'temprature'", "/openapi.json"))
    assert err["param"] == "temprature"
    assert_openai_error(_client().post("/v1/items", json=["hi"]), 400, mentions=("JSON object",))
    assert_openai_error(_client().post("/v1/items", content=b'{"prompt": "hi",',
                                       headers={"content-type": "application/json"}),
                        400, mentions=("not valid JSON",))


def test_framework_errors_keep_their_headers_and_a_413_its_code():
    """Starlette's own refusals go through the handler: a wrong method keeps its Allow header,
    a chunked body over the limit (refused while it streams in) is request_too_large and
    closes the connection."""
    r = _client().get("/v1/items")
    assert_openai_error(r, 405, mentions=("GET", "/v1/items"))
    assert r.headers["allow"] == "POST"
    r = _client().post("/v1/items", content=iter([b'{"prompt": "' + b"x" * 200, b"x" * 200 + b'"}']),
                       headers={"content-type": "application/json"})
    assert_openai_error(r, 413, "request_too_large", ("256 bytes",))
    assert r.headers["connection"] == "close"


def test_the_schema_declares_no_422():
    schema = _client().get("/openapi.json").json()
    assert "422" not in schema["paths"]["/v1/items"]["post"]["responses"]
    assert not {"HTTPValidationError", "ValidationError"} & set(schema["components"]["schemas"])
