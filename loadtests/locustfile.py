"""Locust load test for kvharbor: one user class per tenant profile, canaries, load shapes.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000          # web UI
    python -m loadtests.run --host http://127.0.0.1:8000 --shape steady     # headless + summary

Users (weights 1 : 2 : 2, so 20 % of users are premium):
  PremiumUser   acme / premium    short support chats and multi-turn chats that resend their
                                  history, all on the pinned system prompt; streamed
  StandardUser  globex / standard long-document questions (4 shared documents) and short chats;
                                  streamed
  BatchUser     initech / batch   document summaries as raw completions, mostly not streamed
Each user sends one of its profile's integrity canaries as it starts and then now and then
(see ``loadtests.canaries``).

Locust entries: ``<kind> <qos>`` (whole request), ``TTFT <qos>`` and ``ITL <qos>`` (streamed
requests only; ITL is the mean gap per token of one request), ``canary <name>``. A 429 is
reported as a failure entry but is *expected* under overload; the exit code counts only
unexpected failures (other errors, broken streams) and canary mismatches.

Environment: KVH_KEY_PREMIUM / _STANDARD / _BATCH (API keys, default the demo keys),
KVH_MODEL (default kvharbor/tiny-llama), KVH_TENANTS (tenants.yaml for acme's pinned prompt),
KVH_CANARIES (canaries.json from ``python -m loadtests.run``; unset: no canaries),
KVH_RECORDS (records.jsonl to append to), KVH_SHAPE (steady | ramp | overload; unset: use
Locust's -u/-r/-t), KVH_USERS (capacity-level users, default 5), KVH_DURATION (e.g. 60s).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import requests
from locust import LoadTestShape, User, between, events, task

from loadtests import canaries as canary_mod
from loadtests import client, shapes, workload
from loadtests.records import Recorder, make_record

MODEL = os.environ.get("KVH_MODEL", "kvharbor/tiny-llama")
INFO = workload.read_tenants(os.environ.get("KVH_TENANTS", "tenants.yaml"))
CANARIES = canary_mod.load(os.environ.get("KVH_CANARIES"))
RECORDER = Recorder(Path(os.environ["KVH_RECORDS"]) if os.environ.get("KVH_RECORDS") else None)


class CanaryMismatch(Exception):
    """A canary answer differed from the offline engine's."""


class KvhUser(User):
    """Common plumbing: one HTTP session, timing, Locust events and records per request."""

    abstract = True
    qos = "standard"
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.session = requests.Session()
        self.key = workload.api_key(self.qos)
        self.tenant = workload.TENANT_OF[self.qos]
        self.rng = random.Random()
        self.canaries = [c for c in CANARIES if c.qos == self.qos]
        self.canary(stream=True)           # every user checks one canary (streamed) as it starts

    def on_stop(self) -> None:
        self.session.close()

    def send(self, kind: str, path: str, body: dict, canary=None) -> client.Result:
        res = client.post(self.session, self.host, self.key, path, {"model": MODEL, **body})
        problem = None
        if canary is not None and res.ok:
            problem = canary_mod.mismatch(canary, res.text, res.completion_tokens)
        record = make_record(res, self.tenant, self.qos, kind, bool(body.get("stream")),
                             canary.name if canary else None, problem)
        RECORDER.add(record)
        self._fire(kind, res, record, problem, canary)
        return res

    def _fire(self, kind: str, res: client.Result, record: dict, problem: str | None, canary) -> None:
        fire = self.environment.events.request.fire
        ctx = {"tenant": self.tenant, "qos": self.qos, "kind": kind}
        error = None if res.ok else Exception(res.error or f"HTTP {res.status}")
        fire(request_type="SSE" if record["stream"] else "POST", name=f"{kind} {self.qos}",
             response_time=res.e2e_s * 1000.0, response_length=len(res.text), exception=error,
             context=ctx)
        if res.ok and res.ttft_s is not None:
            fire(request_type="TTFT", name=f"TTFT {self.qos}", response_time=res.ttft_s * 1000.0,
                 response_length=res.prompt_tokens, exception=None, context=ctx)
        if res.ok and res.itl_s is not None:
            fire(request_type="ITL", name=f"ITL {self.qos}", response_time=res.itl_s * 1000.0,
                 response_length=res.completion_tokens, exception=None, context=ctx)
        if canary is not None and res.ok:
            fire(request_type="CANARY", name=f"canary {canary.name}", response_time=res.e2e_s * 1000.0,
                 response_length=len(res.text), exception=CanaryMismatch(problem) if problem else None,
                 context=ctx)

    @task(1)
    def canary(self, stream: bool | None = None) -> None:
        """One canary of this profile, streamed or not at random (both paths must agree)."""
        if not self.canaries:
            return
        c = self.rng.choice(self.canaries)
        stream = self.rng.random() < 0.5 if stream is None else stream
        self.send("canary", "/v1/completions", canary_mod.body(c, MODEL, stream), c)


