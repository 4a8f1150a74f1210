"""Helpers for the reliability tests (all run against the session's ``kvharbor_app``)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import random
import time
from pathlib import Path

import httpx

from tests.conftest import DEMO


def rand_text(n: int, seed: int) -> str:
    """``n`` lowercase letters (the builtin byte-level tokenizer: 1 letter = 1 token)."""
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None,
                        mentions: tuple[str, ...] = ()) -> dict:
    """``r`` is an OpenAI-shaped JSON error with this status; its message names ``mentions``."""
    assert r.status_code == status, (r.status_code, r.text[:500] if r.is_closed else "(a stream)")
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "code", "param"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in r.text and 'File "' not in r.text
    if code is not None:
        assert err["code"] == code, err
    for word in mentions:
        assert word in err["message"], (word, err["message"])
    return err


def tenants_sha256(app) -> str:
    return httpx.get(app.base_url + "/healthz", timeout=10).json()["tenants_sha256"]


def wait_tenants_applied(app, text: str, timeout_s: float = 15.0, in_a_row: int = 8) -> None:
    """Wait until ``in_a_row`` ``/healthz`` answers in a row (each from any gateway: the test
    app runs two) report the active tenants file to be ``text``. (By its SHA-256: a gateway's
    ``tenants_version`` counts its own reloads, so a restarted gateway's is lower.)"""
    want = hashlib.sha256(text.encode()).hexdigest()
    deadline, streak, seen = time.time() + timeout_s, 0, []
    while time.time() < deadline:
        try:
            digest = tenants_sha256(app)
        except (httpx.HTTPError, KeyError, ValueError) as e:   # a gateway restarting (killed by a test)
            digest = type(e).__name__
        seen.append(digest[:8])
        streak = streak + 1 if digest == want else 0
        if streak >= in_a_row:
            return
        time.sleep(0.05 if streak else 0.2)
    raise AssertionError(f"the gateways did not apply the tenants file within {timeout_s} s "
                         f"(sha256 {want[:8]} wanted; answers: {seen[-30:]})")


@contextlib.contextmanager
def edited_tenants(app, mutate):
    """Apply ``mutate(doc)`` to the session's tenants file; restore the original at exit.

    Waits until both gateways have applied it, both ways (``wait_tenants_applied``).
    Replicas reload the same file within about a second.
    """
    from ruamel.yaml import YAML

    path = app.tenants_path
    original = path.read_text(encoding="utf-8")
    yaml = YAML()
    doc = yaml.load(original)
    mutate(doc)
    out = io.StringIO()
    yaml.dump(doc, out)
    try:
        path.write_text(out.getvalue(), encoding="utf-8")
        wait_tenants_applied(app, out.getvalue())
        time.sleep(1.2)                      # replicas poll the file every second
        yield
    finally:
        path.write_text(original, encoding="utf-8")
        wait_tenants_applied(app, original)
        time.sleep(1.2)


def ray_log_files(suffixes: tuple[str, ...] = (".log", ".out", ".err", "")) -> list[Path]:
    """This Ray session's log files with these suffixes (every process's, driver included)."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file() and p.suffix in suffixes]


def replica_stats(app) -> list[dict]:
    return list(app.replica_call("stats").values())


def wait_idle(app, timeout_s: float = 30.0) -> list[dict]:
    """Poll until no replica runs or queues a request; returns each replica's stats."""
    deadline = time.time() + timeout_s
    stats = []
    while time.time() < deadline:
        stats = replica_stats(app)
        if stats and all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
            return stats
        time.sleep(0.2)
    raise AssertionError(f"replicas still busy after {timeout_s} s: "
                         f"{[(s['num_running'], s['num_waiting']) for s in stats]}")


def complete(client: httpx.Client, model: str, prompt: str, **kw) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, **kw})


__all__ = ["DEMO", "assert_openai_error", "complete", "edited_tenants", "rand_text",
           "ray_log_files", "replica_stats", "tenants_sha256", "wait_idle", "wait_tenants_applied"]
