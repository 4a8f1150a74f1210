"""kvharbor's own forward for the Llama / Qwen2 / Mistral families, on the transformers weights.

It runs the same submodules transformers runs (embedding, rotary embedding, RMSNorms, q/k/v/o
projections, MLP, final norm, LM head) and the same ``apply_rotary_pos_emb``, in the same
order, so its numbers are the ones transformers computes; what it drops is the per-call
machinery around them: ``[1, H, T, D]`` transposes and ``.contiguous()`` copies, the mask
interface, kwargs plumbing through every layer, toggling the attention implementation, and
the final norm over rows nobody samples. Tensors stay token-major (``[T, H, D]``), which is
what the paged cache and the CPU attention want. ``llm.hf_model`` still computes transformers'
own forward (the tests' oracle; on a GPU its q/k/v and gate/up weights become views of the
packed ones, same values); the greedy-exact tests compare the two token for token.

On the CPU in float32 the projections run on weights packed once for oneDNN
(:mod:`kvharbor.kernels.cpu_linear`): q, k and v as one matrix, then o, gate, up, down and
the LM head; the same products up to float rounding. There
the RMSNorms, residual adds and rotary embedding also run as fused C++ passes
(:mod:`kvharbor.kernels.cpu_ops`: rotary and residual bit-identical, the norms up to the order
of one sum). On a GPU (CUDA, the standard norms and a SiLU gate/up MLP) q/k/v and gate/up
run as one product each, and the norms (residual add folded in), rotary embedding and SiLU gate
as fused Triton kernels (:mod:`kvharbor.kernels.triton_ops`: within a few ulps of
transformers', measured on an H200). Elsewhere the modules run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import cpu_linear, cpu_ops
from . import attention
from .lora import LoRABatch

FAMILIES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}


def supports(model) -> bool:
    """True for a Llama / Qwen2 / Mistral causal LM with the standard module layout."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if cfg is None or cfg.model_type not in FAMILIES or inner is None:
        return False
    layer = inner.layers[0] if len(inner.layers) else None
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")
    return (layer is not None and all(hasattr(layer.self_attn, n) for n in needed)
            and not hasattr(layer.self_attn, "q_norm") and hasattr(inner, "rotary_emb"))


