"""What the kvharbor dashboards show: panels and their PromQL, as plain data.

Rendering to Grafana JSON lives in :mod:`kvharbor.observability.dashboards`; this module only
says *what* to plot. Every series name goes through :func:`series`, which refuses a name that
is not in :data:`~kvharbor.observability.metrics.METRICS` (or a suffix its kind does not
export), so a dashboard cannot query a metric that does not exist.

Conventions:

* Template variables ``$tenant``, ``$qos``, ``$replica`` are multi-select regexes (``.*`` for
  All), used as ``label=~"$var"``.
* Ray adds per-process labels (``WorkerId``, ``SessionName`` ...), so every query aggregates
  with ``sum by (...)`` over the labels it plots.
* Panels of rare events (errors, rate limits, preemptions, evictions) set Grafana's
  ``noValue`` to "0": a Ray counter has no series until its first increment, and "0" reads
  better than "No data". Their queries stay honest: no ``or vector(0)``, which would also
  turn a metric that is missing altogether (renamed, never exported) into a flat 0. Ratios
  use ``(a or 0 * b) / b`` so a group whose numerator never moved shows 0 while the
  denominator exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvharbor.observability.metrics import METRICS_BY_NAME, scraped_names

RATE = "$__rate_interval"


def series(name: str, suffix: str = "") -> str:
    """Scraped series name of metric ``name`` (e.g. ``ray_kvharbor_requests_total``).

    ``suffix`` selects a histogram's ``_bucket``/``_sum``/``_count``; counters and gauges
    take none. Raises ``KeyError`` for an unknown metric or a suffix its kind lacks.
    """
    spec = METRICS_BY_NAME[name]
    names = scraped_names(spec)
    if spec.kind == "counter" and not suffix:
        return names[0]
    full = f"ray_{name}{suffix}"
    if full not in names:
        raise KeyError(f"{name} ({spec.kind}) exports {names}, not {full}")
    return full


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target and its legend (``{{label}}`` templates allowed)."""

    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class PanelSpec:
    """One panel. ``kind`` is ``timeseries`` or ``stat``; ``unit`` a Grafana unit id."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"
    width: int = 12
    stacked: bool = False
    no_value: str | None = None    # Grafana's text when the queries return no series


@dataclass(frozen=True, slots=True)
class DashboardSpec:
    """One dashboard: a stable uid (the file name too) and rows of panels."""

    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[PanelSpec, ...]], ...]


def _sel(*pairs: str) -> str:
    """Label selector from ``'tenant=~"$tenant"'``-style pairs."""
    return "{" + ",".join(pairs) + "}"


TQ = _sel('tenant=~"$tenant"', 'qos=~"$qos"')
T = _sel('tenant=~"$tenant"')
R = _sel('replica=~"$replica"')
RQ = _sel('replica=~"$replica"', 'qos=~"$qos"')


def rate_sum(name: str, by: str, sel: str = "", suffix: str = "") -> str:
    """``sum by (by) (rate(series{sel}[$__rate_interval]))``."""
    return f"sum by ({by}) (rate({series(name, suffix)}{sel}[{RATE}]))"


def quantile(q: float, name: str, by: str, sel: str = "") -> str:
    """``histogram_quantile`` of histogram ``name`` grouped by ``by``."""
    inner = rate_sum(name, f"le, {by}" if by else "le", sel, "_bucket")
    return f"histogram_quantile({q}, {inner})"


def ratio(num: str, den: str) -> str:
    """``num / den`` that shows 0 (not nothing) for groups where ``num`` has no series."""
    return f"({num} or 0 * {den}) / {den}"


def latency_panel(title: str, name: str, by: str, sel: str, description: str) -> PanelSpec:
    """p50 and p99 of a latency histogram, one line per ``by`` group."""
    return PanelSpec(title, description, "s", (
        Query(quantile(0.5, name, by, sel), f"p50 {{{{{by}}}}}"),
        Query(quantile(0.99, name, by, sel), f"p99 {{{{{by}}}}}")))


def hit_rate_panel(title: str, by: str, sel: str) -> PanelSpec:
    """Share of prompt tokens served from the KV cache, per ``by`` group."""
    expr = ratio(rate_sum("kvharbor_cached_prompt_tokens", by, sel),
                 rate_sum("kvharbor_prompt_tokens", by, sel))
    return PanelSpec(title, "Cached prompt tokens / prompt tokens.", "percentunit",
                     (Query(expr, f"{{{{{by}}}}}"),))
