"""A batch of prompts in one completions request, as the gateway runs it (fake replicas, no Ray):
each prompt's first choice is routed on its own and its other choices follow it to its replica."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvharbor.platform import generation
from kvharbor.platform.protocol import GenerateRequest


class Stream:
    """One replica call: the first event says which replica took it; the rest follow."""

    def __init__(self, log: list, request: GenerateRequest, replica: str) -> None:
        self.log, self.request, self.replica = log, request, replica

    def __aiter__(self):
        return self._events()

    async def _events(self):
        rid = self.request.request_id
        await asyncio.sleep(0.01)
        self.log.append(("first token", rid))
        yield {"token_ids": [7], "text": "a", "finish_reason": None, "replica_id": self.replica,
               "num_cached_tokens": len(self.request.prompt_token_ids) - 1}
        await asyncio.sleep(0.01)
        yield {"token_ids": [8], "text": "b", "finish_reason": "length", "replica_id": self.replica}

    def cancel(self) -> None:
        pass


class Replicas:
    """A fake LLM handle: an unpinned call goes to the next replica in turn, a pinned one to the
    replica named; every call is logged."""

    def __init__(self) -> None:
        self.log: list = []
        self.turn = 0

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request, replica_id=None):
        if replica_id is None:
            replica_id, self.turn = f"replica-{self.turn}", self.turn + 1
        self.log.append(("call", request.request_id, replica_id))
        return Stream(self.log, request, replica_id)


class NoMetrics:
    def __getattr__(self, name):
        return lambda *args: None


def _batch(prompts: list[list[int]], n: int) -> list[GenerateRequest]:
    """The siblings the gateway builds: choice ``p * n + j`` is prompt ``p``'s ``j``-th."""
    return [GenerateRequest(request_id="r" if p * n + j == 0 else f"r-{p * n + j}", tenant="t",
                            qos="standard", prompt_token_ids=ids, block_hashes=[], sampling={"max_tokens": 2})
            for p, ids in enumerate(prompts) for j in range(n)]


def test_each_prompt_leads_its_own_choices_to_the_replica_that_cached_it():
    replicas = Replicas()
    run = generation.GenerationRun(SimpleNamespace(llm=replicas, metrics=NoMetrics()),
                                   _batch([[1, 2, 3], [4, 5, 6, 7, 8]], n=2), None, None,
                                   chat=False, model="m", choices_per_prompt=2)

    async def go():
        return [(index, event["text"]) async for index, event in run.all_events()]

    events = asyncio.run(go())
    calls = [entry[1:] for entry in replicas.log if entry[0] == "call"]
    # the two prompts' first choices are routed at once, each on its own ...
    assert calls[:2] == [("r", "replica-0"), ("r-2", "replica-1")], replicas.log
    # ... and each prompt's second choice goes, pinned, to its own prompt's replica
    assert sorted(calls[2:]) == [("r-1", "replica-0"), ("r-3", "replica-1")], replicas.log
    log = replicas.log
    for leader, follower in (("r", "r-1"), ("r-2", "r-3")):     # once the leader's prompt is cached
        called = next(i for i, entry in enumerate(log) if entry[:2] == ("call", follower))
        assert log.index(("first token", leader)) < called, log
    assert sorted(events) == sorted((i, t) for i in range(4) for t in "ab")
    usage = run.usage()
    assert usage["prompt_tokens"] == 3 + 5                       # each prompt once
    assert usage["completion_tokens"] == 4 * 2
    assert usage["prompt_tokens_details"]["cached_tokens"] == 2 + 4      # each leader's hits
