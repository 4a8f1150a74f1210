"""LoRA adapters (multi-LoRA): requests of several adapters and of the base model in one batch
each generate what PEFT's own forward of their adapter generates, token for token; adapters
cache their prefixes apart; checkpoints the engine cannot serve are refused by reason."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from kvharbor import LLM, LoRARequest
from kvharbor.engine.hashing import adapter_salt

from .conftest import greedy, hf_greedy, mixed_prompts, random_prompt

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW = 8


def _adapter(base, path, seed: int, **config):
    """A PEFT LoRA of ``base`` with random (non-zero) A and B saved at ``path``; returns
    the PEFT model (the oracle)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters of tiny-llama: 'all' (r 8, every projection, every layer) and 'attn'
    (r 4, q and v only, layers 1 and 3, rsLoRA scaling); with their PEFT oracles."""
    root = tmp_path_factory.mktemp("lora")
    base = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64).hf_model
    oracles = {
        "all": _adapter(base, root / "all", 1, r=8, lora_alpha=16, target_modules=ALL),
        "attn": _adapter(base, root / "attn", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                         layers_to_transform=[1, 3], use_rslora=True),
    }
    return {"root": root, "oracles": oracles, "base": base}


def _requests(adapters, names):
    return [None if n is None else LoRARequest(n, i + 1, str(adapters["root"] / n))
            for i, n in enumerate(names)]


def _assert_each_generates_as_its_model(adapters, prompts, names, outs) -> None:
    """Each output equals PEFT's greedy generate with its adapter (``names[i]``; None: the base
    model's)."""
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        model = adapters["base"] if name is None else adapters["oracles"][name]
        want = hf_greedy(model, [prompts[i] for i in idx], NEW)
        assert [outs[i].token_ids for i in idx] == want, name


@pytest.mark.parametrize("path", ["fused", "unfused", "modules"])
def test_adapters_and_base_in_one_batch_match_peft(path, adapters, monkeypatch):
    """16 prompts (1 to 330 tokens, chunked at 96) spread over 'all', 'attn' and the base
    model in one generate call: each equals PEFT's greedy generate with its adapter (the base
    model's for base rows), on the fused CPU ops, the packed layers without them, and the
    plain modules."""
    if path == "modules":
        monkeypatch.setenv("KVH_CPU_LINEAR", "torch")
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=1024, max_num_batched_tokens=96)
    if path == "unfused":
        llm.engine.runner.fast.ops = None
    assert (llm.engine.runner.fast.ops is not None) == (path == "fused")
    prompts = mixed_prompts()
    names = [("all", "attn", None)[i % 3] for i in range(len(prompts))]
    outs = llm.generate(prompts, greedy(NEW), lora_request=_requests(adapters, names))
    _assert_each_generates_as_its_model(adapters, prompts, names, outs)
    base_of_adapted = hf_greedy(adapters["base"], [prompts[i] for i in range(len(prompts)) if names[i]], NEW)
    adapted = [outs[i].token_ids for i in range(len(prompts)) if names[i]]
    assert sum(a != b for a, b in zip(adapted, base_of_adapted)) >= len(adapted) // 2   # they change tokens
    llm.check_integrity()


def test_an_adapter_caches_its_prefixes_apart_from_the_base_model(adapters):
    """The same prompt under the base model, then 'all', then 'all' again, then 'attn': only
    the repeat of 'all' hits the cache (an adapter's KV differs from the base model's), and
    each answer is its own model's."""
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=256)
    prompt = random_prompt(70, 5)
    [all_, attn] = _requests(adapters, ["all", "attn"])
    base = llm.generate([prompt], greedy(NEW))[0]
    first = llm.generate([prompt], greedy(NEW), lora_request=all_)[0]
    again = llm.generate([prompt], greedy(NEW), lora_request=all_)[0]
    other = llm.generate([prompt], greedy(NEW), lora_request=attn)[0]
    assert [base.num_cached_tokens, first.num_cached_tokens, again.num_cached_tokens,
            other.num_cached_tokens] == [0, 0, 64, 0]
    assert first.token_ids == again.token_ids == hf_greedy(adapters["oracles"]["all"], [prompt], NEW)[0]
    assert other.token_ids == hf_greedy(adapters["oracles"]["attn"], [prompt], NEW)[0]
    assert base.token_ids == hf_greedy(adapters["base"], [prompt], NEW)[0]


def test_an_adapters_prefixes_stay_in_each_tenants_cache_scope(adapters):
    """The same prompt under 'all' for tenant scope a, then b, then a again, then the public
    scope: only a's repeat hits; another tenant's adapter KV is never reused."""
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=256)
    prompt = random_prompt(70, 6)
    [all_] = _requests(adapters, ["all"])
    outs = [llm.generate([prompt], greedy(NEW), lora_request=all_, cache_salt=salt)[0]
            for salt in ("tenant-a", "tenant-b", "tenant-a", None)]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 64, 0]
    assert len({tuple(o.token_ids) for o in outs}) == 1


