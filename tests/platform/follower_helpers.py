"""Test helpers for index followers: a shard the follower takes for a Ray actor, and a way to
run a follower loop for a moment."""

from __future__ import annotations

import asyncio

from kvharbor.actors.prefix_directory import DirectoryShard
from kvharbor.platform.index_follower import ActorShard


class CountingActorShard(ActorShard):
    """A shard that is a Ray actor to the follower (``ActorShard``), answered in-process,
    counting its polls."""

    def __init__(self) -> None:
        super().__init__("kvh-test-shard", None, timeout_s=1.0)
        self.polls, self.inner = 0, DirectoryShard()

    async def poll(self, epoch, cursor, max_entries):
        self.polls += 1
        return self.inner.poll(epoch, cursor, max_entries)


async def returns_within(loop_fn, seconds: float) -> bool:
    """Whether the coroutine ``loop_fn()`` returned within ``seconds`` (cancelled if not)."""
    task = asyncio.ensure_future(loop_fn())
    await asyncio.sleep(seconds)
    done = task.done()
    task.cancel()
    return done