class _Projections:
    """What every layer kind shares: ``o``, the output projection (its ``o_proj``) with the
    LoRA deltas of ``lora`` (a ``LoRABatch.hook``; None: the base model)."""

    __slots__ = ()

    def o(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        y = self.o_proj(x)
        return y if lora is None else lora("o_proj", x, y)


class ModuleLayer(_Projections):
    """One decoder layer's projections as its own modules (the interface of ``PackedLayer``)."""

    __slots__ = ("attn", "o_proj", "_mlp")

    def __init__(self, layer) -> None:
        self.attn, self.o_proj, self._mlp = layer.self_attn, layer.self_attn.o_proj, layer.mlp

    def qkv(self, x: torch.Tensor, lora=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v ``[T, heads * D]`` of ``x`` ``[T, hidden]``."""
        a = self.attn
        q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        return (q, k, v) if lora is None else _lora_qkv(lora, x, q, k, v)

    def mlp(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """The layer's MLP module; with ``lora``, its gate/up/down products one by one."""
        if lora is None:
            return self._mlp(x)
        m = self._mlp
        g = lora("gate_proj", x, m.gate_proj(x))
        h = m.act_fn(g) * lora("up_proj", x, m.up_proj(x))
        return lora("down_proj", h, m.down_proj(h))


def _lora_qkv(lora, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v with the LoRA deltas of ``lora`` (``LoRABatch.hook``) added in place."""
    return lora("q_proj", x, q), lora("k_proj", x, k), lora("v_proj", x, v)


def _silu_(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


class PackedLayer(_Projections):
    """One decoder layer's projections packed for oneDNN (see :mod:`..kernels.cpu_linear`)."""

    __slots__ = ("qkv_proj", "qkv_sizes", "o_proj", "gate", "up", "down", "act")

    def __init__(self, layer) -> None:
        a, mlp = layer.self_attn, layer.mlp
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        # One weight whose rows q, k and v's weights become views of (so the plain weight
        # PackedLinear keeps for its few-row product is no copy), unless their biases differ
        # in kind.
        self.qkv_proj = (cpu_linear.PackedLinear(*_pack_rows(*qkv))
                         if len({p.bias is None for p in qkv}) == 1 else cpu_linear.PackedLinear.stack(*qkv))
        self.qkv_sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        self.o_proj = cpu_linear.PackedLinear.stack(a.o_proj)
        # SiLU (Llama, Qwen2, Mistral) runs in place on the gate product, torch's own op as in
        # transformers: oneDNN's fused swish post-op was slower (135M step loop, 4 interleaved
        # rounds each in one process: 33.1-35.0 s separate vs 33.8-37.0 s fused). Gate and up
        # stay two products: slicing one [T, 2 * inter] output made the activation read strided
        # rows, 3x slower than contiguous (measured).
        silu = type(mlp.act_fn).__name__ in SILU_ACTIVATIONS
        self.gate = cpu_linear.PackedLinear.stack(mlp.gate_proj)
        self.up = cpu_linear.PackedLinear.stack(mlp.up_proj)
        self.down = cpu_linear.PackedLinear.stack(mlp.down_proj)
        self.act = _silu_ if silu else mlp.act_fn

    def linears(self) -> tuple[cpu_linear.PackedLinear, ...]:
        """The products in the order a step runs them."""
        return self.qkv_proj, self.o_proj, self.gate, self.up, self.down

    def qkv(self, x: torch.Tensor, lora=None) -> tuple[torch.Tensor, ...]:
        """q, k and v ``[T, heads * D]`` (views of one product) of ``x`` ``[T, hidden]``;
        ``lora``: a ``LoRABatch.hook`` adding adapters' deltas (None: the base model)."""
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return (q, k, v) if lora is None else _lora_qkv(lora, x, q, k, v)

    def mlp(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))``, ``x`` ``[T, hidden]``. Rows are padded to their
        bucket once here, so the three products (down's input the widest) copy nothing."""
        rows = x.shape[0]
        x = self.gate.pad(x)
        if lora is None:
            h = self.act(self.gate(x))
            return self.down(h.mul_(self.up(x)))[:rows]
        h = self.act(lora("gate_proj", x, self.gate(x)))
        h.mul_(lora("up_proj", x, self.up(x)))
        return lora("down_proj", h, self.down(h))[:rows]


SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")     # transformers' names of the SiLU act_fn
MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def norms_in_order(inner) -> list:
    """The RMSNorms of decoder ``inner`` in the order the fused forwards use their
    ``norm_args``: ``[input_0, post_0, input_1, ..., final]``."""
    return [n for layer in inner.layers
            for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [inner.norm]


def _pack_rows(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' rows; each module's weight and bias become
    views of it, so the packed product costs no extra memory and the modules (transformers'
    own forward, the tests' oracle) compute what they computed before."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = torch.nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return weight, bias


class TritonLayer(_Projections):
    """One decoder layer on a GPU: q/k/v as one product, gate/up as one product followed by
    the fused SiLU gate (:mod:`..kernels.triton_ops`); o and down as their modules."""

    __slots__ = ("qkv_w", "qkv_b", "qkv_sizes", "o_proj", "gate_up_w", "down", "inter")

    def __init__(self, layer) -> None:
        a, mlp = layer.self_attn, layer.mlp
        self.qkv_w, self.qkv_b = _pack_rows(a.q_proj, a.k_proj, a.v_proj)
        self.qkv_sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        self.o_proj = a.o_proj
        self.gate_up_w, _ = _pack_rows(mlp.gate_proj, mlp.up_proj)
        self.inter = mlp.gate_proj.out_features
        self.down = mlp.down_proj

    def qkv(self, x: torch.Tensor, lora=None) -> tuple[torch.Tensor, ...]:
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).split(self.qkv_sizes, dim=-1)
        return (q, k, v) if lora is None else _lora_qkv(lora, x, q, k, v)

    def mlp(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        from ..kernels import triton_ops  # noqa: PLC0415 - Triton loads only where it runs

        gate_up = F.linear(x, self.gate_up_w)
        if lora is not None:            # the deltas go to the gate and up halves (views)
            lora("gate_proj", x, gate_up[:, :self.inter])
            lora("up_proj", x, gate_up[:, self.inter:])
        h = triton_ops.silu_mul(gate_up)
        return self.down(h) if lora is None else lora("down_proj", h, self.down(h))


def _own_embedding(model) -> None:
    """Move the input embedding (and an LM head tied to it) into memory torch allocated.

    transformers loads a safetensors checkpoint's weights as private maps of the file, in 4 KB
    pages. The projections run on packed copies, but the embedding is read where it lies: a
    cold 1,024-token prefill gathers 1,024 rows of it, 14-19 ms from the file map against
    ~1-3 ms from a copy in torch's allocation (huge pages, see ``host_memory``; 135M model,
    Intel Xeon VM). Same values: transformers' own forward (the tests' oracle) is unchanged.
    """
    emb = model.get_input_embeddings()
    old = emb.weight
    new = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
    emb.weight = new
    if getattr(model.lm_head, "weight", None) is old:
        model.lm_head.weight = new


def _triton_fusable(model) -> bool:
    """The standard RMSNorms, a bias-free SiLU gate/up/down MLP, q/k/v biases all or none."""
    inner = model.model
    for layer in inner.layers:
        mlp, a = layer.mlp, layer.self_attn
        if not all(hasattr(mlp, n) for n in MLP_PARTS):
            return False
        if type(mlp.act_fn).__name__ not in SILU_ACTIVATIONS:
            return False
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            return False
        if len({p.bias is None for p in (a.q_proj, a.k_proj, a.v_proj)}) != 1:
            return False
    return all(type(n).__name__ in RMS_NORMS for n in norms_in_order(inner))


def _packable(model) -> bool:
    """CPU float32 weights, oneDNN present, and the gate/up/down MLP layout."""
    mlp = model.model.layers[0].mlp
    return (cpu_linear.available(model.lm_head.weight)
            and all(hasattr(mlp, n) for n in MLP_PARTS))


# transformers' RMSNorms that compute w * (x * rsqrt(mean(x^2) + eps)), as cpu_ops does.
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


@dataclass(frozen=True, slots=True)
class _FusedOps:
    """The fused per-layer ops of one device: ``rms_norm(x, w, eps)``,
    ``add_rms_norm(x, residual, w, eps)`` (residual += x in place) and
    ``rotary_qk(q, k, cos, sin)`` (both rotated in place, returned)."""

    rms_norm: Callable
    add_rms_norm: Callable
    rotary_qk: Callable

    @staticmethod
    def cpu() -> "_FusedOps":
        return _FusedOps(cpu_ops.rms_norm, cpu_ops.add_rms_norm,
                         lambda q, k, cos, sin: (cpu_ops.rotary_(q, cos, sin), cpu_ops.rotary_(k, cos, sin)))

    @staticmethod
    def triton() -> "_FusedOps":
        from ..kernels import triton_ops  # noqa: PLC0415 - Triton loads only where it runs

        return _FusedOps(triton_ops.rms_norm, triton_ops.add_rms_norm, triton_ops.rotary_)


class FastCausalLM:
    """Forward over one flattened step (batch 1) with the paged attention of ``attention``."""

    def __init__(self, model, triton: bool | None = None) -> None:
        """``triton``: the fused Triton ops and packed GPU products (default: on CUDA, for
        models they cover; True forces them, e.g. on the CPU under ``TRITON_INTERPRET=1``)."""
        if not supports(model):
            raise ValueError(f"no kvharbor model path for {type(model).__name__}")
        self.model = model
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary = inner.rotary_emb
        family = FAMILIES[model.config.model_type]
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        self.apply_rotary = mod.apply_rotary_pos_emb
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # The window each layer passes to attention, as transformers' modules do (Qwen2 per
        # layer type, Mistral from the config, Llama none).
        self.windows = [getattr(layer.self_attn, "sliding_window",
                                getattr(cfg, "sliding_window", None) if family == "mistral" else None)
                        for layer in self.layers]
        on_gpu = model.lm_head.weight.device.type == "cuda"
        self.triton = (on_gpu if triton is None else triton) and _triton_fusable(model)
        packed = not self.triton and _packable(model)
        if self.triton:
            self.projections = [TritonLayer(layer) for layer in self.layers]
            self.lm_head = model.lm_head
        elif packed:
            _own_embedding(model)
            self.projections = [PackedLayer(layer) for layer in self.layers]
            self.lm_head = cpu_linear.PackedLinear(model.lm_head.weight, model.lm_head.bias)
            layers = [lin for p in self.projections for lin in p.linears()]
            cpu_linear.few_rows([self.lm_head] + layers)
            # The LM head's many-row products stay on oneDNN: a step asks it for a few rows
            # (logits of its last tokens), and at 32-512 rows MKL's was no faster (49,152 x
            # 576, Intel Xeon VM: 14.0 / 27.0 / 101 ms vs oneDNN's 10.7 / 28.6 / 98 ms).
            cpu_linear.many_rows(layers)
            # oneDNN's copies made where some row count reaches them, freed where none does.
            cpu_linear.settle([self.lm_head] + layers)
        else:
            self.projections = [ModuleLayer(layer) for layer in self.layers]
            self.lm_head = model.lm_head
        # The fused ops (packed CPU float32 weights, the standard RMSNorms, the ops built) take
        # each norm's weight and epsilon: [input_0, post_0, input_1, ..., final].
        norms = norms_in_order(inner)
        self.fused = (packed and all(type(n).__name__ in RMS_NORMS for n in norms)
                      and cpu_ops.available())
        self.norm_args = ([(n.weight.detach(), float(n.variance_epsilon)) for n in norms]
                          if self.fused or self.triton else [])
        self.ops = _FusedOps.triton() if self.triton else _FusedOps.cpu() if self.fused else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: attention.AttentionContext, logit_rows: torch.Tensor,
                lora: LoRABatch | None = None, kept: list | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]``; returns logits ``[len(logit_rows), vocab]``.
        ``lora``: the step's rows by LoRA adapter (None: every row the base model's).
        ``kept`` (a list): the final hidden states of those rows (after the last norm, what the
        LM head reads) are appended to it, an embedding request's (``pooling.py``)."""
        h = self.embed(input_ids[None])                              # [1, T, hidden]
        cos, sin = self.rotary(h, position_ids=positions[None])      # [1, T, D] each
        cos, sin = cos[0], sin[0]
        t, d = input_ids.shape[0], self.head_dim
        h = h[0]
        if self.ops is not None:
            return self._forward_fused(h, cos.contiguous(), sin.contiguous(), ctx, logit_rows, lora, kept)
        last = len(self.layers) - 1
        for i, (layer, window, p) in enumerate(zip(self.layers, self.windows, self.projections)):
            a = layer.self_attn
            hook = lora.hook(i) if lora else None
            q, k, v = p.qkv(layer.input_layernorm(h), hook)
            q, k = self.apply_rotary(q.view(t, -1, d), k.view(t, -1, d), cos, sin,
                                     unsqueeze_dim=1)                 # [T, H, D], [T, Hkv, D]
            o = attention.paged_step(q, k, v.view(t, -1, d), ctx, a.layer_idx, a.scaling, window,
                                     _read_rows(ctx, logit_rows) if i == last else None)
            o = o.view(t, -1)
            if i == last:
                if not logit_rows.numel():
                    return h.new_empty(0, self.lm_head.out_features)
                o, h = _sampled_rows(o, h, logit_rows)
                hook = lora.hook(i, sampled=True) if lora else None
            h = h + p.o(o, hook)
            if ctx.interrupt is not None:
                ctx.interrupt.check(i, before_mlp=True)      # may abandon the step (StepInterrupt)
            h = h + p.mlp(layer.post_attention_layernorm(h), hook)
        return self._head(self.norm(h), kept)

    def _forward_fused(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       ctx: attention.AttentionContext, logit_rows: torch.Tensor,
                       lora: LoRABatch | None, kept: list | None = None) -> torch.Tensor:
        """The forward above with each norm (the residual add folded in) and the rotary
        embedding of q and k one pass each: :mod:`..kernels.cpu_ops` (C++) on the CPU,
        :mod:`..kernels.triton_ops` on a GPU (there with the SiLU gate fused into ``p.mlp``).
        ``h`` ``[T, hidden]`` is the residual stream, added to in place."""
        ops = self.ops
        t, d, args = h.shape[0], self.head_dim, self.norm_args
        x = ops.rms_norm(h, *args[0])
        last = len(self.layers) - 1
        for i, (layer, window, p) in enumerate(zip(self.layers, self.windows, self.projections)):
            a = layer.self_attn
            hook = lora.hook(i) if lora else None
            q, k, v = p.qkv(x, hook)
            q, k = ops.rotary_qk(q.view(t, -1, d), k.view(t, -1, d), cos, sin)  # in place
            o = attention.paged_step(q, k, v.view(t, -1, d), ctx, a.layer_idx, a.scaling, window,
                                     _read_rows(ctx, logit_rows) if i == last else None)
            o = o.view(t, -1)
            if i == last:
                if not logit_rows.numel():
                    return h.new_empty(0, self.lm_head.out_features)
                o, h = _sampled_rows(o, h, logit_rows)
                hook = lora.hook(i, sampled=True) if lora else None
            x = ops.add_rms_norm(p.o(o, hook), h, *args[2 * i + 1])
            if ctx.interrupt is not None:
                ctx.interrupt.check(i, before_mlp=True)      # may abandon the step (StepInterrupt)
            m = p.mlp(x, hook)
            if i < last:
                x = ops.add_rms_norm(m, h, *args[2 * i + 2])
            else:
                h.add_(m)
        return self._head(ops.rms_norm(h, *args[-1]), kept)

    def _head(self, x: torch.Tensor, kept: list | None) -> torch.Tensor:
        if kept is not None:
            kept.append(x)
        return self.lm_head(x)


def _read_rows(ctx: attention.AttentionContext, logit_rows: torch.Tensor) -> list[int] | None:
    """The rows whose last-layer attention output is read: the sampled ones (ascending), on
    the CPU hot path, which then runs a prefill's attention from its first sampled row only
    (a 1,024-token prefill's last layer: one query row instead of 1,024, ~1/30 of its
    attention). None elsewhere (every row; no host sync on a GPU)."""
    return sorted(logit_rows.tolist()) if ctx.plan is not None else None


def _sampled_rows(o: torch.Tensor, h: torch.Tensor,
                  rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's attention output ``o`` and residual ``h`` at the rows the step samples.

    Past the last layer's attention, nothing of the other rows is needed: their K/V are in the
    cache by then, and only sampled rows reach the LM head. So a prefill's last layer runs its
    output projection and MLP for one row instead of the whole chunk (30 layers: ~3% of a
    1,024-token prefill's products). Row-wise, so the sampled rows' values are unchanged.
    """
    if rows.numel() == o.shape[0]:                   # every row samples (decode)
        return o, h
    return o.index_select(0, rows), h.index_select(0, rows)
