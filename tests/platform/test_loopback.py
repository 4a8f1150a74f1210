"""What kvharbor itself opens listens on loopback only.

Ray's own servers are outside this promise: Ray 2.60 binds its GCS, raylet and metrics agent on
all interfaces even with ``--node-ip-address=127.0.0.1`` (docs/observability.md says how to fence
them). kvharbor's HTTP entry point is its own choice and must not be reachable from outside.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def listening_addresses(port: int) -> set[str]:
    """Local addresses of every TCP socket listening on ``port`` on this machine."""
    return {c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_http_entry_point_listens_on_loopback_only(kvharbor_app):
    addresses = listening_addresses(urlparse(kvharbor_app.base_url).port)
    assert addresses, "nothing listens on the app's port"
    assert addresses <= LOOPBACK, f"the HTTP proxy also listens on {sorted(addresses - LOOPBACK)}"


def test_the_serve_config_binds_http_to_loopback():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    assert config["applications"][0]["import_path"] == "kvharbor:build_app"
