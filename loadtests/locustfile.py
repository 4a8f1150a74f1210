"""Locust load test for kvharbor: one user class per tenant profile, canaries, load shapes.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000          # web UI
    python -m loadtests.run --host http://127.0.0.1:8000 --shape steady     # headless + summary

Users (weights 1 : 2 : 2, so 20 % of users are premium):
  PremiumUser   acme / premium    short support chats and multi-turn chats that resend their
                                  history (one prompt_cache_key per conversation), all on the
                                  pinned system prompt; streamed
  StandardUser  globex / standard long-document questions (4 shared documents, each with its
                                  prompt_cache_key) and short chats; streamed
  BatchUser     initech / batch   document summaries as raw completions, mostly not streamed
Each user sends one of its profile's integrity canaries as it starts and then now and then
(see ``loadtests.canaries``).

Open loop (KVH_ARRIVAL_RATE set, or ``python -m loadtests.run --arrival-rate R``): one
``OpenLoopUser`` draws Poisson arrivals at R requests/s along KVH_SHAPE and sends each on its
own greenlet, mixing the three profiles 1 : 2 : 2, so arrivals never wait for answers; at most
KVH_MAX_IN_FLIGHT (default 256) are open at once, and arrivals beyond that are recorded as
``dropped``.

Every user is a ``FastHttpUser`` (geventhttpclient): far less client CPU per request than
``requests``, which matters on the machine that also runs the server.

Locust entries: ``<kind> <qos>`` (whole request, client-side end to end), ``TTFT <qos>`` and
``ITL <qos>`` (streamed requests only; ITL is the mean gap per token of one request),
``canary <name>``. A 429 is
reported as a failure entry but is *expected* under overload; the exit code counts only
unexpected failures (other errors, broken streams) and canary mismatches.

Environment: KVH_KEY_PREMIUM / _STANDARD / _BATCH (API keys, default the demo keys),
KVH_MODEL (default kvharbor/tiny-llama), KVH_TENANTS (tenants.yaml for acme's pinned prompt; default
./tenants.yaml, else the packaged example: the file `serve run kvharbor.app` reads from here),
KVH_CANARIES (canaries.json from ``python -m loadtests.run``; unset: no canaries),
KVH_RECORDS (records.jsonl to append to), KVH_SHAPE (steady | ramp | overload; unset: use
Locust's -u/-r/-t), KVH_USERS (capacity-level users, default 5), KVH_DURATION (e.g. 60s),
KVH_ARRIVAL_RATE (open loop, requests/s), KVH_MAX_IN_FLIGHT (open loop cap, default 256).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

from gevent.pool import Pool
from locust import LoadTestShape, between, constant, events, task
from locust.contrib.fasthttp import FastHttpUser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))    # `locust -f` from any directory

from kvharbor.tenants import default_tenants_path  # noqa: E402
from loadtests import canaries as canary_mod  # noqa: E402
from loadtests import client, shapes, workload  # noqa: E402
from loadtests.records import Recorder, make_record  # noqa: E402

MODEL = os.environ.get("KVH_MODEL", "kvharbor/tiny-llama")
INFO = workload.read_tenants(os.environ.get("KVH_TENANTS") or default_tenants_path())
CANARIES = canary_mod.load(os.environ.get("KVH_CANARIES"))
RECORDER = Recorder(Path(os.environ["KVH_RECORDS"]) if os.environ.get("KVH_RECORDS") else None)
ARRIVAL_RATE = float(os.environ.get("KVH_ARRIVAL_RATE") or 0)
MAX_IN_FLIGHT = int(os.environ.get("KVH_MAX_IN_FLIGHT", "256"))


class CanaryMismatch(Exception):
    """A canary answer differed from the offline engine's."""


