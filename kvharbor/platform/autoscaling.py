"""Autoscaling LLM replicas on ongoing requests, pinned classes' direct streams included.

``serve run kvharbor:build_app autoscaling='{"min_replicas": 1, "max_replicas": 4}'`` gives
the ``LLMReplica`` deployment Serve's ``autoscaling_config`` (any of its fields: target,
delays, factors, look-back) in place of a fixed ``replicas``. Serve's default policy sizes a
deployment by its ongoing requests, which it counts at the handles and replicas: a request
of a pinned class that streams straight from the gateway to its replica over TCP
(``kvharbor.platform.direct_stream``) never crosses either, so under premium load alone
Serve would see an idle deployment and never scale it up (or scale it down under the load).

So each replica reports its open direct streams (``LLMReplica.record_autoscaling_stats``,
Serve's custom-metrics hook, metric ``DIRECT_STREAMS``) and ``ongoing_requests_policy``,
the policy kvharbor sets, sizes the deployment as Serve's default does on their sum::

    desired replicas = (Serve's ongoing requests + open direct streams) / target_ongoing_requests

Serve's wrapper around a custom policy still applies the config's bounds, scaling factors
and up/down delays, as for its own. A new replica is routed to once Serve lists it to the
routers (direct streams once its routing stats carry its address), and its KV events reach
the prefix directory as any replica's do; a replica scaled down drains its direct streams
first (``LLMReplica.__del__``). Measured on the 2-core VM (``tests/platform/
test_autoscaling.py`` and ``serve run`` with premium HTTP traffic): a second replica running
12-13 s after the streams began, requests then split between both.
"""

from __future__ import annotations

from typing import Any

from kvharbor.config import json_option

DIRECT_STREAMS = "kvharbor_direct_streams"
"""The custom autoscaling metric: direct streams open on a replica."""
POLICY = "kvharbor.platform.autoscaling:ongoing_requests_policy"


def ongoing_requests_policy(ctx) -> tuple[float, dict]:
    """Serve's replica-queue-length policy on ongoing requests plus open direct streams.

    Args:
        ctx: Serve's ``AutoscalingContext`` of the ``LLMReplica`` deployment.
    Returns:
        (desired replicas, before Serve applies bounds, factors and delays; policy state).
    """
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    direct = sum((ctx.aggregated_metrics or {}).get(DIRECT_STREAMS, {}).values())
    return (ctx.total_num_requests + direct) / ctx.config.get_target_ongoing_requests(), {}


def parse(value: Any) -> dict | None:
    """``build_app``'s ``autoscaling`` option (a dict, or its JSON on the command line) as
    Serve's ``autoscaling_config`` for the LLM replicas, with kvharbor's policy.

    Raises:
        ValueError: not JSON, a field Serve's ``AutoscalingConfig`` lacks or refuses, a
            ``policy`` of the caller's own, or ``min_replicas`` 0 (scaling the LLM replicas to
            zero is not supported: never tested with the routers, the directory and direct
            streams).
    """
    if value is None:
        return None
    value = json_option(value, "autoscaling", '{"min_replicas": 1, "max_replicas": 4}')
    if not isinstance(value, dict):
        raise ValueError(f"autoscaling takes an object of Serve's autoscaling_config fields, "
                         f"got {type(value).__name__}")
    if "policy" in value:
        raise ValueError("autoscaling sets its own policy (it counts direct streams); leave out 'policy'")
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"autoscaling: unknown fields {unknown}; Serve's autoscaling_config has "
                         f"{sorted(set(AutoscalingConfig.model_fields) - {'policy'})}")
    config = {**value, "policy": {"policy_function": POLICY}}
    try:
        checked = AutoscalingConfig(**config)
    except Exception as e:  # noqa: BLE001 - Serve's pydantic error, reworded
        raise ValueError(f"autoscaling: {e}") from None
    if checked.min_replicas < 1:
        raise ValueError("autoscaling: min_replicas must be at least 1 (kvharbor does not scale "
                         "its LLM replicas to zero)")
    return config