def test_an_adapter_name_from_another_checkpoint_is_another_scope_however_its_path_is_spelled():
    """The gateway and the engine hash an adapter's blocks with the path each was given: two
    spellings of one path agree, two checkpoints under one name do not."""
    assert adapter_salt("t", "x", "/ckpt/a") != adapter_salt("t", "x", "/ckpt/b")
    assert adapter_salt("t", "x", "/ckpt/a") == adapter_salt("t", "x", "/ckpt//a/") == adapter_salt("t", "x", "/ckpt/./a")
    assert adapter_salt("t", "x", "/ckpt/a") != adapter_salt("u", "x", "/ckpt/a")
    assert adapter_salt("t", None, "/ckpt/a") == "t"


def test_adapters_load_at_start_and_requests_name_them(adapters):
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=128,
              lora_modules={"all": str(adapters["root"] / "all")})
    stats = llm.stats()
    # r 8 on 7 projections x 4 layers of tiny-llama (hidden 256, 512 intermediate), fp32
    per_layer = 8 * ((256 + 256) * 2 + (256 + 64) * 2 + (256 + 512) * 2 + (512 + 256))
    assert stats["lora_adapters"]["all"]["rank"] == 8
    assert os.path.samefile(stats["lora_adapters"]["all"]["path"], adapters["root"] / "all")
    assert stats["memory_bytes"]["device"]["lora_adapters"] == stats["lora_adapters"]["all"]["bytes"] == 4 * 4 * per_layer
    prompt = random_prompt(20, 9)
    llm.engine.add_request("r", prompt, greedy(NEW), lora="all")
    while llm.engine.has_unfinished():
        outs = llm.engine.step()
    assert outs[-1].token_ids == hf_greedy(adapters["oracles"]["all"], [prompt], NEW)[0]
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'attn' \(loaded: all\)"):
        llm.engine.add_request("s", prompt, greedy(NEW), lora="attn")
    with pytest.raises(ValueError, match="already loaded from"):
        llm.engine.add_lora("all", str(adapters["root"] / "attn"))


def _edited(src, dst, config=None, tensors=None):
    """A copy of checkpoint ``src`` at ``dst`` with its config updated and tensors edited."""
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(dst / "adapter_model.safetensors"))
    return dst


REFUSALS = {
    "dora": ({"use_dora": True}, None, "use_dora"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "bias": ({"bias": "all"}, None, "trained biases"),
    "alpha_pattern": ({"alpha_pattern": {"q_proj": 4}}, None, "alpha_pattern"),
    "embeddings": (None, lambda w: {**w, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 256)},
                   "embed_tokens.lora_A.weight' is not a LoRA weight of a projection"),
    "other model": (None, lambda w: {k: torch.zeros(v.shape[0], 7) if k.endswith("q_proj.lora_A.weight") else v
                                     for k, v in w.items()}, r"q_proj has A \(8, 7\)"),
    "too many layers": (None, lambda w: {**w, "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight":
                                         torch.zeros(8, 256)}, "layer 9 q_proj has no such layer"),
    "B missing": (None, lambda w: {k: v for k, v in w.items() if "layers.2.mlp.up_proj.lora_B" not in k},
                  "layer 2 up_proj has only lora_A"),
    "B of another model": (None, lambda w: {k: torch.zeros(7, v.shape[1]) if k.endswith("layers.0.self_attn.q_proj.lora_B.weight")
                                            else v for k, v in w.items()}, r"q_proj has A \(8, 256\) and B \(7, 8\)"),
    "no projection": (None, lambda w: {**w, "base_model.model.model.layers.0.mlp.act_fn.lora_A.weight": torch.zeros(8, 256)},
                      "act_fn.lora_A.weight' is not a LoRA weight of a projection"),
    "no weights": (None, lambda w: {}, "holds no LoRA weights"),
    "peft_type": ({"peft_type": "IA3"}, None, "peft_type 'IA3'"),
    "lora_bias": ({"lora_bias": True}, None, "trained biases"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_checkpoints_it_cannot_serve_are_refused_by_reason(case, adapters, tmp_path):
    config, tensors, message = REFUSALS[case]
    path = _edited(adapters["root"] / "all", tmp_path / case, config, tensors)
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], greedy(2), lora_request=LoRARequest("x", 1, str(path)))
    assert llm.engine.loras.adapters == {} and not llm.engine.has_unfinished()


