"""Test helpers: a light PromQL reader and a throwaway Prometheus on loopback.

``series_in(expr)`` lists the metric names a dashboard expression selects, with the label
names each selector uses; it knows enough PromQL for the expressions kvharbor generates
(functions, ``by (...)``, ``[range]``, ``or``) and reports any other bare identifier as a
metric name, so a typo such as ``kvharbor_requests_total`` (missing ``ray_``) is caught.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "vector", "or", "and", "unless",
    "by", "without", "max", "min", "avg", "count", "clamp_min", "clamp_max", "on",
    "ignoring", "group_left", "group_right", "label_values",
}
VARIABLES = {"$__rate_interval": "1m", "$tenant": ".*", "$qos": ".*", "$replica": ".*"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)")


def substitute(expr: str, **values: str) -> str:
    """Replace Grafana template variables (``$tenant`` ...) with values Prometheus accepts.

    ``values`` overrides a variable by name, e.g. ``substitute(expr, tenant="acme")``.
    """
    table = {**VARIABLES, **{f"${name}": value for name, value in values.items()}}
    for var in sorted(table, key=len, reverse=True):
        expr = expr.replace(var, table[var])
    return expr


def series_in(expr: str) -> dict[str, set[str]]:
    """Metric name -> label names used in its selectors, for every metric in ``expr``."""
    found: dict[str, set[str]] = {}
    for name, body in _SELECTOR.findall(expr):
        labels = {part.split("=")[0].split("!")[0].strip() for part in body.split(",") if part}
        found.setdefault(name, set()).update(labels)
    bare = _SELECTOR.sub(lambda m: m.group(1), _STRING.sub('""', expr))
    bare = _GROUPING.sub(" ", re.sub(r"\[[^\]]*\]", " ", bare))
    for name in _IDENT.findall(bare):
        if name not in PROMQL_WORDS and not name.replace("_", "").isdigit():
            found.setdefault(name, set())
    return found


def grouping_labels(expr: str) -> set[str]:
    """Label names in every ``by (...)`` clause of ``expr``."""
    return {label.strip() for group in _GROUPING.findall(expr)
            for label in group.split(",") if label.strip()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """A ``prometheus`` process scraping ``target`` every second, listening on loopback."""

    def __init__(self, workdir: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus (Debian package `prometheus`) is not installed")
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: kvharbor-test\n    static_configs: [{{targets: ['{target}']}}]\n")
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def query(self, expr: str) -> list[dict]:
        """Instant query result (raises on a PromQL error)."""
        body = self.api("query", query=expr)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def wait_all_return_series(prom: Prometheus, exprs: list[str], timeout_s: float,
                           **values: str) -> dict[str, int]:
    """Poll until every expression (variables substituted, see ``substitute``) returns
    >= 1 series. Returns expr -> number of series at the last poll (0s stay on timeout).
    """
    deadline = time.monotonic() + timeout_s
    counts: dict[str, int] = {}
    while True:
        counts = {expr: len(prom.query(substitute(expr, **values))) for expr in exprs}
        if all(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(1.0)