def _stream(messages: list[dict], max_tokens: int) -> dict:
    return {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.7}


class PremiumUser(KvhUser):
    """acme: support chats on the pinned system prompt; multi-turn chats resend their history."""

    weight = 1
    qos = "premium"

    def on_start(self) -> None:
        super().on_start()
        self.history: list[dict] = []
        self.last_answer = ""

    @task(5)
    def short_chat(self) -> None:
        self.send("chat", "/v1/chat/completions", _stream(workload.premium_messages(INFO, self.rng), 16))

    @task(4)
    def multi_turn(self) -> None:
        if not self.history or len(self.history) >= 10:
            messages = workload.premium_messages(INFO, self.rng)
        else:
            messages = workload.follow_up(self.history, self.last_answer, self.rng)
        res = self.send("multi_turn", "/v1/chat/completions", _stream(messages, 16))
        self.history, self.last_answer = (messages, res.text) if res.ok else ([], "")


class StandardUser(KvhUser):
    """globex: questions about long shared documents, and short chats."""

    weight = 2
    qos = "standard"

    @task(4)
    def document_question(self) -> None:
        self.send("document", "/v1/chat/completions", _stream(workload.document_question(self.rng), 24))

    @task(3)
    def short_chat(self) -> None:
        self.send("chat", "/v1/chat/completions", _stream(workload.short_chat(self.rng), 16))


class BatchUser(KvhUser):
    """initech: document summaries as raw completions (mostly not streamed)."""

    weight = 2
    qos = "batch"
    wait_time = between(0.5, 2.0)

    @task(3)
    def summarise(self) -> None:
        self.send("summary", "/v1/completions", {"prompt": workload.batch_prompt(self.rng),
                                                 "max_tokens": 32, "ignore_eos": True})

    @task(1)
    def summarise_streamed(self) -> None:
        self.send("summary", "/v1/completions", {"prompt": workload.batch_prompt(self.rng),
                                                 "max_tokens": 32, "ignore_eos": True, "stream": True,
                                                 "stream_options": {"include_usage": True}})


if os.environ.get("KVH_SHAPE"):
    class KvhShape(LoadTestShape):
        """The shape named by KVH_SHAPE over KVH_DURATION with KVH_USERS capacity-level users."""

        shape = os.environ["KVH_SHAPE"]
        duration_s = shapes.parse_duration(os.environ.get("KVH_DURATION", "60s"))
        users = int(os.environ.get("KVH_USERS", "5"))

        def tick(self):
            n = shapes.users_at(self.shape, self.get_run_time(), self.duration_s, self.users)
            return None if n is None else (n, float(max(1, self.users)))


@events.quitting.add_listener
def _exit_code(environment, **_kwargs) -> None:
    """Exit 1 on unexpected failures or canary mismatches only (429s are expected)."""
    environment.process_exit_code = 1 if RECORDER.unexpected or RECORDER.canary_mismatches else 0
    for line in RECORDER.canary_mismatches[:20]:
        print("CANARY MISMATCH:", line)