class KvhUser(FastHttpUser):
    """Common plumbing: timing, Locust events and records per request. No tasks of its own."""

    abstract = True
    qos = "standard"
    network_timeout = 120.0
    connection_timeout = 30.0

    def send(self, kind: str, path: str, body: dict, canary=None, qos: str | None = None) -> client.Result:
        """One request as ``qos``'s tenant (default this user's class); records and reports it."""
        qos = qos or self.qos
        res = client.post_fast(self.client, workload.api_key(qos), path, {"model": MODEL, **body},
                               name=f"{kind} {qos}")
        problem = None
        if canary is not None and res.ok:
            problem = canary_mod.mismatch(canary, res.text, res.completion_tokens)
        RECORDER.add(make_record(res, workload.TENANT_OF[qos], qos, kind, bool(body.get("stream")),
                                 canary.name if canary else None, problem))
        self._fire(qos, res, problem, canary)
        return res

    def _fire(self, qos: str, res: client.Result, problem: str | None, canary) -> None:
        fire = self.environment.events.request.fire
        ctx = {"tenant": workload.TENANT_OF[qos], "qos": qos}
        if res.ok and res.ttft_s is not None:
            fire(request_type="TTFT", name=f"TTFT {qos}", response_time=res.ttft_s * 1000.0,
                 response_length=res.prompt_tokens, exception=None, context=ctx)
        if res.ok and res.itl_s is not None:
            fire(request_type="ITL", name=f"ITL {qos}", response_time=res.itl_s * 1000.0,
                 response_length=res.completion_tokens, exception=None, context=ctx)
        if canary is not None and res.ok:
            fire(request_type="CANARY", name=f"canary {canary.name}", response_time=res.e2e_s * 1000.0,
                 response_length=len(res.text), exception=CanaryMismatch(problem) if problem else None,
                 context=ctx)



class ProfileUser(KvhUser):
    """Closed loop: a user of one tenant profile sends, waits for the answer, thinks, repeats."""

    abstract = True
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random()
        self.canaries = [c for c in CANARIES if c.qos == self.qos]
        self.canary(stream=True)           # every user checks one canary (streamed) as it starts

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


def _summary_body(rng: random.Random, stream: bool) -> dict:
    body = {"prompt": workload.batch_prompt(rng), "max_tokens": 32, "ignore_eos": True}
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


def _premium_chat(rng):
    return "chat", "/v1/chat/completions", _stream(workload.premium_messages(INFO, rng), 16)


def _document_question(rng):
    """A question about one of 4 documents; questions about one document send one
    prompt_cache_key (OpenAI's advice for requests sharing a long prefix: they meet on a replica)."""
    k = rng.randrange(4)
    body = _stream(workload.document_question(rng, k=k), 24)
    return "document", "/v1/chat/completions", {**body, "prompt_cache_key": f"document-{k}"}


def _short_chat(rng):
    return "chat", "/v1/chat/completions", _stream(workload.short_chat(rng), 16)


def _summary(rng):
    return "summary", "/v1/completions", _summary_body(rng, stream=rng.random() < 0.25)


class PremiumUser(ProfileUser):
    """acme: support chats on the pinned system prompt; multi-turn chats resend their history."""

    weight = 1
    qos = "premium"

    def on_start(self) -> None:
        super().on_start()
        self.history: list[dict] = []
        self.last_answer = ""

    @task(5)
    def short_chat(self) -> None:
        self.send(*_premium_chat(self.rng))

    @task(4)
    def multi_turn(self) -> None:
        if not self.history or len(self.history) >= 10:
            messages = workload.premium_messages(INFO, self.rng)
            self.conversation = f"conversation-{self.rng.getrandbits(64):016x}"
        else:
            messages = workload.follow_up(self.history, self.last_answer, self.rng)
        body = {**_stream(messages, 16), "prompt_cache_key": self.conversation}   # its turns meet
        res = self.send("multi_turn", "/v1/chat/completions", body)
        self.history, self.last_answer = (messages, res.text) if res.ok else ([], "")


class StandardUser(ProfileUser):
    """globex: questions about long shared documents, and short chats."""

    weight = 2
    qos = "standard"

    @task(4)
    def document_question(self) -> None:
        self.send(*_document_question(self.rng))

    @task(3)
    def short_chat(self) -> None:
        self.send(*_short_chat(self.rng))


class BatchUser(ProfileUser):
    """initech: document summaries as raw completions (mostly not streamed)."""

    weight = 2
    qos = "batch"
    wait_time = between(0.5, 2.0)

    @task(3)
    def summarise(self) -> None:
        self.send("summary", "/v1/completions", _summary_body(self.rng, stream=False))

    @task(1)
    def summarise_streamed(self) -> None:
        self.send("summary", "/v1/completions", _summary_body(self.rng, stream=True))


