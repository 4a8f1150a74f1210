"""Bad input gets an OpenAI-shaped JSON error that says what to fix, never a stack trace."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.reliability.helpers import DEMO, assert_openai_error, complete


@pytest.fixture(scope="module")
def client(kvharbor_app):
    with kvharbor_app.client(DEMO["standard"]) as c:
        yield c


def test_prompt_longer_than_the_context_is_400_with_the_numbers(client, kvharbor_app):
    r = complete(client, kvharbor_app.model, "a" * 5000, max_tokens=1)
    assert_openai_error(r, 400, "context_length_exceeded", ("5000", "4096", "shorten the prompt"))


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_below_one_is_400(client, kvharbor_app, max_tokens):
    r = complete(client, kvharbor_app.model, "hi", max_tokens=max_tokens)
    err = assert_openai_error(r, 400, mentions=("max_tokens",))
    assert err["param"] == "max_tokens"


def test_max_tokens_beyond_the_context_names_the_largest_allowed(client, kvharbor_app):
    r = complete(client, kvharbor_app.model, "abcd", max_tokens=4095)
    assert_openai_error(r, 400, "context_length_exceeded", ("4095", "4096", "at most 4092"))


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "ten"), ("temperature", "hot"), ("stream", "sometimes"), ("prompt", 42),
    ("prompt", [1, "two"]), ("stop", 7), ("seed", 2**70), ("n", 9), ("n", 0),
    ("stream", "true"), ("echo", 1), ("ignore_eos", 0.0), ("max_tokens", "5"), ("max_tokens", 5.0),
    ("temperature", "0.5"), ("logit_bias", {"7": "5"}),
])
def test_wrong_types_and_values_are_400_naming_the_field(client, kvharbor_app, field, value):
    body = {"model": kvharbor_app.model, "prompt": "hi", field: value}
    err = assert_openai_error(client.post("/v1/completions", json=body), 400, mentions=(field,))
    assert err["param"].split(".")[0] == field


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", 2.5),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1)])
def test_sampling_parameters_out_of_range_are_400(client, kvharbor_app, field, value):
    r = complete(client, kvharbor_app.model, "hi", **{field: value})
    assert_openai_error(r, 400, mentions=(field,))


def test_tiny_temperature_is_greedy_not_a_crash(client, kvharbor_app):
    """1e-300 would overflow the logits (NaN probabilities) if the engine divided by it."""
    kw = dict(max_tokens=4, ignore_eos=True)
    tiny = complete(client, kvharbor_app.model, "greedy?", temperature=1e-300, **kw)
    greedy = complete(client, kvharbor_app.model, "greedy?", temperature=0, **kw)
    assert tiny.status_code == greedy.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_too_many_stop_strings_is_400(client, kvharbor_app):
    r = complete(client, kvharbor_app.model, "hi", stop=[str(i) for i in range(9)])
    assert_openai_error(r, 400, mentions=("stop", "at most 8"))


def test_a_stop_string_over_256_characters_is_400(client, kvharbor_app):
    """The engine checks every stop string against the text of each new token: their length is
    bounded (256 characters is accepted, 257 is not)."""
    ok = complete(client, kvharbor_app.model, "hi", stop=["s" * 256], max_tokens=1)
    assert ok.status_code == 200, ok.text
    r = complete(client, kvharbor_app.model, "hi", stop=["ok", "s" * 257])
    assert_openai_error(r, 400, mentions=("stop", "256 characters"))


def test_token_ids_outside_the_vocabulary_are_400(client, kvharbor_app):
    r = complete(client, kvharbor_app.model, [1, 2, 10**6])
    assert_openai_error(r, 400, mentions=("prompt", "[0, "))


def test_empty_prompt_is_400(client, kvharbor_app):
    r = complete(client, kvharbor_app.model, [])
    assert_openai_error(r, 400, mentions=("prompt",))


@pytest.mark.parametrize("prompt,param", [(["hi", ""], "prompt.1"), ([[5, 6], []], "prompt.1"),
                                          ([[1], [2, 10**6]], "prompt.1"), (["a", "b" * 5000], "prompt.1")])
def test_a_bad_prompt_in_a_batch_is_400_naming_which(client, kvharbor_app, prompt, param):
    r = complete(client, kvharbor_app.model, prompt, max_tokens=1)
    err = assert_openai_error(r, 400, mentions=(param,))
    assert err["param"] == param


@pytest.mark.parametrize("messages,mentions", [
    ([], ("messages", "at least 1")),
    ([{"role": "wizard", "content": "hi"}], ("role",)),
    ([{"role": "user"}], ("content",)),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ("content",)),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], ("content",)),
])
def test_bad_chat_messages_are_400(client, kvharbor_app, messages, mentions):
    r = client.post("/v1/chat/completions", json={"model": kvharbor_app.model, "messages": messages})
    assert_openai_error(r, 400, mentions=mentions)


@pytest.mark.parametrize("body", [b'{"model": "x", "prompt": ', b"not json at all", b"[1, 2, 3]",
                                  b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}'])
def test_malformed_json_and_invalid_utf8_are_400(client, body):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400)
    assert "JSON" in err["message"] or "body" in err["message"], err


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}'),
    ("/v1/completions", b'{"model": "\\udfff", "prompt": "hi"}'),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}]}'),
])
def test_lone_surrogates_in_json_strings_are_400(client, kvharbor_app, route, body):
    body = body.replace(b"%s", kvharbor_app.model.encode())
    r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, mentions=("surrogate",))


def test_missing_required_fields_are_400(client):
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert_openai_error(r, 400, mentions=("model",))


def test_unknown_model_is_404_and_names_the_served_one(client, kvharbor_app):
    r = complete(client, "gpt-17", "hi")
    err = assert_openai_error(r, 404, "model_not_found", ("gpt-17", kvharbor_app.model, "/v1/models"))
    assert err["param"] == "model"


def test_unknown_route_and_wrong_method_are_openai_errors(client):
    assert_openai_error(client.get("/v1/nothing-here"), 404, mentions=("/v1/nothing-here",))
    assert_openai_error(client.get("/v1/completions"), 405, mentions=("GET",))


def test_oversized_body_with_content_length_is_413(client, kvharbor_app):
    prompt = "a" * (4 * 1024 * 1024 + 10)
    r = complete(client, kvharbor_app.model, prompt)
    assert_openai_error(r, 413, "request_too_large", ("limit",))


def _raw_chunked_post(base_url: str, path: str, key: str, chunks) -> tuple[int, bytes]:
    """POST with ``Transfer-Encoding: chunked`` (no Content-Length); returns (status, body)."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                   "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                   "Connection: close\r\n\r\n").encode())
        try:
            for chunk in chunks:
                s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass                           # the server answered early and closed: fine
        data = _read_response(s)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def _read_response(s) -> bytes:
    """Everything the server sent on socket ``s``: the head and a body of its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _expected_len(data):
        try:
            part = s.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        data += part
    return data


def _expected_len(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return len(data) + 1


def test_oversized_chunked_body_without_content_length_is_413(kvharbor_app):
    piece = b"a" * 65536
    chunks = [b'{"model": "%s", "prompt": "' % kvharbor_app.model.encode()] + [piece] * 80 + [b'"}']
    status, body = _raw_chunked_post(kvharbor_app.base_url, "/v1/completions", DEMO["standard"], chunks)
    assert status == 413, body[:300]
    err = httpx.Response(413, content=body).json()["error"]
    assert err["code"] == "request_too_large" and "limit" in err["message"]


def test_small_chunked_body_is_accepted(kvharbor_app):
    chunks = [b'{"model": "%s", ' % kvharbor_app.model.encode(), b'"prompt": "hi", "max_tokens": 2}']
    status, body = _raw_chunked_post(kvharbor_app.base_url, "/v1/completions", DEMO["standard"], chunks)
    assert status == 200, body[:300]


def test_too_many_messages_is_400_with_the_limit(client, kvharbor_app):
    from kvharbor.platform.openai_protocol import MAX_MESSAGES

    messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    r = client.post("/v1/chat/completions", json={"model": kvharbor_app.model, "messages": messages})
    err = assert_openai_error(r, 400, mentions=("messages", str(MAX_MESSAGES)))
    assert err["param"] == "messages"


def test_too_many_prompt_token_ids_is_400_with_the_limit(client, kvharbor_app):
    from kvharbor.platform.openai_protocol import MAX_PROMPT_TOKEN_IDS

    r = complete(client, kvharbor_app.model, [1] * (MAX_PROMPT_TOKEN_IDS + 1))
    err = assert_openai_error(r, 400, mentions=("prompt", str(MAX_PROMPT_TOKEN_IDS)))
    assert err["param"] == "prompt"


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi", "best_of": 3}),
    ("/v1/completions", {"prompt": "hi", "temprature": 0.2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "ann"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"x": 1}}),
    ("/v1/responses", {"input": "hi", "stream_options": {"k": 0.0}}),
])
def test_fields_kvharbor_does_not_implement_are_400_by_name(client, kvharbor_app, route, body):
    r = client.post(route, json={"model": kvharbor_app.model, **body})
    err = assert_openai_error(r, 400)
    named = err["param"].split(".")[-1]
    assert named in err["message"] and named in str(body), err


def _raw_headers_only(base_url: str, path: str, key: str | None, declared: int) -> tuple[int, bytes, float]:
    """Send only the request head, announcing ``declared`` body bytes that never come."""
    import time

    host, port = base_url.removeprefix("http://").split(":")
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    with socket.create_connection((host, int(port)), timeout=20) as s:
        t0 = time.perf_counter()
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
                   f"Content-Length: {declared}\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _expected_len(data):
            part = s.recv(65536)
            if not part:
                break
            data += part
        elapsed = time.perf_counter() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body, elapsed


@pytest.mark.parametrize("key", [None, "kvh-wrong-key"])
@pytest.mark.parametrize("declared", [1000, 4 * 1024 * 1024, 64 * 1024 * 1024])
def test_401_comes_before_any_byte_of_the_body_is_read(kvharbor_app, key, declared):
    """The body never arrives: a 401 within the socket timeout proves it was not waited for,
    whatever its announced size (under or over the 413 limit)."""
    status, body, elapsed = _raw_headers_only(kvharbor_app.base_url, "/v1/chat/completions", key, declared)
    assert status == 401, body[:300]
    assert httpx.Response(401, content=body).json()["error"]["code"] == "invalid_api_key"
    assert elapsed < 15


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_the_token_routes_also_refuse_a_wrong_key_before_the_body(kvharbor_app, path):
    status, body, elapsed = _raw_headers_only(kvharbor_app.base_url, path, "kvh-wrong-key", 1000)
    assert status == 401 and elapsed < 15, body[:300]


def test_a_declared_oversized_body_is_413_before_any_byte_of_it_is_read(kvharbor_app):
    """A valid key announcing 64 MiB: the answer comes from the head alone (the client need
    not upload what will be refused); the body never arrives."""
    status, body, elapsed = _raw_headers_only(kvharbor_app.base_url, "/v1/completions",
                                              DEMO["standard"], 64 * 1024 * 1024)
    assert status == 413, body[:300]
    assert httpx.Response(413, content=body).json()["error"]["code"] == "request_too_large"
    assert elapsed < 15


def test_unauthenticated_4mib_body_is_401_not_400(kvharbor_app):
    """4 MiB of invalid JSON under a wrong key: the answer is about the key, not the body."""
    junk = b"{" + b"x" * (4 * 1024 * 1024 - 1)
    host, port = kvharbor_app.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer wrong\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(junk)}\r\n\r\n").encode())
        try:
            s.sendall(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass                           # the server answered early and closed: fine
        data = _read_response(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert int(head.split(b" ")[1]) == 401, data[:300]
    assert httpx.Response(401, content=body).json()["error"]["code"] == "invalid_api_key"


def test_a_rate_limited_tenant_is_refused_before_its_prompt_is_tokenized(kvharbor_app):
    """Once refused for requests_per_minute, a tenant's next request is a 429 even when its
    prompt would fail tokenization checks (400): the gateway did not tokenize it."""
    from tests.conftest import TEST_KEYS

    with kvharbor_app.client(TEST_KEYS["limited"]) as c:
        statuses = [complete(c, kvharbor_app.model, "hi", max_tokens=1).status_code for _ in range(16)]
        assert statuses.count(429) >= 8, statuses          # 6 per minute: both gateways refused some
        r = complete(c, kvharbor_app.model, "a" * 5000, max_tokens=1)     # 5000 tokens > context
    assert_openai_error(r, 429, "requests_per_minute")
    assert int(r.headers["retry-after"]) >= 1, r.headers


def test_a_prompt_near_the_body_limit_does_not_hold_up_the_gateway(kvharbor_app):
    """Tokenizing a 3 MB prompt takes seconds; the same gateway process (the premium lane is
    one) answers other requests meanwhile, and the long prompt still gets its 400. Before,
    it was tokenized on the gateway's event loop and every other request waited for it."""
    import threading
    import time

    done: dict[str, float] = {}
    big: dict[str, httpx.Response] = {}

    def send_big() -> None:
        with kvharbor_app.client(DEMO["premium"], lane=True) as c:
            big["r"] = complete(c, kvharbor_app.model, "a" * 3_000_000, max_tokens=1)
        done["big"] = time.monotonic()

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.5)                        # its body is in and being tokenized by now
    with kvharbor_app.client(DEMO["premium"], lane=True) as c:
        small = [complete(c, kvharbor_app.model, "hello", max_tokens=1) for _ in range(3)]
    done["small"] = time.monotonic()
    sender.join(timeout=120)
    assert [r.status_code for r in small] == [200, 200, 200], [r.text for r in small]
    assert_openai_error(big["r"], 400, "context_length_exceeded", ("3000000", "4096"))
    assert done["small"] < done["big"], "the small requests waited for the long prompt's tokenizing"
