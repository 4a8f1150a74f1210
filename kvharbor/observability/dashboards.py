"""Render the kvharbor dashboards to Grafana JSON with ``grafana-foundation-sdk``.

The panels and their PromQL are data in :mod:`kvharbor.observability.catalog`; this module
turns each :class:`~kvharbor.observability.panels.DashboardSpec` into a Grafana dashboard
model through the SDK's builders and serialises it deterministically:

* uid = the spec's uid, file name ``<uid>.json``;
* panel ids are 1, 2, 3 ... in layout order (rows included), so they never change between
  runs;
* JSON with sorted keys, two-space indent and a trailing newline.

``render_all()`` is what ``kvharbor dashboards generate`` writes and what the tests compare
with the checked-in ``dashboards/*.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from kvharbor.observability.catalog import DASHBOARDS
from kvharbor.observability.panels import DashboardSpec, PanelSpec, series

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
REFRESH = "10s"
PANEL_HEIGHT = 8

# Template variables: (name, label, metric whose label values list the choices).
VARIABLES = (("tenant", "Tenant", "kvharbor_requests"),
             ("qos", "QoS class", "kvharbor_requests"),
             ("replica", "Replica", "kvharbor_kv_blocks"))


def _variables() -> list:
    """The datasource picker plus one multi-select regex variable per label."""
    out = [db.DatasourceVariable("datasource").label("Data source").type("prometheus")]
    for name, label, metric in VARIABLES:
        out.append(db.QueryVariable(name).label(label).datasource(DATASOURCE)
                   .query(f"label_values({series(metric)}, {name})")
                   .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                   .multi(True).include_all(True).all_value(".*"))
    return out


def _panel(spec: PanelSpec, panel_id: int):
    """One SDK panel builder with its targets (refIds A, B, ...)."""
    builder = stat.Panel() if spec.kind == "stat" else timeseries.Panel()
    builder = (builder.id(panel_id).title(spec.title).description(spec.description)
               .unit(spec.unit).datasource(DATASOURCE).height(PANEL_HEIGHT).span(spec.width))
    if spec.no_value is not None:
        builder = builder.no_value(spec.no_value)
    for index, query in enumerate(spec.queries):
        builder = builder.with_target(pb.Dataquery().expr(query.expr)
                                      .legend_format(query.legend).ref_id(chr(65 + index)))
    if spec.kind == "timeseries":
        mode = StackingMode.NORMAL if spec.stacked else StackingMode.NONE
        builder = builder.stacking(cb.StackingConfig().mode(mode))
        builder = builder.legend(cb.VizLegendOptions().show_legend(True)
                                 .display_mode("list").placement("bottom"))
    return builder


def build_dashboard(spec: DashboardSpec) -> dict:
    """Grafana dashboard JSON model (a plain dict) for ``spec``."""
    builder = (db.Dashboard(spec.title).uid(spec.uid).description(spec.description)
               .tags(["kvharbor"]).refresh(REFRESH).time("now-30m", "now")
               .timezone("browser").editable().variables(_variables()))
    next_id = 1
    for row_title, panels in spec.rows:
        builder = builder.with_row(db.Row(row_title).id(next_id))
        next_id += 1
        for panel in panels:
            builder = builder.with_panel(_panel(panel, next_id))
            next_id += 1
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def render(model: dict) -> str:
    """Deterministic text of a dashboard model (sorted keys, trailing newline)."""
    return json.dumps(model, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def render_all() -> dict[str, str]:
    """File name -> JSON text for every dashboard in the catalog."""
    return {f"{spec.uid}.json": render(build_dashboard(spec)) for spec in DASHBOARDS}


def write_dashboards(out_dir: Path) -> list[Path]:
    """Write every dashboard into ``out_dir`` (created if missing); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def load_dashboards(directory: Path) -> dict[str, dict]:
    """Checked-in dashboards in ``directory`` by file name (``*.json`` only)."""
    return {p.name: json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(directory.glob("*.json"))}


def panel_exprs(model: dict, rare: bool | None = None) -> list[str]:
    """Every PromQL ``expr`` of every panel of a dashboard model (rows flattened).

    ``rare=True`` keeps only panels of rare events (those with a ``noValue`` text: no series
    is a normal answer), ``rare=False`` only the others; ``None`` keeps all.
    """
    exprs: list[str] = []
    for panel in model.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            has_no_value = inner.get("fieldConfig", {}).get("defaults", {}).get("noValue") is not None
            if rare is None or rare == has_no_value:
                exprs.extend(t["expr"] for t in inner.get("targets", []) if t.get("expr"))
    return exprs


def variable_queries(model: dict) -> list[str]:
    """The ``label_values(...)`` queries of a dashboard's query variables."""
    return [v["query"] for v in model.get("templating", {}).get("list", [])
            if v.get("type") == "query"]
