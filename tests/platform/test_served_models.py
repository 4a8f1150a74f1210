"""The models a gateway serves, without Ray: build_app's lora_modules beside tenants.yaml's
adapters, re-read when the registry reloads."""

from __future__ import annotations

import pytest

from kvharbor.engine.hashing import adapter_salt
from kvharbor.platform.error_body import APIError
from kvharbor.platform.served_models import ServedModels


class FakeRegistry:
    """A registry's two readings ServedModels uses: its version and its adapters."""

    def __init__(self, adapters: dict[str, str]) -> None:
        self.version, self._adapters = 1, adapters

    def lora_adapters(self) -> dict[str, str]:
        return dict(self._adapters)

    def reload(self, adapters: dict[str, str]) -> None:
        self.version, self._adapters = self.version + 1, adapters


def test_lora_modules_win_a_name_tenants_yaml_also_gives_as_in_the_replicas():
    """The replicas keep build_app's adapter when tenants.yaml names one the same; the gateway
    must hash (route) and describe that one, not the file's."""
    registry = FakeRegistry({"support": "/file/support", "extra": "/file/extra"})
    models = ServedModels("base", {"support": "/static/support"}, registry, context=4096)
    assert models.adapters == {"support": "/static/support", "extra": "/file/extra"}
    assert models.card("support")["root"] == "/static/support"
    assert models.salt("t", "support") == adapter_salt("t", "support", "/static/support")
    registry.reload({"support": "/file/v2"})                     # an edit; the static one stays
    assert models.adapters == {"support": "/static/support"}
    with pytest.raises(APIError) as refused:
        models.check("extra")
    assert refused.value.status == 404 and refused.value.code == "model_not_found"
    assert "'base', 'support'" in str(refused.value)
    assert models.names() == ["base", "support"]


def test_served_model_names_replace_the_models_path_as_vllms_do():
    """``served_model_name=qwen,qwen-latest`` for a checkpoint at /ckpt: requests name either,
    not the path (a 404 naming what is served); answers and adapters' ``parent`` carry the
    first; cards keep the path as ``root``."""
    models = ServedModels("/ckpt", {"support": "/static/support"}, FakeRegistry({}), context=4096,
                          served_names=["qwen", "qwen-latest"])
    assert models.names() == ["qwen", "qwen-latest", "support"]
    for name in ("qwen", "qwen-latest"):
        models.check(name)
        assert models.adapter(name) is None                       # the base model
        assert models.answered_name(name) == "qwen"
        assert (models.card(name)["id"], models.card(name)["root"]) == (name, "/ckpt")
    with pytest.raises(APIError) as refused:
        models.check("/ckpt")
    assert refused.value.status == 404 and "'qwen', 'qwen-latest', 'support'" in str(refused.value)
    assert (models.adapter("support"), models.answered_name("support")) == ("support", "support")
    assert models.card("support")["parent"] == "qwen"
    plain = ServedModels("/ckpt", None, FakeRegistry({}), context=4096)
    plain.check("/ckpt")
    assert plain.names() == ["/ckpt"] and plain.answered_name("/ckpt") == "/ckpt"
