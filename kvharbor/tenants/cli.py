"""``kvharbor tenants ...``: validate and edit tenants files, show tenants and their usage.

Wire into the top-level CLI with ``add_commands(subparsers)``; every leaf command sets
``args.func``, a callable ``func(args) -> int`` (the exit code). ``main(argv)`` runs the same
commands standalone (``python -m kvharbor.tenants.cli validate tenants.yaml``).

Plaintext keys are printed to stdout exactly once (by ``add``, ``rotate-key``,
``add-admin-key``) and never logged or written to the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from kvharbor.tenants.edit import EditError, NewKey, TenantsDocument
from kvharbor.tenants.keys import hash_key
from kvharbor.tenants.loader import TenantsFileError, load_tenants_file
from kvharbor.tenants.registry import describe_tenant
from kvharbor.tenants.schema import LIMIT_FIELDS, TenantsFile

DEFAULT_FILE = os.environ.get("KVHARBOR_TENANTS", "tenants.yaml")


def add_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``tenants`` command group to a top-level ``kvharbor`` parser's subparsers."""
    parser = subparsers.add_parser("tenants", help="validate and edit tenants.yaml",
                                   description=__doc__.splitlines()[0])
    _add_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``tenants`` subcommand, e.g. ``main(["validate", "tenants.yaml"])``."""
    parser = argparse.ArgumentParser(prog="kvharbor tenants")
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    return args.func(args)


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=lambda _args: (parser.print_help(), 2)[1])
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    file_opt = {"default": DEFAULT_FILE, "help": "tenants file (default: $KVHARBOR_TENANTS "
                "or ./tenants.yaml)"}

    p = sub.add_parser("validate", help="check a tenants file; errors show file:line: field")
    p.add_argument("file")
    p.set_defaults(func=cmd_validate)
    _add_edit_commands(sub, file_opt)
    _add_read_commands(sub, file_opt)


def _add_edit_commands(sub: argparse._SubParsersAction, file_opt: dict) -> None:
    p = sub.add_parser("add", help="add a tenant and print its new API key once")
    p.add_argument("name")
    p.add_argument("--qos", required=True, help="QoS class name")
    p.add_argument("--file", **file_opt)
    p.add_argument("--cache-scope", help="private | shared:<group> | public (default private)")
    p.add_argument("--allowed-model", action="append", dest="allowed_models", metavar="MODEL",
                   help="model the tenant may use (repeat; default: all models)")
    p.add_argument("--label", help="note stored with the key")
    for field in LIMIT_FIELDS:
        p.add_argument("--" + field.replace("_", "-"), type=int, dest=field, metavar="N")
    p.set_defaults(func=cmd_add)

    p = sub.add_parser("rotate-key", help="issue a new key; old keys expire or are revoked")
    p.add_argument("name")
    p.add_argument("--file", **file_opt)
    p.add_argument("--grace-hours", type=float, default=24.0,
                   help="old keys keep working this long (default 24)")
    p.add_argument("--revoke-old", action="store_true", help="refuse old keys immediately")
    p.add_argument("--label", help="note stored with the new key")
    p.set_defaults(func=cmd_rotate)

    p = sub.add_parser("revoke-key", help="refuse one key (by hash prefix) from now on")
    p.add_argument("name", nargs="?", help="tenant (omit with --admin)")
    p.add_argument("--hash-prefix", required=True, help="first hex chars of the key's hash")
    p.add_argument("--admin", action="store_true", help="revoke an admin key instead")
    p.add_argument("--reason", help="stored as the revoked value")
    p.add_argument("--file", **file_opt)
    p.set_defaults(func=cmd_revoke)

    p = sub.add_parser("add-admin-key", help="add an admin key and print it once")
    p.add_argument("--file", **file_opt)
    p.add_argument("--label")
    p.set_defaults(func=cmd_add_admin)


def _add_read_commands(sub: argparse._SubParsersAction, file_opt: dict) -> None:
    p = sub.add_parser("hash-key", help="print the SHA-256 digest of a key read from stdin")
    p.set_defaults(func=cmd_hash)

    p = sub.add_parser("show", help="show tenants (and live usage with --usage-url)")
    p.add_argument("name", nargs="?")
    p.add_argument("--file", **file_opt)
    p.add_argument("--usage-url", help="server base URL; fetches GET URL/admin/tenants")
    p.add_argument("--admin-key-file", type=Path,
                   help="file holding the admin key for --usage-url (preferred: not visible in `ps`)")
    p.add_argument("--admin-key", default=os.environ.get("KVHARBOR_ADMIN_KEY"),
                   help="admin key for --usage-url (default: $KVHARBOR_ADMIN_KEY; visible in `ps`, "
                        "prefer --admin-key-file or the variable)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_show)


# ---- commands --------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    try:
        config = load_tenants_file(args.file)
    except TenantsFileError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        print(f"{args.file}: INVALID ({len(exc.issues)} problem(s))", file=sys.stderr)
        return 1
    print(f"{args.file}: OK")
    print(_summary(config))
    return 0


def _summary(config: TenantsFile) -> str:
    from kvharbor.tenants.keys import DEMO_KEY_HASHES

    pinned = sum(t.pinned_kv_blocks for t in config.tenants.values())
    classes = [f"{n} (priority {c.priority}{', pinned' if c.pinned else ''})"
               for n, c in config.qos_classes.items()]
    lines = [f"  qos classes: {', '.join(classes)}",
             f"  tenants: {len(config.tenants)}  admin keys: {len(config.admin_keys)}  "
             f"pinned_kv_blocks total: {pinned}"]
    for name, t in config.tenants.items():
        lines.append(f"    {name}: qos={t.qos} keys={len(t.keys)} cache_scope={t.cache_scope}")
    hashes = [e.hash for t in config.tenants.values() for e in t.keys if not e.is_revoked()]
    hashes += [e.hash for e in config.admin_keys if not e.is_revoked()]
    if any(h in DEMO_KEY_HASHES for h in hashes):
        lines.append("  WARNING: public demo keys (kvh-demo-*) are active; revoke them before "
                     "exposing the server")
    return "\n".join(lines)


def _edit(args: argparse.Namespace, action) -> int:
    """Load, apply ``action(doc)`` (returns lines to print), save; 1 on any user error."""
    try:
        doc = TenantsDocument(args.file)
        out = action(doc)
        doc.save()
    except TenantsFileError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        print(f"{args.file}: not changed", file=sys.stderr)
        return 1
    except (EditError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(out))
    return 0


def _key_lines(new: NewKey) -> list[str]:
    return [f"  API key (shown once; store it now): {new.key}", f"  key id: {new.key_id}"]


def cmd_add(args: argparse.Namespace) -> int:
    limits = {f: getattr(args, f) for f in LIMIT_FIELDS if getattr(args, f) is not None}

    def action(doc: TenantsDocument) -> list[str]:
        new = doc.add_tenant(args.name, args.qos, cache_scope=args.cache_scope,
                             allowed_models=args.allowed_models, limits=limits, label=args.label)
        return [f"added tenant {args.name!r} (qos {args.qos}) to {args.file}", *_key_lines(new)]
    return _edit(args, action)


def cmd_rotate(args: argparse.Namespace) -> int:
    def action(doc: TenantsDocument) -> list[str]:
        new, changes = doc.rotate_key(args.name, grace=timedelta(hours=args.grace_hours),
                                      revoke_old=args.revoke_old, label=args.label)
        return [f"new key for tenant {args.name!r} in {args.file}", *_key_lines(new),
                *(f"  old key {c}" for c in changes)]
    return _edit(args, action)


def cmd_revoke(args: argparse.Namespace) -> int:
    if (args.name is None) != args.admin:
        print("error: give a tenant NAME, or --admin for an admin key", file=sys.stderr)
        return 2

    def action(doc: TenantsDocument) -> list[str]:
        key_id = doc.revoke_key(args.name, args.hash_prefix, args.reason)
        return [f"revoked key {key_id} of {args.name or 'admin_keys'} in {args.file}"]
    return _edit(args, action)


def cmd_add_admin(args: argparse.Namespace) -> int:
    def action(doc: TenantsDocument) -> list[str]:
        return [f"added admin key to {args.file}", *_key_lines(doc.add_admin_key(args.label))]
    return _edit(args, action)


def cmd_hash(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    if not key:
        print("error: pipe the key on stdin, e.g. `printf %s \"$KEY\" | kvharbor tenants "
              "hash-key`", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    try:
        config = load_tenants_file(args.file)
    except TenantsFileError as exc:
        print(exc, file=sys.stderr)
        return 1
    names = [args.name] if args.name else list(config.tenants)
    if args.name and args.name not in config.tenants:
        print(f"error: no tenant {args.name!r} in {args.file}", file=sys.stderr)
        return 1
    report = {n: describe_tenant(config, n) for n in names}
    if args.usage_url:
        key = args.admin_key_file.read_text().strip() if args.admin_key_file else args.admin_key
        usage = _fetch_usage(args.usage_url, key)
        if usage is None:
            return 1
        for n in names:
            report[n]["usage"] = usage.get(n)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        for n, r in report.items():
            print(f"{n}:")
            for k, v in r.items():
                print(f"  {k}: {json.dumps(v, default=str)}")
    return 0


def _fetch_usage(url: str, admin_key: str | None) -> dict | None:
    """GET ``url``/admin/tenants (each tenant's description with its ``usage``); returns
    tenant -> usage, or None after printing why not."""
    import httpx

    if not admin_key:
        print("error: --usage-url needs --admin-key (or $KVHARBOR_ADMIN_KEY)", file=sys.stderr)
        return None
    try:
        resp = httpx.get(url.rstrip("/") + "/admin/tenants", timeout=10.0,
                         headers={"Authorization": f"Bearer {admin_key}"})
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {url}: {exc}", file=sys.stderr)
        return None
    if resp.status_code != 200:
        print(f"error: {url}/admin/tenants answered {resp.status_code}: {resp.text[:200]}",
              file=sys.stderr)
        return None
    try:
        tenants = resp.json()["tenants"]
        return {name: entry["usage"] for name, entry in tenants.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        print(f"error: {url}/admin/tenants answered no tenants' usage (is it a kvharbor "
              f"server?): {resp.text[:200]}", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
