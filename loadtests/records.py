"""Per-request records of a load test: one JSON object per line in ``records.jsonl``.

A record is what the summary needs and nothing Locust-specific::

    {"start": 1732270000.12, "end": ..., "tenant": "acme", "qos": "premium",
     "kind": "chat", "stream": true, "status": "ok", "http_status": 200, "error": null,
     "e2e_ms": 812.0, "ttft_ms": 95.1, "itl_ms": 41.7, "prompt_tokens": 190,
     "cached_tokens": 176, "completion_tokens": 16, "canary": null, "replica_id": "abc"}

``status`` is one of:
  ok               a complete answer
  rate_limited     HTTP 429 (admission said no; expected under overload, not a failure)
  error            anything else that went wrong (HTTP 4xx/5xx, broken stream, timeout)
  canary_mismatch  a canary answer that differs from the offline engine's
  dropped          open loop only: an arrival not sent because the client already had
                   ``KVH_MAX_IN_FLIGHT`` requests open (the server fell that far behind)
``start``/``end`` are Unix seconds; latencies are milliseconds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.client import Result

UNEXPECTED = ("error", "canary_mismatch")


def classify(res: Result, canary_error: str | None = None) -> str:
    if res.dropped:
        return "dropped"
    if res.status == 429:
        return "rate_limited"
    if not res.ok:
        return "error"
    return "canary_mismatch" if canary_error else "ok"


def make_record(res: Result, tenant: str, qos: str, kind: str, stream: bool,
                canary: str | None = None, canary_error: str | None = None) -> dict:
    """The record of one finished request (``end`` is now)."""
    end = time.time()
    ms = lambda s: None if s is None else round(s * 1000.0, 3)  # noqa: E731
    return {"start": end - res.e2e_s, "end": end, "tenant": tenant, "qos": qos, "kind": kind,
            "stream": stream, "status": classify(res, canary_error), "http_status": res.status,
            "error": canary_error or res.error, "e2e_ms": ms(res.e2e_s), "ttft_ms": ms(res.ttft_s),
            "itl_ms": ms(res.itl_s), "prompt_tokens": res.prompt_tokens,
            "cached_tokens": res.cached_tokens, "completion_tokens": res.completion_tokens,
            "canary": canary, "replica_id": res.replica_id}


@dataclass(slots=True)
class Recorder:
    """Appends records to ``path`` (when given) and keeps the counts the exit code needs."""

    path: Path | None = None
    unexpected: int = 0
    canary_checks: int = 0
    canary_mismatches: list[str] = field(default_factory=list)

    def add(self, record: dict) -> None:
        if record["status"] in UNEXPECTED:
            self.unexpected += 1
        if record["canary"] and record["status"] in ("ok", "canary_mismatch"):
            self.canary_checks += 1
            if record["status"] == "canary_mismatch":
                self.canary_mismatches.append(record["error"])
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_records(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
