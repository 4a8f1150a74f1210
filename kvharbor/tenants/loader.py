"""Read ``tenants.yaml`` into a :class:`TenantsFile`, reporting every error with its line.

Each problem becomes a :class:`ConfigIssue` (file, 1-based line, field path, message). The
loader parses with ruamel.yaml's round-trip loader because its nodes remember their line
numbers; a pydantic error location such as ``("tenants", "acme", "keys", 0, "hash")`` is
walked through the parsed document to find the line of the deepest part that exists.

Messages never echo the offending value: a plaintext key pasted into a ``hash`` field must
not reach a log.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from kvharbor.tenants.schema import Loc, TenantsFile, cross_field_issues


@dataclass(slots=True, frozen=True)
class ConfigIssue:
    """One problem in a tenants file; ``line`` is 1-based, None when unknown."""

    source: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        return f"{where}: {self.path or '<file>'}: {self.message}"


class TenantsFileError(ValueError):
    """A tenants file failed to parse or validate; ``issues`` lists every problem found."""

    def __init__(self, source: str, issues: list[ConfigIssue]):
        self.source = source
        self.issues = sorted(issues, key=lambda issue: issue.line or 0)
        super().__init__(f"{source}: {len(issues)} problem(s):\n"
                         + "\n".join(map(str, self.issues)))


def round_trip_yaml() -> YAML:
    """The one ruamel configuration used to read and rewrite tenants files (keeps comments)."""
    yaml = YAML(typ="rt")
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.preserve_quotes = True
    yaml.width = 100
    yaml.representer.add_representer(type(None), _represent_null)
    return yaml


def _represent_null(representer: Any, _data: None) -> Any:
    """Write ``null`` (ruamel's default writes nothing, which reads as a missing value)."""
    return representer.represent_scalar("tag:yaml.org,2002:null", "null")


def parse_tenants_text(text: str, source: str = "<string>") -> TenantsFile:
    """Parse and validate YAML text. Raises :class:`TenantsFileError` listing all problems."""
    try:
        doc = round_trip_yaml().load(io.StringIO(text))
    except YAMLError as exc:
        raise TenantsFileError(source, [_yaml_issue(source, exc)]) from None
    if not isinstance(doc, dict):
        raise TenantsFileError(source, [ConfigIssue(source, 1, "", "expected a mapping with "
                                                    "qos_classes, tenants, admin_keys, defaults")])
    try:
        parsed = TenantsFile.model_validate(doc, context={"defer_cross_checks": True})
    except ValidationError as exc:
        issues = _pydantic_issues(source, doc, exc) + _raw_qos_issues(source, doc)
        raise TenantsFileError(source, issues) from None
    issues = [_issue(source, doc, loc, msg) for loc, msg in cross_field_issues(parsed)]
    issues += [_issue(source, doc, loc, msg) for loc, msg in _adapter_path_issues(parsed, source)]
    if issues:
        raise TenantsFileError(source, issues)
    return parsed


def _adapter_path_issues(parsed: TenantsFile, source: str) -> list[tuple[tuple, str]]:
    """LoRA adapters whose directory holds no ``adapter_config.json`` (read from the file's
    directory; for text without a file, the working directory)."""
    base = Path(source).parent if Path(source).is_file() else Path.cwd()
    return [(("lora_adapters", name, "path"), f"{path} holds no adapter_config.json (a PEFT LoRA "
                                               "checkpoint directory)")
            for name, path in parsed.lora_adapter_paths(base).items()
            if not (Path(path) / "adapter_config.json").is_file()]


def load_tenants_file(path: str | Path) -> TenantsFile:
    """Read and validate the file at ``path``. Raises :class:`TenantsFileError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TenantsFileError(str(path), [ConfigIssue(str(path), None, "",
                                                       f"cannot read: {exc.strerror}")]) from None
    return parse_tenants_text(text, str(path))


def _yaml_issue(source: str, exc: YAMLError) -> ConfigIssue:
    mark = getattr(exc, "problem_mark", None) if isinstance(exc, MarkedYAMLError) else None
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return ConfigIssue(source, line, "", f"YAML syntax: {problem}")


def _pydantic_issues(source: str, doc: Any, exc: ValidationError) -> list[ConfigIssue]:
    merged: dict[tuple, list[str]] = {}
    for err in exc.errors(include_input=False, include_url=False):
        loc = _trim_loc(doc, err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        if msg not in merged.setdefault(loc, []):
            merged[loc].append(msg)
    return [_issue(source, doc, loc, " or ".join(msgs)) for loc, msgs in merged.items()]


def _raw_qos_issues(source: str, doc: Any) -> list[ConfigIssue]:
    """Unknown QoS names, found on the raw document when other errors stop full validation."""
    classes, tenants = doc.get("qos_classes"), doc.get("tenants")
    if not isinstance(classes, dict) or not classes or not isinstance(tenants, dict):
        return []
    return [_issue(source, doc, ("tenants", name, "qos"), f"unknown QoS class {t['qos']!r}; "
                   f"define it under qos_classes or use one of {sorted(classes)}")
            for name, t in tenants.items()
            if isinstance(t, dict) and isinstance(t.get("qos"), str) and t["qos"] not in classes]


def _trim_loc(doc: Any, loc: tuple) -> Loc:
    """Drop pydantic's union/validator tags: keep the parts that walk the document."""
    kept: list[str | int] = []
    node = doc
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and not part.startswith("["):
            kept.append(part)   # a missing or unknown field: name it, then stop
            break
        else:
            break
        kept.append(part)
    return tuple(kept)


def _issue(source: str, doc: Any, loc: Loc, msg: str) -> ConfigIssue:
    return ConfigIssue(source, _line_of(doc, loc), ".".join(map(str, loc)), msg)


def _line_of(doc: Any, loc: Loc) -> int | None:
    """1-based line of the deepest part of ``loc`` present in the round-trip document."""
    node, line = doc, (doc.lc.line + 1 if hasattr(doc, "lc") else None)
    for part in loc:
        lc = getattr(node, "lc", None)
        try:
            if isinstance(node, dict) and part in node:
                line = lc.key(part)[0] + 1 if lc else line
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                line = lc.item(part)[0] + 1 if lc else line
            else:
                return line
        except (KeyError, AttributeError, TypeError):
            return line
        node = node[part]
    return line
