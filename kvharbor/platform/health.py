"""How many replicas of the LLM deployment run, as ``/healthz`` reports it.

With direct ingress the gateway serves HTTP before the LLM replicas finish loading, and a
request sent then waits for one; Serve's status says how many run. ``RunningReplicas`` asks
it at most every ``ttl_s`` and off the event loop (the controller call blocks), and says None
when Serve cannot say (outside Serve, or its controller did not answer in time), so health
does not flap on that.
"""

from __future__ import annotations

import asyncio
import time

from ray import serve

STATUS_TTL_S = 2.0      # Serve is asked for the LLM replicas at most this often


class RunningReplicas:
    """Running replicas of one deployment (``handle``: its ``DeploymentHandle``)."""

    def __init__(self, handle, ttl_s: float = STATUS_TTL_S) -> None:
        self.handle, self.ttl_s = handle, ttl_s
        self._seen: tuple[float, int] | None = None      # (when, running replicas)

    async def count(self) -> int | None:
        """The RUNNING replicas in Serve's status (cached for ``ttl_s``); None: Serve cannot say."""
        now = time.monotonic()
        if self._seen is not None and now - self._seen[0] < self.ttl_s:
            return self._seen[1]
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), timeout=5.0)
            app = status.applications[self.handle.app_name]
            running = app.deployments[self.handle.deployment_name].replica_states.get("RUNNING", 0)
        except Exception:  # noqa: BLE001 - not under Serve, controller slow or restarting
            return None
        self._seen = (now, running)
        return running
