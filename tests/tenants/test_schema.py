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
])
def test_mistakes_are_reported_with_line_and_field(old, new, line, path, words):
    issue = only_issue(good_replace(old, new))
    assert (issue.line, issue.path) == (line, path)
    assert words in issue.message
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
    issue = only_issue(good() + "  c: [unclosed\n")
    assert issue.line is not None and issue.line >= 20
    assert "YAML syntax" in issue.message


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
