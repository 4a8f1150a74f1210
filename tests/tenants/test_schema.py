"""tenants.yaml schema: the example is valid; each kind of mistake is reported with its line."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvharbor.tenants.keys import DEMO_KEYS
from kvharbor.tenants.loader import TenantsFileError, load_tenants_file, parse_tenants_text
from kvharbor.tenants.schema import TenantsFile

from .conftest import EXAMPLE, PACKAGED

GOOD = """\
qos_classes:
  gold:
    priority: 10
    pinned: true
  bronze:
    priority: 1
defaults:
  requests_per_minute: 60
  max_tokens_per_request: 100
tenants:
  a:
    qos: gold
    keys:
      - "{h1}"
  b:
    qos: bronze
    requests_per_minute: null
    keys:
      - hash: "{h2}"
"""


def good() -> str:
    return GOOD.format(h1="1" * 64, h2="2" * 64)


def only_issue(text: str):
    with pytest.raises(TenantsFileError) as info:
        parse_tenants_text(text, "t.yaml")
    assert len(info.value.issues) == 1, info.value.issues
    return info.value.issues[0]


def test_example_file_is_valid_and_packaged_copy_identical():
    config = load_tenants_file(EXAMPLE)
    assert EXAMPLE.read_text() == PACKAGED.read_text()
    assert set(config.qos_classes) == {"premium", "standard", "batch"}
    assert config.qos_classes["premium"].pinned
    assert config.qos_classes["batch"].preemptible
    prio = {n: c.priority for n, c in config.qos_classes.items()}
    assert prio["premium"] > prio["standard"] > prio["batch"]
    assert sorted(t.qos for t in config.tenants.values()) == ["batch", "premium", "standard"]
    assert any(t.cache_scope.startswith("shared:") for t in config.tenants.values())
    premium = next(t for t in config.tenants.values() if t.qos == "premium")
    assert premium.pinned_prefixes and premium.pinned_kv_blocks > 0


def test_example_stores_demo_keys_only_as_hashes():
    text = EXAMPLE.read_text()
    for key, digest in DEMO_KEYS.items():
        assert key not in text
        assert digest in text


def test_omitted_limits_inherit_defaults_and_null_means_unlimited():
    config = parse_tenants_text(good())
    assert config.limits_for("a").requests_per_minute == 60
    assert config.limits_for("b").requests_per_minute is None
    assert config.limits_for("b").max_tokens_per_request == 100


@pytest.mark.parametrize("old,new,line,path,words", [
    ("    priority: 1\n", "    priority: 1\n    prioirty: 2\n", 7, "qos_classes.bronze.prioirty",
     "unknown field"),
    ("qos: bronze", "qos: silver", 16, "tenants.b.qos", "unknown QoS class 'silver'"),
    ("qos: bronze", "qos: bronze\n    pinned_kv_blocks: 8", 17, "tenants.b.pinned_kv_blocks",
     "not pinned"),
    ("qos: bronze", "qos: bronze\n    cache_scope: shared", 17, "tenants.b.cache_scope",
     "shared:<group>"),
    ("2" * 64, "1" * 64, 19, "tenants.b.keys.0.hash", "already used at tenants.a.keys.0.hash"),
    ("  requests_per_minute: 60", "  requests_per_minute: 0", 8,
     "defaults.requests_per_minute", "greater than or equal to 1"),
    ("  a:\n", "  bad name:\n", 11, "tenants.bad name", "pattern"),
    ("  a:\n", "  _a:\n", 11, "tenants._a", "pattern"),          # a name starts alphanumeric
    ("qos: bronze", 'qos: bronze\n    pinned_prefixes: ["You are a helpful assistant."]', 17,
     "tenants.b.pinned_prefixes", "pinned prefixes need a class with `pinned: true`"),
    ("qos: bronze", 'qos: bronze\n    cache_scope: "shared:"', 17, "tenants.b.cache_scope",
     "shared:<group>"),
    ("qos: bronze", 'qos: bronze\n    cache_scope: "shared:a b"', 17, "tenants.b.cache_scope",
     "shared:<group>"),
    ("tenants:\n", f'admin_keys:\n  - "{"2" * 64}"\ntenants:\n', 21, "tenants.b.keys.0.hash",
     "already used at admin_keys.0.hash"),
    ("    priority: 1\n", "    priority: 1\n    max_queue: -1\n", 7, "qos_classes.bronze.max_queue",
     "greater than or equal to 0"),
    ("1" * 64, "A" * 64, 14, "tenants.a.keys.0", "lowercase 64-char SHA-256 hex digest"),
    ("1" * 64, "1" * 65, 14, "tenants.a.keys.0", "lowercase 64-char"),   # one digit too many
    (f'      - "{"1" * 64}"\n', f'      - "{"1" * 64}"\n      - "{"3" * 63}"\n', 15,
     "tenants.a.keys.1", "lowercase 64-char"),                      # the line of the item
    ("priority: 10", "priority: high", 3, "qos_classes.gold.priority", "valid integer"),
    ("    qos: bronze\n", "", 15, "tenants.b.qos", "Field required"),   # missing: named, its parent's line
    (f'      - hash: "{"2" * 64}"\n', f'      - hash: "{"2" * 64}"\n        revoked: [1]\n', 20,
     "tenants.b.keys.0.revoked", "a valid boolean or Input should be a valid string"),   # each union branch
])
def test_mistakes_are_reported_with_line_and_field(old, new, line, path, words):
    issue = only_issue(good_replace(old, new))
    assert (issue.line, issue.path) == (line, path)
    assert words in issue.message and not issue.message.startswith("Value error")
    assert str(issue).startswith(f"t.yaml:{line}: {path}: ")


def good_replace(old: str, new: str) -> str:
    text = good()
    assert old in text
    return text.replace(old, new, 1)


def test_several_mistakes_are_all_reported_in_line_order():
    text = good_replace("qos: bronze", "qos: silver").replace("priority: 10", "priority: high")
    with pytest.raises(TenantsFileError) as info:
        parse_tenants_text(text, "t.yaml")
    assert [i.line for i in info.value.issues] == [3, 16]


def test_yaml_syntax_error_has_a_line():
    issue = only_issue(good() + "  c: [unclosed\n")                 # 21 lines: the stream ends on 21
    assert (issue.line, issue.message) == (21, "YAML syntax: expected ',' or ']', but got '<stream end>'")
    issue = only_issue(good().replace("tenants:", "tenants: : :"))
    assert (issue.line, issue.message) == (10, "YAML syntax: mapping values are not allowed here")


def test_plaintext_key_in_hash_field_is_refused_without_echoing_it():
    secret = "kvh-this-is-a-real-secret-key"
    with pytest.raises(TenantsFileError) as info:
        parse_tenants_text(good_replace('"' + "1" * 64 + '"', secret), "t.yaml")
    assert secret not in str(info.value)
    assert "never the key itself" in str(info.value)


def test_direct_model_validation_runs_cross_checks_too():
    data = {"qos_classes": {"x": {"priority": 1}}, "tenants": {"t": {"qos": "nope"}}}
    with pytest.raises(ValidationError, match="unknown QoS class"):
        TenantsFile.model_validate(data)
    with pytest.raises(ValidationError, match="unknown QoS class"):      # only the loader's flag
        TenantsFile.model_validate(data, context={"defer_cross_checks": False, "other": 1})


def _file_with(path: str, value) -> dict:
    """A valid file (a pinned class ``gold``, an unpinned ``bronze``, tenant ``t`` of gold) with
    ``value`` at the dotted ``path`` (a name segment ``NAME`` becomes ``value`` as a key)."""
    data = {"qos_classes": {"gold": {"priority": 2, "pinned": True}, "bronze": {"priority": 1}},
            "tenants": {"t": {"qos": "gold"}}}
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    if leaf == "NAME":
        node[value] = {"qos": "gold"} if parents == ["tenants"] else {"priority": 3}
    else:
        node[leaf] = value
    return data


SECRET = "ab" * 16                   # 32 lowercase hex digits: the shortest salt allowed


@pytest.mark.parametrize("path, edge, past", [
    ("qos_classes.gold.ttft_slo_ms", 0.5, 0),
    ("qos_classes.gold.step_target_ms", 0.5, 0),
    ("qos_classes.gold.stream_interval", 1, 0),
    ("qos_classes.gold.session_ttl_s", 0.5, 0),
    ("qos_classes.gold.session_max_blocks", 0, -1),
    ("tenants.t.pinned_kv_blocks", 0, -1),
    ("tenants.t.session_ttl_s", 0.5, 0),
    ("tenants.t.session_max_blocks", 0, -1),
    ("tenants.t.cache_secret", SECRET, SECRET[:-1]),
    ("tenants.t.cache_secret", "f" * 128, "f" * 129),
    ("tenants.t.cache_secret", SECRET, SECRET.upper()),
    ("cache_scopes.g.secret", SECRET, SECRET[:-1]),
    ("tenants.NAME", "t" * 64, "t" * 65),
    ("qos_classes.NAME", "q" * 64, "q" * 65),
    ("pinned_region.floor_blocks", 0, -1),
    ("pinned_region.ceiling_blocks", 0, -1),
    ("pinned_region.demand_window_s", 0.5, 0),
    ("lora_adapters.a.path", "d", ""),
])
def test_each_bound_admits_its_edge_and_refuses_one_step_past(path, edge, past):
    """A value at a field's documented bound loads; one step past it is refused, naming the
    field (a class's TTFT target of 0 ms, a 31-digit salt, a 65-character name...)."""
    TenantsFile.model_validate(_file_with(path, edge))
    with pytest.raises(ValidationError) as info:
        TenantsFile.model_validate(_file_with(path, past))
    parts = path.split(".")
    where = ".".join(str(p) for p in info.value.errors()[0]["loc"])
    assert where.startswith(".".join(parts[:-1] if parts[-1] == "NAME" else parts)), where


def test_one_pinned_block_on_an_unpinned_class_is_refused():
    data = _file_with("tenants.u", {"qos": "bronze", "pinned_kv_blocks": 1})
    with pytest.raises(ValidationError, match="tenants.u.pinned_kv_blocks: class 'bronze' is not"):
        TenantsFile.model_validate(data)


def test_mistakes_are_listed_in_file_order_whatever_the_order_of_the_sections():
    text = good().replace("priority: 10", "priority: high").replace(
        "max_tokens_per_request: 100", "max_tokens_per_request: 0")
    defaults = text[text.index("defaults:"):text.index("tenants:")]
    defaults_first = defaults + text.replace(defaults, "")
    with pytest.raises(TenantsFileError) as info:
        parse_tenants_text(defaults_first, "t.yaml")
    lines = [i.line for i in info.value.issues]
    assert len(lines) == 2 and lines == sorted(lines)
    assert info.value.issues[0].path == "defaults.max_tokens_per_request"  # above qos_classes


def test_a_file_that_is_not_a_mapping_or_cannot_be_read_says_so(tmp_path):
    assert "expected a mapping" in only_issue("- qos_classes\n- tenants\n").message
    with pytest.raises(TenantsFileError) as info:
        load_tenants_file(tmp_path / "missing.yaml")
    [issue] = info.value.issues
    assert str(issue) == f"{tmp_path / 'missing.yaml'}: <file>: cannot read: No such file or directory"


def test_no_classes_is_one_problem_not_one_per_tenant():
    text = good()
    issue = only_issue("qos_classes: {}\n" + text[text.index("defaults:"):])
    assert (issue.line, issue.path) == (1, "qos_classes") and "at least 1 item" in issue.message


def test_an_adapter_directory_must_hold_a_peft_config(tmp_path):
    (tmp_path / "empty").mkdir()
    issue = only_issue(good() + f"lora_adapters:\n  x: {{path: {tmp_path / 'empty'}}}\n")
    assert (issue.line, issue.path) == (21, "lora_adapters.x.path") and "holds no adapter_config.json" in issue.message
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    assert "x" in parse_tenants_text(good() + f"lora_adapters:\n  x: {{path: {tmp_path / 'empty'}}}\n").lora_adapters


def test_names_and_classes_are_read_without_surrounding_blanks():
    config = parse_tenants_text(good_replace("qos: bronze", 'qos: " bronze "'))
    assert config.tenants["b"].qos == "bronze"


def test_a_tenants_session_limits_override_its_classs():
    from kvharbor.tenants.schema import QoSClassConfig, TenantConfig

    qos = QoSClassConfig(priority=1, session_ttl_s=60, session_max_blocks=100)
    assert TenantConfig(qos="x").session_limits(qos) == (60, 100)
    assert TenantConfig(qos="x", session_ttl_s=5, session_max_blocks=0).session_limits(qos) == (5, 0)


def test_limits_coerce_from_none_a_dict_or_an_object():
    from types import SimpleNamespace

    from kvharbor.tenants.schema import LIMIT_FIELDS, TenantLimits

    assert TenantLimits.coerce(None) == TenantLimits() and all(
        v is None for v in TenantLimits().as_dict().values())
    assert TenantLimits.coerce({"requests_per_minute": 5}).requests_per_minute == 5
    obj = SimpleNamespace(**dict.fromkeys(LIMIT_FIELDS, 7))
    assert TenantLimits.coerce(obj) == TenantLimits(*[7] * len(LIMIT_FIELDS))


def test_a_key_expiry_without_a_zone_is_utc_whatever_the_servers_zone(monkeypatch):
    import time
    from datetime import datetime, timezone

    from kvharbor.tenants.schema import ApiKeyEntry

    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        entry = ApiKeyEntry(hash="1" * 64, expires=datetime(2030, 1, 1))
        at = datetime(2030, 1, 1, tzinfo=timezone.utc).timestamp()
        assert entry.is_expired(at) and not entry.is_expired(at - 1)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_key_expiry_with_a_zone_keeps_its_zone():
    from datetime import datetime, timezone

    text = good_replace(f'      - hash: "{"2" * 64}"\n',
                        f'      - hash: "{"2" * 64}"\n        expires: 2030-01-01T02:00:00+02:00\n')
    entry = parse_tenants_text(text).tenants["b"].keys[0]
    at = datetime(2030, 1, 1, tzinfo=timezone.utc).timestamp()      # 02:00 at +02:00 is 00:00 UTC
    assert entry.is_expired(at) and not entry.is_expired(at - 1)


def test_a_class_that_does_not_say_pinned_is_not_pinned():
    config = parse_tenants_text(good())
    assert config.qos_classes["gold"].pinned and not config.qos_classes["bronze"].pinned


def test_a_missing_section_is_reported_where_the_document_begins():
    """Past the file's opening comments: the line a reader looks at to add the section."""
    issue = only_issue("# our tenants\n\ntenants: {}\n")
    assert (issue.line, issue.path, issue.message) == (3, "qos_classes", "Field required")
    assert str(issue) == "t.yaml:3: qos_classes: Field required"
