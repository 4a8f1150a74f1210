"""Beyond a class's max_queue the gateway sheds load (429 + Retry-After), lower classes first."""

from __future__ import annotations

import contextlib

import httpx

from tests.reliability.helpers import DEMO, assert_openai_error, edited_tenants, rand_text, wait_idle

MAX_QUEUE = 4
HOLD = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}


def _lower_max_queue(doc) -> None:
    for cls in doc["qos_classes"].values():
        cls["max_queue"] = MAX_QUEUE


def _in_flight(app) -> dict[str, int]:
    r = httpx.get(app.base_url + "/admin/tenants/status", headers={"Authorization": f"Bearer {DEMO['admin']}"})
    return {k: v for k, v in r.json()["in_flight_by_qos"].items() if v}


class Holder:
    """Opens streams that stay in flight until ``close``; records each answer's status."""

    def __init__(self, app) -> None:
        self.app, self.stack = app, contextlib.ExitStack()
        self.lines: list = []
        self.first: list[str] = []

    def open(self, qos: str, seed: int):
        client = self.stack.enter_context(self.app.client(DEMO[qos]))
        r = self.stack.enter_context(client.stream("POST", "/v1/completions", json={
            "model": self.app.model, "prompt": rand_text(32, seed), **HOLD}))
        if r.status_code == 200:          # admitted: wait for its first token
            lines = r.iter_lines()        # kept: dropping the iterator closes the stream
            self.lines.append(lines)
            self.first.append(next(line for line in lines if line.startswith("data: "))[:300])
        else:
            r.read()
        return r

    def ended(self) -> list[str]:
        """The last lines of streams that already ended (for failure messages)."""
        out = []
        for lines in self.lines:
            tail = []
            for line in lines:
                tail = (tail + [line])[-3:]
                if line == "data: [DONE]":
                    out.append(" | ".join(t[:200] for t in tail))
                    break
                if len(tail) >= 3 and '"finish_reason": null' in tail[-1]:
                    break                   # still generating
        return out

    def close(self) -> None:
        self.lines.clear()
        self.stack.close()


def test_lower_classes_are_shed_first_and_premium_keeps_its_queue(kvharbor_app):
    with edited_tenants(kvharbor_app, _lower_max_queue):
        hold = Holder(kvharbor_app)
        try:
            batch = [hold.open("batch", i) for i in range(3)]
            standard = [hold.open("standard", 10 + i) for i in range(3)]
            assert [r.status_code for r in batch + standard] == [200] * 6
            assert _in_flight(kvharbor_app) == {"batch": 3, "standard": 3}, hold.ended()
            # 6 in flight: batch waits behind all 6 (>= 4), standard behind its own 3 (< 4)
            refused_batch = hold.open("batch", 3)
            assert_openai_error(refused_batch, 429, "queue_full", ("batch", "max_queue 4"))
            assert int(refused_batch.headers["retry-after"]) >= 1
            assert hold.open("standard", 13).status_code == 200
            refused_standard = hold.open("standard", 14)
            assert_openai_error(refused_standard, 429, "queue_full", ("standard",))
            assert "retry-after" in refused_standard.headers
            # premium waits behind premium only: 4 more are admitted with 7 others in flight
            premium = [hold.open("premium", 20 + i) for i in range(MAX_QUEUE)]
            assert [r.status_code for r in premium] == [200] * MAX_QUEUE
            assert_openai_error(hold.open("premium", 30), 429, "queue_full", ("premium",))
        finally:
            hold.close()
        wait_idle(kvharbor_app)
        # the queues drained: each class is admitted again
        for qos in ("batch", "standard", "premium"):
            with kvharbor_app.client(DEMO[qos]) as c:
                r = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": "ok", "max_tokens": 1})
                assert r.status_code == 200, (qos, r.text)
