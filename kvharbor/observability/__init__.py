"""Observability: the metric table and recorder (``metrics``), Grafana dashboards generated
from it (``panels``, ``catalog``, ``dashboards``), their upload (``push``) and CLI (``cli``).

Import :func:`get_metrics` from :mod:`kvharbor.observability.metrics` in actor code; this
package's import does not pull in Ray or the Grafana SDK.
"""