def test_rank_limit_and_missing_checkpoints_are_refused(adapters, tmp_path):
    with pytest.raises(ValueError, match="rank 8 at layer 0 .* exceeds max_lora_rank=7"):
        LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64, max_lora_rank=7,
            lora_modules={"all": str(adapters["root"] / "all")})
    assert LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64, max_lora_rank=8,
               lora_modules={"all": str(adapters["root"] / "all")}).stats()["lora_adapters"]["all"]["rank"] == 8
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="no readable adapter_config.json"):
        llm.engine.add_lora("gone", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="LoRA adapters run on kvharbor's model path"):
        LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64, model_path="transformers",
            lora_modules={"all": str(adapters["root"] / "all")})


def test_one_adapter_beside_base_rows_changes_only_its_own_rows(adapters):
    """A batch of one adapter's requests and base-model requests: the adapter's delta goes to
    its rows only (each output equals its own model's)."""
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=256)
    prompts = [random_prompt(n, seed) for seed, n in enumerate((12, 40, 7, 25))]
    names = ["all", None, "all", None]
    outs = llm.generate(prompts, greedy(NEW), lora_request=_requests(adapters, names))
    _assert_each_generates_as_its_model(adapters, prompts, names, outs)


def test_a_config_without_lora_alpha_scales_as_peft_loads_it(adapters, tmp_path):
    """PEFT fills a missing lora_alpha with its default (8), not with r: an r-4 adapter then
    scales its delta by 2, and generates what PEFT generates from the same directory."""
    from peft import PeftModel

    src = tmp_path / "r4"
    _adapter(adapters["base"], src, 3, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])
    cfg = json.loads((src / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    oracle = PeftModel.from_pretrained(copy.deepcopy(adapters["base"]), str(src)).eval()
    assert oracle.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 2.0
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64, lora_modules={"r4": str(src)})
    prompt = random_prompt(30, 4)
    [out] = llm.generate([prompt], greedy(NEW), lora_request=LoRARequest("r4", 1, str(src)))
    assert out.token_ids == hf_greedy(oracle, [prompt], NEW)[0]


def test_the_reported_rank_is_the_largest_of_the_modules(adapters, tmp_path):
    """Per-module ranks (PEFT's rank_pattern): stats report the adapter's largest rank."""
    def shrink(w):
        out = dict(w)
        for k in [k for k in w if ".layers.3.self_attn.v_proj." in k]:
            out[k] = (w[k][:4] if "lora_A" in k else w[k][:, :4]).contiguous()
        return out

    path = _edited(adapters["root"] / "all", tmp_path / "mixed", tensors=shrink)
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64, lora_modules={"mixed": str(path)})
    assert llm.stats()["lora_adapters"]["mixed"]["rank"] == 8


def test_loads_by_name_and_path_and_failures_are_kept_until_a_good_load(adapters, tmp_path):
    """One checkpoint spelled two ways is one adapter; a failed load is kept (stats, and the
    error a request naming it gets) until the name loads from a good checkpoint or is removed;
    an adapter needs a name."""
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64)
    good = adapters["root"] / "all"
    (good.parent / "elsewhere").mkdir(exist_ok=True)
    llm.engine.add_lora("all", f"{good.parent}/elsewhere/../all/")
    llm.engine.add_lora("all", str(good))                   # the same path: no error, no reload
    assert list(llm.engine.loras.adapters) == ["all"]
    with pytest.raises(ValueError, match="non-empty name"):
        llm.engine.add_lora("", str(good))
    with pytest.raises(ValueError, match="no readable adapter_config.json"):
        llm.engine.add_lora("late", str(tmp_path / "not yet"))
    assert "no readable adapter_config.json" in llm.stats()["lora_adapters_failed"]["late"]
    with pytest.raises(ValueError, match="'late' could not be loaded: .*no readable adapter_config"):
        llm.engine.add_request("r", [1, 2, 3], greedy(2), lora="late")
    llm.engine.add_lora("late", str(good))
    assert llm.stats()["lora_adapters_failed"] == {}
    with pytest.raises(ValueError):
        llm.engine.add_lora("broken", str(tmp_path / "nowhere"))
    assert llm.engine.loras.remove("broken") is False
    assert llm.stats()["lora_adapters_failed"] == {}


def test_a_scope_flush_drops_that_scopes_adapter_blocks_too(adapters):
    """Flushing a tenant's cache scope forgets the prefixes it cached under an adapter as well
    as under the base model; another scope's adapter prefixes stay."""
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=256)
    prompt = random_prompt(70, 8)
    [all_] = _requests(adapters, ["all"])

    def cached(salt, lora):
        return llm.generate([prompt], greedy(1), lora_request=lora, cache_salt=salt)[0].num_cached_tokens

    for salt, lora in (("tenant-a", None), ("tenant-a", all_), ("tenant-b", all_)):
        cached(salt, lora)
    counts = llm.engine.flush_cache(salts=["tenant-a"], tenants=["a"])
    assert counts["device_blocks"] == 8, counts            # 4 full blocks, base and adapter
    assert [cached("tenant-a", None), cached("tenant-a", all_), cached("tenant-b", all_)] == [0, 0, 64]
    llm.check_integrity()