# Open loop: (QoS class, weight, request makers) -- the closed-loop profiles' mix, 1 : 2 : 2.
OPEN_LOOP_MIX = (("premium", 1, (_premium_chat,)), ("standard", 2, (_document_question, _short_chat)),
                 ("batch", 2, (_summary,)))
CANARY_EVERY = 20           # every 20th arrival is an integrity canary


class OpenLoopUser(KvhUser):
    """Poisson arrivals at ``KVH_ARRIVAL_RATE`` along ``KVH_SHAPE``, each on its own greenlet.

    One instance runs (selected by ``loadtests.run --arrival-rate``); it never waits for an
    answer before the next arrival, so the offered load does not drop when the server slows.
    Bounded: arrivals stop at ``KVH_DURATION``, at most ``KVH_MAX_IN_FLIGHT`` are open (more
    are recorded as ``dropped``), and open ones get the stop timeout to finish.
    """

    abstract = not ARRIVAL_RATE            # only in open-loop runs
    fixed_count = 1
    wait_time = constant(0)
    concurrency = MAX_IN_FLIGHT            # FastHttpSession connections

    def on_start(self) -> None:
        self.rng = random.Random()
        self.canaries = list(CANARIES)
        self.pool = Pool(MAX_IN_FLIGHT)
        self.started = self.next_at = time.monotonic()
        self.arrivals = 0

    def on_stop(self) -> None:
        self.pool.join(timeout=60)

    @task
    def arrive(self) -> None:
        """Wait for the next arrival time, then send it without waiting for its answer.

        Arrival times are drawn on an absolute schedule, so a client that falls behind (a busy
        CPU) catches up instead of silently offering less load.
        """
        rate = shapes.rate_at(SHAPE or "steady", self.next_at - self.started, DURATION_S, ARRIVAL_RATE)
        if rate is None:
            self.pool.join(timeout=60)
            self.environment.runner.quit()
            return
        self.next_at += self.rng.expovariate(rate)
        time.sleep(max(0.0, self.next_at - time.monotonic()))   # gevent-patched: open requests run
        self.arrivals += 1
        qos, kind, path, body, canary = self._draw()
        if self.pool.full():
            RECORDER.add(make_record(client.Result(error="dropped: in-flight cap reached", dropped=True),
                                     workload.TENANT_OF[qos], qos, kind, bool(body.get("stream"))))
            return
        self.pool.spawn(self.send, kind, path, body, canary, qos)

    def _draw(self):
        """(qos, kind, path, body, canary) of the next arrival."""
        if self.canaries and self.arrivals % CANARY_EVERY == 1:
            c = self.rng.choice(self.canaries)
            return c.qos, "canary", "/v1/completions", canary_mod.body(c, MODEL, self.rng.random() < 0.5), c
        qos, _, makers = self.rng.choices(OPEN_LOOP_MIX, weights=[w for _, w, _ in OPEN_LOOP_MIX])[0]
        kind, path, body = self.rng.choice(makers)(self.rng)
        return qos, kind, path, body, None


SHAPE = os.environ.get("KVH_SHAPE")
DURATION_S = shapes.parse_duration(os.environ.get("KVH_DURATION", "60s"))

if SHAPE:
    class KvhShape(LoadTestShape):
        """The shape named by KVH_SHAPE over KVH_DURATION: KVH_USERS capacity-level users, or
        (open loop) the one OpenLoopUser, whose arrival rate follows the shape itself."""

        users = int(os.environ.get("KVH_USERS", "5"))

        def tick(self):
            t = self.get_run_time()
            if ARRIVAL_RATE:
                return None if t >= DURATION_S + 1 else (1, 1.0)
            n = shapes.users_at(SHAPE, t, DURATION_S, self.users)
            return None if n is None else (n, float(max(1, self.users)))


@events.quitting.add_listener
def _exit_code(environment, **_kwargs) -> None:
    """Exit 1 on unexpected failures or canary mismatches only (429s are expected)."""
    environment.process_exit_code = 1 if RECORDER.unexpected or RECORDER.canary_mismatches else 0
    for line in RECORDER.canary_mismatches[:20]:
        print("CANARY MISMATCH:", line)
