"""The fused Triton layer ops equal transformers' modules (on the GPU when present, else in
Triton's interpreter), and a forward built from them keeps greedy tokens exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kvharbor.kernels import triton_ops

from .batch import DEVICE

# Triton's interpreter truncates fp32 -> bf16 casts (1 + 3 * 2**-9 becomes 1.0, not 1.0078),
# so bf16 rounding can only be checked on a GPU.
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              DEVICE.type != "cuda", reason="the interpreter truncates fp32->bf16 casts; checked on a GPU"))]
# fp32 keeps every step in fp32, so a different sum order and rsqrt compound to a few ulps
# (~2e-7 relative); 16-bit outputs are rounded once from fp32 and land within one ulp.
MAX_ULPS = {torch.float32: 4, torch.float16: 1, torch.bfloat16: 1}
# Compiled for a GPU, Triton's exp is the fast exp2-based one: SiLU in fp32 was 11 ulps from
# torch's on an H200 (16-bit outputs, rounded once, were within one ulp).
SILU_MAX_ULPS = {**MAX_ULPS, torch.float32: 16 if DEVICE.type == "cuda" else 4}


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype tensors ``a`` and ``b``."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert not a.isnan().any() and not b.isnan().any()
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    ia, ib = a.contiguous().view(bits).long(), b.contiguous().view(bits).long()
    # same-sign values: integer distance of the bit patterns is the ulp distance
    same_sign = (a.sign() * b.sign()) >= 0
    assert same_sign.all() or (a - b).abs().max() < 1e-6
    return int((ia - ib).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_transformers(dtype):
    torch.manual_seed(0)
    n = 96
    norm = LlamaRMSNorm(n, eps=1e-5).to(DEVICE, dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n) * 0.5 + 1)
    base = torch.randn(7, n + 32, device=DEVICE, dtype=dtype) * 3
    x = base[:, :n]                                          # strided rows, as a qkv slice is
    assert ulps_apart(triton_ops.rms_norm(x, norm.weight, 1e-5), norm(x)) <= MAX_ULPS[dtype]
    residual = torch.randn(7, n, device=DEVICE, dtype=dtype)
    want_residual = residual + x
    got = triton_ops.add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(residual, want_residual)               # added in place, rounded as torch
    assert ulps_apart(got, norm(want_residual)) <= MAX_ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_views_matches_transformers(dtype):
    torch.manual_seed(1)
    t, h, hkv, d = 5, 4, 2, 32
    qkv = torch.randn(t, (h + 2 * hkv) * d, device=DEVICE, dtype=dtype)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, h, d), k.view(t, hkv, d)
    pos = torch.arange(t, device=DEVICE, dtype=torch.float32)[:, None] * 37
    freqs = pos / 10000 ** (torch.arange(0, d, 2, device=DEVICE) / d)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    want_q, want_k = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin, unsqueeze_dim=1)
    got_q, got_k = triton_ops.rotary_(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(v, v0)                                 # v's columns untouched
    if DEVICE.type != "cuda":         # the interpreter rounds every product and sum as torch does
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
        return
    # Compiled for a GPU the results were not bit-identical (an H200: one ulp in fp16/bf16, up
    # to 26 ulps in fp32 where the two products nearly cancel: consistent with the compiler
    # fusing a product into the sum, one rounding instead of two). Each output stays within
    # one rounding of each product: |got - want| <= 2 eps (|x cos| + |rotate_half(x) sin|).
    eps = torch.finfo(dtype).eps
    for got, want, x in ((q, want_q, q0), (k, want_k, k0)):
        c, s_ = cos[:, None].float(), sin[:, None].float()
        x = x.float()
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
        bound = 2 * eps * ((x * c).abs() + (rotated * s_).abs())
        assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_transformers_gate(dtype):
    torch.manual_seed(2)
    gate_up = torch.randn(6, 2 * 1500, device=DEVICE, dtype=dtype) * 4   # two column blocks
    g, u = gate_up.split(1500, dim=-1)
    assert ulps_apart(triton_ops.silu_mul(gate_up), F.silu(g) * u) <= SILU_MAX_ULPS[dtype]


@pytest.mark.parametrize("model", ["kvharbor/tiny-llama", "kvharbor/tiny-qwen2", "kvharbor/tiny-mistral"])
def test_triton_model_path_keeps_greedy_tokens_exact(model):
    """The Triton layer path (packed q/k/v and gate/up, fused ops) in float32 generates
    transformers' greedy tokens; the modules, whose weights became views of the packed
    ones, still compute transformers' own forward."""
    from kvharbor import LLM, SamplingParams
    from kvharbor.engine.fast_model import FastCausalLM

    from ..engine.conftest import hf_greedy, random_prompt

    llm = LLM(model=model, device=str(DEVICE), dtype="float32", num_kv_blocks=256)
    runner = llm.engine.runner
    runner.fast = FastCausalLM(llm.hf_model, triton=True)
    assert runner.fast.triton
    prompts = [random_prompt(n, seed) for seed, n in enumerate((1, 9, 23, 40))]
    want = hf_greedy(llm.hf_model, prompts, new_tokens=6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == want


def test_triton_model_path_serves_lora_adapters(tmp_path):
    """On the Triton layer path (q/k/v and gate/up packed, the deltas added to the gate and
    up halves of one product) an adapter's requests and the base model's, in one batch,
    generate what PEFT's forward and the base model generate."""
    import copy

    from peft import LoraConfig, get_peft_model

    from kvharbor import LLM, LoRARequest, SamplingParams
    from kvharbor.engine.fast_model import FastCausalLM

    from ..engine.conftest import hf_greedy, random_prompt

    llm = LLM(model="kvharbor/tiny-llama", device=str(DEVICE), dtype="float32", num_kv_blocks=256)
    base = llm.hf_model
    torch.manual_seed(3)
    oracle = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    oracle.save_pretrained(str(tmp_path / "a"))
    runner = llm.engine.runner
    runner.fast = FastCausalLM(base, triton=True)
    assert runner.fast.triton
    prompts = [random_prompt(n, seed) for seed, n in enumerate((9, 23, 40))]
    loras = [LoRARequest("a", 1, str(tmp_path / "a")), None, LoRARequest("a", 1, str(tmp_path / "a"))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                        lora_request=loras)
    want_adapted = hf_greedy(oracle.eval(), [prompts[0], prompts[2]], new_tokens=6)
    assert [outs[0].token_ids, outs[2].token_ids] == want_adapted
    assert outs[1].token_ids == hf_greedy(base, [prompts[1]], new_tokens=6)[0]
    assert want_adapted != hf_greedy(base, [prompts[0], prompts[2]], new_tokens=6)
