"""Model identity is the root of the block-hash chain: another model never reuses blocks."""

from __future__ import annotations

import json
import subprocess
import sys

from kvharbor import LLM, SamplingParams
from kvharbor.actors.prefix_directory import PrefixIndex
from kvharbor.engine.hashing import hash_prompt_blocks, model_root
from kvharbor.engine.model_identity import model_identity

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i) % 251 for i in range(100)]          # 6 full blocks of 16


def _checkpoint(path, weights: bytes, layers: int = 2):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    (path / "model.safetensors").write_bytes(weights)
    return str(path)


def test_identity_follows_the_checkpoint_files_not_the_name(tmp_path):
    a = _checkpoint(tmp_path / "m", b"weights-v1")
    first = model_identity(a)
    assert first.startswith(a + "@") and model_identity(a) == first
    _checkpoint(tmp_path / "m", b"weights-v2")                    # same name, new weights
    new_weights = model_identity(a)
    _checkpoint(tmp_path / "m", b"weights-v2", layers=3)          # same weights, new config
    new_config = model_identity(a)
    assert len({first, new_weights, new_config}) == 3


def test_identity_ignores_files_that_are_not_config_or_weights_and_follows_which_shard_holds_what(tmp_path):
    """A README or tokenizer file added to a checkpoint leaves its identity (and so every cached
    block) as it was; two weight shards that swap contents are another model."""
    a = _checkpoint(tmp_path / "m", b"weights")
    (tmp_path / "m" / "model-2.safetensors").write_bytes(b"second-shard")
    before = model_identity(a)
    (tmp_path / "m" / "README.md").write_text("a model card")
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")
    assert model_identity(a) == before
    (tmp_path / "m" / "model.safetensors").write_bytes(b"second-shard")
    (tmp_path / "m" / "model-2.safetensors").write_bytes(b"weights")
    assert model_identity(a) != before


def test_a_builtin_models_identity_follows_its_fields_and_the_library_versions(monkeypatch):
    """Read without transformers' config objects: a field kvharbor sets, the transformers
    version (every other field's default) and, for random weights, the torch version count."""
    import kvharbor.engine.model_identity as mi

    trained, random = model_identity("kvharbor/tiny-llama"), model_identity("kvharbor/tiny-qwen2")
    kind, fields = mi.BUILTIN_SPECS["kvharbor/tiny-qwen2"]
    with monkeypatch.context() as m:
        m.setitem(mi.BUILTIN_SPECS, "kvharbor/tiny-qwen2", (kind, {**fields, "num_key_value_heads": 2}))
        assert model_identity("kvharbor/tiny-qwen2") != random
    assert model_identity("kvharbor/tiny-qwen2") == random
    installed = mi.package_version
    for package in ("transformers", "torch"):
        def other_version(name, package=package):
            return "0.0" if name == package else installed(name)

        with monkeypatch.context() as m:
            m.setattr(mi, "package_version", other_version)
            changed = model_identity("kvharbor/tiny-llama"), model_identity("kvharbor/tiny-qwen2")
        assert changed[1] != random and (changed[0] != trained) == (package == "transformers"), package


def test_engine_hashes_start_at_the_identity_the_gateway_computes():
    """The gateway computes ``model_root(model_identity(name))`` without loading weights; the
    engine's request hashes and KV events must be exactly the hashes it computes."""
    fresh = subprocess.run([sys.executable, "-c", "from kvharbor.engine.model_identity import model_identity;"
                            "print(model_identity('kvharbor/tiny-llama'))"],
                           capture_output=True, text=True, check=True).stdout.strip()   # like a gateway
    llm = LLM(device="cpu", num_kv_blocks=32)
    assert llm.engine.model_identity == model_identity("kvharbor/tiny-llama") == fresh
    gateway = hash_prompt_blocks(PROMPT, 16, "tenant:a", parent=model_root(model_identity("kvharbor/tiny-llama")))
    llm.generate([PROMPT], GREEDY, cache_salt="tenant:a")
    stored = {h for b in llm.engine.drain_kv_events() for h in b.stored}
    assert len(gateway) == 6 and set(gateway) <= stored
    assert not set(hash_prompt_blocks(PROMPT, 16, "tenant:a")) & stored     # the zero root is not used


def test_a_model_change_makes_the_same_prompt_cold_in_the_directory():
    """Two deployments of the same name with other weights (seeded random builtin weights):
    the directory that indexed the first matches nothing of the second; the same weights match."""
    index = PrefixIndex()
    old = LLM(model="kvharbor/tiny-qwen2", device="cpu", num_kv_blocks=32, seed=0)
    old.generate([PROMPT], GREEDY)
    for b in old.engine.drain_kv_events():
        index.apply_events("r-old", b.seq_no, b.stored, b.removed, tier=b.tier)
    same = LLM(model="kvharbor/tiny-qwen2", device="cpu", num_kv_blocks=32, seed=0)
    changed = LLM(model="kvharbor/tiny-qwen2", device="cpu", num_kv_blocks=32, seed=1)
    assert changed.engine.model_identity != old.engine.model_identity == same.engine.model_identity
    for llm, want in ((same, 6), (changed, 0)):
        req = llm.engine.add_request("probe", PROMPT, SamplingParams(max_tokens=1))
        req.update_block_hashes(16)
        match = index.match(req.block_hashes).get("r-old")
        assert (match.blocks if match else 0) == want
