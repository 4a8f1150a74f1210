"""A request that Serve cancels must not take the control plane's calls down with it.

Ray Serve cancels a request whose client went away by cancelling its Ray task recursively:
every actor call its coroutines submitted (and those of tasks they started) that has not
finished is cancelled too. Seen in CI: a gateway's fire-and-forget ``leave`` and ``release``
were cancelled that way before they were sent, and the class queue and admission actors
(synchronous, ordered per caller) then held back every later call of that gateway for 30 s
at a time: requests got 503 "did not answer within 5 s" for minutes.

Each case stands in for a gateway: an async actor whose ``request`` method is cancelled the
way Serve cancels one while an actor call it handed off still waits for its argument (it has
not been sent), then makes one more call. ``kvharbor.actors.calls.detached`` and
``start_background`` keep such calls out of the request. (The control-plane actors also run
calls in arrival order, so a call that never arrives would hold nothing back; Ray did not
leave such a hole in these runs, so that option has no test of its own.)
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from kvharbor.actors.calls import detached, start_background
from kvharbor.platform.class_queue import ClassQueueActor
from kvharbor.tenants.admission_actor import ActorAdmission, AdmissionActor


@ray.remote(num_cpus=0)
class Counter:
    """A synchronous actor with Ray's default: calls run in each caller's submission order."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def value(self) -> int:
        return self.n


@ray.remote(num_cpus=0)
class Gate:
    """Holds a value back until the test opens it, so a call that takes it is not sent before."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def value_when_open(self, value):
        await self.opened.wait()
        return value

    async def open(self) -> None:
        self.opened.set()


@ray.remote(num_cpus=0)
class FakeGateway:
    """``mode``: how ``request`` submits its call: "plain" (a child of the request),
    "detached" (``detached(handle)``), "background" (from a task ``start_background`` began),
    "task" (from a task ``create_task`` began: it copies the request's context), "facade"
    (the gateway's ``ActorAdmission`` over an admission actor: its method, not ``.remote``)."""

    def __init__(self, target, mode: str) -> None:
        self.mode = mode
        wrap = {"detached": detached, "facade": ActorAdmission}.get(mode, lambda t: t)
        self.target = wrap(target)
        self.outcome: list = []
        self.submitted = False

    async def request(self, arg_ref: list, method: str) -> None:
        if self.mode == "facade":
            getattr(self.target, method)(*arg_ref)               # fire and forget
        elif self.mode in ("plain", "detached"):
            getattr(self.target, method).remote(*arg_ref)        # fire and forget
        else:
            start = start_background if self.mode == "background" else asyncio.create_task
            start(self._await_call(arg_ref, method))
        self.submitted = True
        await asyncio.sleep(60)                                  # cancelled long before

    async def _await_call(self, arg_ref: list, method: str) -> None:
        try:
            self.outcome.append(await getattr(self.target, method).remote(*arg_ref))
        except Exception as e:  # noqa: BLE001 - recorded for the test
            self.outcome.append(type(e).__name__)

    async def next_call(self, method: str, *args) -> float:
        """Seconds until one more call from this caller is answered (TimeoutError after 8 s)."""
        start = time.monotonic()
        await asyncio.wait_for(getattr(self.target, method).remote(*args), 8)
        return time.monotonic() - start

    async def outcomes(self) -> list:
        return self.outcome

    async def has_submitted(self) -> bool:
        return self.submitted


def _cancel_mid_call(gateway, method: str, arg, *more_args) -> None:
    """Start ``request``, whose call waits for ``arg`` behind a closed gate (so it is not
    sent yet), cancel it as Serve cancels a request, then open the gate."""
    gate = Gate.remote()
    arg_ref = gate.value_when_open.remote(arg)
    ref = gateway.request.remote([arg_ref, *more_args], method)
    deadline = time.monotonic() + 60
    while not ray.get(gateway.has_submitted.remote(), timeout=30):
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)
    assert not ray.wait([arg_ref], timeout=0)[0], "the call's argument was ready: it was sent"
    ray.cancel(ref, recursive=True)
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(ref, timeout=10)
    ray.get(gate.open.remote(), timeout=10)
    assert ray.get(arg_ref, timeout=10) == arg


def _eventually(read, expected, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("mode, lands", [("detached", True), ("background", True),
                                         ("plain", False), ("task", False)])
def test_a_cancelled_request_does_not_cancel_the_calls_it_handed_off(ray_cluster, mode, lands):
    """With the helpers the handed-off call runs; without them (the hazard, so this test can
    fail) Ray cancels it with the request."""
    counter = Counter.remote()
    gateway = FakeGateway.remote(counter, mode)
    _cancel_mid_call(gateway, "add", 10)
    # One more call from the same caller: the actor runs a caller's calls in the order they
    # were submitted, so once it is answered the handed-off call has run or never will.
    # A caller held back waits 30 s; 8 s leaves room for a loaded CI machine.
    assert ray.get(gateway.next_call.remote("add", 1), timeout=15) < 8.0
    assert ray.get(counter.value.remote(), timeout=10) == (11 if lands else 1)
    if mode in ("background", "task"):
        expected = [10] if lands else ["TaskCancelledError"]
        assert _eventually(lambda: ray.get(gateway.outcomes.remote(), timeout=10), expected) \
            == expected


def test_a_cancelled_requests_leave_gives_its_class_queue_place_back_at_once(ray_cluster):
    """The gateway's fire-and-forget ``leave`` of a request whose client went away: the place
    is back right away, not only when its lease runs out (10 s)."""
    queue = ClassQueueActor.remote()
    assert ray.get(queue.enter.remote("standard", {"standard": 1}, 8, "rid-1"), timeout=30) is None
    gateway = FakeGateway.remote(queue, "detached")
    _cancel_mid_call(gateway, "leave", "standard")
    in_use = _eventually(lambda: ray.get(queue.snapshot.remote(), timeout=10).get("standard", 0), 0,
                         timeout_s=3.0)
    assert in_use == 0


def test_a_cancelled_requests_release_gives_its_slot_and_queue_place_back_at_once(ray_cluster):
    """The gateway's ``ActorAdmission.release_and_leave`` (fire and forget) from a request
    whose client went away: the tenant's slot and the class's queue place are back right away,
    with the tokens used charged, not only when the ticket's lease runs out."""
    actor = AdmissionActor.remote()
    one = {"max_concurrent_requests": 1}
    admitted = ray.get(actor.enter_and_admit.remote("standard", {"standard": 1}, 8, "t", one, 10, 5),
                       timeout=30)
    assert admitted.ok, admitted.reason
    gateway = FakeGateway.remote(actor, "facade")
    _cancel_mid_call(gateway, "release_and_leave", admitted.ticket, "standard", 12)
    in_use = _eventually(lambda: ray.get(actor.queue_snapshot.remote(), timeout=10)["standard"], 0,
                         timeout_s=3.0)
    usage = ray.get(actor.usage.remote("t"), timeout=10)
    assert (in_use, usage["in_flight"], usage["tokens_today"]) == (0, 0, 12)
