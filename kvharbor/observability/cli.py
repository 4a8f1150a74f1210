"""``kvharbor dashboards generate|push``: write the dashboards, or upload them to Grafana.

Wiring: the ``kvharbor`` console script calls :func:`add_commands` on its subparsers; every
leaf command sets ``func`` (``args -> exit code``), so the caller runs ``args.func(args)``.
:func:`main` does the same on its own parser (used by tests and ``python -m``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_OUT = Path("dashboards")
DEFAULT_FOLDER = "kvharbor"
TOKEN_ENV = "GRAFANA_TOKEN"


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``dashboards`` command group to an argparse subparsers object."""
    group = subparsers.add_parser("dashboards", help="Grafana dashboards (generate, push)")
    actions = group.add_subparsers(dest="dashboards_command", required=True)

    gen = actions.add_parser("generate", help="write dashboards/*.json from the metric table")
    gen.add_argument("--out", type=Path, default=DEFAULT_OUT,
                     help="directory for the JSON files (default: dashboards/)")
    gen.set_defaults(func=_generate)

    push = actions.add_parser("push", help="upload every dashboard to a Grafana server")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push.add_argument("--token-file", type=Path,
                      help="file holding the Grafana service-account token (preferred)")
    push.add_argument("--token", help="the token itself (visible in `ps`; prefer --token-file "
                                      f"or the {TOKEN_ENV} environment variable)")
    push.add_argument("--folder", default=DEFAULT_FOLDER,
                      help=f"folder title to put them in, created if missing "
                           f"(default: {DEFAULT_FOLDER})")
    push.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout, seconds")
    push.set_defaults(func=_push)


def _generate(args: argparse.Namespace) -> int:
    from kvharbor.observability.dashboards import write_dashboards

    for path in write_dashboards(args.out):
        print(f"wrote {path}")
    return 0


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token-file, else --token, else $GRAFANA_TOKEN (None if none is set)."""
    if args.token_file is not None:
        return args.token_file.read_text().strip() or None
    return args.token or os.environ.get(TOKEN_ENV) or None


def _push(args: argparse.Namespace) -> int:
    from kvharbor.observability.push import PushError, push_dashboards

    try:
        token = _token(args)
    except OSError as exc:
        print(f"error: cannot read --token-file: {exc}", file=sys.stderr)
        return 2
    if token is None:
        print(f"error: no Grafana token: set {TOKEN_ENV}, or pass --token-file PATH",
              file=sys.stderr)
        return 2
    try:
        pushed = push_dashboards(args.url, token, args.folder, timeout_s=args.timeout)
    except PushError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for title in pushed:
        print(f"pushed {title!r} to folder {args.folder!r} at {args.url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``dashboards ...`` as if from the ``kvharbor`` command line; returns exit code."""
    parser = argparse.ArgumentParser(prog="kvharbor")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
