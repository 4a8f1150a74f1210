"""One OpenAI-style request to kvharbor, timed from the client: TTFT, inter-token latency, usage.

Times are ``time.perf_counter()`` seconds. For a streamed request:

    sent ──────────── first token chunk ── chunk ── chunk ── ... ── last token chunk ── [DONE]
    |<──── ttft_s ────>|<────────── (completion_tokens - 1) * itl_s ─────────────>|
    |<──────────────────────────────── e2e_s ──────────────────────────────────────────────>|

The first chunk of a chat stream only announces the assistant role and carries no token, so
it does not count as the first token. Chunks without ``choices`` carry usage only.
A non-streamed request has ``ttft_s = itl_s = None``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import requests


@dataclass(slots=True)
class Result:
    """What one request returned, or why it failed (``error`` set, ``status`` the HTTP code or 0)."""

    status: int = 0
    error: str | None = None
    text: str = ""
    e2e_s: float = 0.0
    ttft_s: float | None = None
    itl_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica_id: str | None = None
    dropped: bool = False           # open loop: never sent, the client's in-flight cap was full

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


def post(session: requests.Session, base_url: str, key: str, path: str, body: dict,
         timeout_s: float = 120.0) -> Result:
    """POST ``body`` to ``base_url + path`` with ``requests``; streams when ``body["stream"]``."""
    start = time.perf_counter()
    res = Result()
    try:
        with session.post(base_url.rstrip("/") + path, json=body, timeout=timeout_s,
                          stream=bool(body.get("stream")),
                          headers={"Authorization": f"Bearer {key}"}) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = _error_text(resp)
            elif body.get("stream"):
                _read_sse(resp.iter_lines(decode_unicode=False), res, start, chat="messages" in body)
            else:
                _read_json(resp.json(), res)
    except (requests.RequestException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e_s = time.perf_counter() - start
    return res


def post_fast(client, key: str, path: str, body: dict, name: str) -> Result:
    """The same request through Locust's ``FastHttpSession`` (geventhttpclient).

    Locust reports it once, under ``name``, with the client-side end-to-end time (for a
    stream: until ``data: [DONE]``, not just the headers) and as a failure unless ``ok``.
    """
    start = time.perf_counter()
    res = Result()
    stream = bool(body.get("stream"))
    with client.post(path, json=body, headers={"Authorization": f"Bearer {key}"}, stream=stream,
                     catch_response=True, name=name) as resp:
        res.status = resp.status_code or 0
        try:
            if res.status != 200:
                res.error = _error_text(resp) if res.status else f"connection: {resp.error!r}"
            elif stream:
                _read_sse(_lines(resp.iter_content(4096, decode_content=False)), res, start,
                          chat="messages" in body)
            else:
                _read_json(resp.json(), res)
        except (OSError, ValueError, KeyError) as e:
            res.error = f"{type(e).__name__}: {e}"
        res.e2e_s = time.perf_counter() - start
        resp.request_meta["response_time"] = res.e2e_s * 1000.0
        if res.ok:
            resp.success()
        else:
            resp.failure(res.error)
    return res


def _lines(chunks) -> Iterator[bytes]:
    """Split a byte-chunk stream into lines (without their line ends)."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line.rstrip(b"\r") for line in lines)
    if pending:
        yield pending


def _error_text(resp) -> str:
    try:
        return f"HTTP {resp.status_code}: {resp.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"


def _read_json(data: dict, res: Result) -> None:
    choice = data["choices"][0]
    res.text = choice["message"]["content"] if "message" in choice else choice["text"]
    _usage(data, res)


def _usage(data: dict, res: Result) -> None:
    usage = data.get("usage") or {}
    res.prompt_tokens = usage.get("prompt_tokens", 0)
    res.completion_tokens = usage.get("completion_tokens", 0)
    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    res.replica_id = (data.get("kvharbor") or {}).get("replica_id", res.replica_id)


def _read_sse(lines: Iterable[bytes], res: Result, start: float, chat: bool) -> None:
    first = last = None
    parts: list[str] = []
    chunks = 0
    done = False
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].decode("utf-8")
        if payload == "[DONE]":
            done = True
            break
        data = json.loads(payload)
        if "error" in data:
            res.error = f"stream error: {data['error'].get('message')}"
            return
        if data.get("usage"):
            _usage(data, res)
        if not data.get("choices"):
            continue
        chunks += 1
        if chat and chunks == 1:
            continue                                   # role announcement, no token
        choice = data["choices"][0]
        parts.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", ""))
        last = time.perf_counter()
        first = first or last
        res.replica_id = (data.get("kvharbor") or {}).get("replica_id", res.replica_id)
    res.text = "".join(parts)
    if not done:
        res.error = "stream ended without data: [DONE]"
    if first is not None:
        res.ttft_s = first - start
        if res.completion_tokens > 1:
            res.itl_s = (last - first) / (res.completion_tokens - 1)
