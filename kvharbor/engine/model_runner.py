"""Runs one engine step through a transformers model over the paged KV cache.

Batch building for a step with a prefill chunk (A, 3 tokens) and a decode (B)::

    input_ids   [a5 a6 a7 | b9]          positions [5 6 7 | 9]
    slot_map    [s(A,5) s(A,6) s(A,7) | s(B,9)]
    query_start [0, 3, 4]                 seq_lens  [8, 10]
    logits rows [2, 3]   (only requests whose prompt is fully computed sample)

A decode that verifies draft tokens (speculative decoding: B with drafts d1 d2) is a query of
its last token and the drafts, with a logits row at each: ``[b9 d1 d2]``, rows ``[3, 4, 5]``.

A request that asked for prompt logprobs also gets a logits row for each prompt position of its
chunk whose next token is a prompt token not yet scored (after the sampling rows); ``execute``
turns them into that request's ``prompt_lps``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvharbor.kernels import KV_CACHE_DTYPES, LayerKVCache, cpu_decode, get_attention_backend, plan_attention

from . import attention, fast_model
from .block_tables import StepBlockTable, token_slots
from .lora import LoRABatch
from .models import uniform_sliding_window
from .request import Request
from .logprobs import scored_logprobs, token_logprobs
from .host_memory import upload
from .sampling import sample, sample_on_device


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` starting at ``num_computed_tokens``."""

    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens >= r.num_tokens

    @property
    def num_drafts(self) -> int:
        """Draft tokens (``request.spec_token_ids``) this step computes after the request's
        last token; each gets a logits row (see ``spec_decode.py``)."""
        r = self.request
        return max(0, r.num_computed_tokens + self.num_new_tokens - r.num_tokens)


def kv_bytes_per_token(config, cache_dtype: torch.dtype) -> int:
    """Bytes of KV cache one token occupies across all layers of a model with HF ``config``
    (scales of quantized caches are per layer and head: no bytes per token)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = torch.empty((), dtype=cache_dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * elem


def _model_path(model, choice: str):
    """kvharbor's own forward (``FastCausalLM``) or None (transformers' forward)."""
    if choice not in ("auto", "kvharbor", "transformers"):
        raise ValueError(f"model_path must be 'auto', 'kvharbor' or 'transformers', got {choice!r}")
    if choice == "transformers" or (choice == "auto" and not fast_model.supports(model)):
        return None
    return fast_model.FastCausalLM(model)      # raises for an unsupported model when forced


class ModelRunner:
    """Owns the model, the KV cache tensors and the attention backend."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, attention_backend: str = "auto", kv_cache_dtype: str = "auto",
                 model_path: str = "auto"):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.last_logprobs: list = []     # TokenLogprobs | None per sampled row of the last step
        self._prompt_rows: list = []      # (request, first position, rows) scored by the last build
        self._sampling: list = []         # the request of each sampling row of the last build
        self.interrupt = None             # the engine's StepInterrupt (checked in the forward)
        self._hidden = None               # the last forward's sampling rows' final hidden states, when kept
        self.pooled: dict = {}            # the last step's embedding requests -> their hidden state
        self.graphs = None                # DecodeGraphs: decode steps replayed from CUDA graphs
        self._table = StepBlockTable()    # eager steps' block table, rows kept between steps
        self.backend = get_attention_backend(attention_backend, device)
        self.fast = _model_path(model, model_path)
        cfg = model.config
        self._hf_attention = cfg._attn_implementation
        self.sliding_window = uniform_sliding_window(cfg)
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or dtype
        # One row past the pool's blocks: the null block (id ``num_blocks``) that stands in for
        # blocks a sliding window released; attention masks it, nothing writes it.
        shape = (num_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        self.null_block_id = num_blocks
        self.caches = [LayerKVCache(torch.zeros(shape, dtype=self.kv_cache_dtype, device=device),
                                    torch.zeros(shape, dtype=self.kv_cache_dtype, device=device))
                       for _ in range(self.num_layers)]
        self.decode_kernel = (getattr(self.backend, "plans", False) and device.type == "cpu"
                              and self.kv_cache_dtype == dtype == torch.float32 and cpu_decode.available())
        if KV_CACHE_DTYPES[kv_cache_dtype] is not None:
            from .kv_calibration import calibrate_kv_scales  # noqa: PLC0415

            calibrate_kv_scales(self, self.kv_cache_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies across all layers (scales are per head, ~0)."""
        return kv_bytes_per_token(self.model.config, self.kv_cache_dtype)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the device KV cache tensors (all layers, K and V, null block included)."""
        return sum(c.key.nbytes + c.value.nbytes for c in self.caches)

    @functools.cached_property
    def weights_bytes(self) -> int:
        """Bytes of the model's parameters and buffers. Counted once: nothing adds to them
        after the model is built (LoRA adapters are held apart), and ``Engine.stats()``,
        which reports it, runs at every step of a replica, where walking every module took
        0.29 ms of a tiny model's step and 2.16 ms on a 30-layer 135M one."""
        return sum(t.nbytes for t in self.model.parameters()) + \
            sum(t.nbytes for t in self.model.buffers())

    def _build(self, batch: list[ScheduledRequest]):
        # Python touches each request once; positions and slots come from array operations
        # over the kept block table (a 1,024-token prefill's slots were 1,024 Python steps).
        ids, qsl, lens, starts, logit_rows = [], [0], [], [], []
        prompt_rows = []                        # (forward_logits cleared self._prompt_rows)
        sampling = []                           # each sampling row's request
        requests = []
        pools = False                           # an embedding request is in the step
        for item in batch:
            r, n = item.request, item.num_new_tokens
            pools = pools or r.pooling is not None
            start, tokens = r.num_computed_tokens, r.all_token_ids
            end = start + n
            drafts = end - len(tokens)          # >0: speculative tokens after its last
            ids += tokens[start:end]
            if drafts > 0:
                ids += r.spec_token_ids[:drafts]
            requests.append(r)
            starts.append(start)
            qsl.append(qsl[-1] + n)
            lens.append(end)
            if drafts >= 0:                     # every token computed: it samples
                logit_rows += range(qsl[-1] - 1 - drafts, qsl[-1])
                sampling += [r] * (1 + drafts)
            if r.prompt_lps_missing:            # positions first..last predict prompt tokens
                first, last = max(start, len(r.prompt_lps) - 1), min(end, len(r.prompt_token_ids) - 1)
                if first < last:
                    prompt_rows += range(qsl[-2] + first - start, qsl[-2] + last - start)
                    self._prompt_rows.append((r, first, last - first))
        self._sampling, self._pools = sampling, pools
        if prompt_rows:          # rows in token order (the model may take all rows as they are)
            order = {row: i for i, row in enumerate(sorted(logit_rows + prompt_rows))}
            self._selects = ([order[row] for row in logit_rows], [order[row] for row in prompt_rows])
            logit_rows = sorted(order)
        host_table = self._table.build(requests)
        pos, slots = token_slots(host_table.numpy(), starts, qsl, self.block_size)
        table = self._upload(host_table, torch.int32)
        ctx = attention.AttentionContext(
            self.caches, self.backend, self._upload(torch.from_numpy(slots), torch.int64), table,
            self._upload(lens, torch.int32), self._upload(qsl, torch.int32), max(lens))
        if getattr(self.backend, "plans", False):
            ctx.plan = plan_attention(table, lens, qsl, self.block_size, self.sliding_window,
                                      use_new_kv=self.kv_cache_dtype == self.dtype,
                                      pad_block=self.null_block_id,
                                      decode_kernel=self.decode_kernel)
            ctx.plan_window = self.sliding_window
        lora = None
        if any(r.lora is not None for r in requests):  # each token row's adapter (None: base)
            row_loras = [item.request.lora for item in batch for _ in range(item.num_new_tokens)]
            lora = LoRABatch(row_loras, logit_rows, self.device)
        return (self._upload(ids, torch.int64)[None], self._upload(torch.from_numpy(pos), torch.int64)[None],
                ctx, self._upload(logit_rows, torch.int64), lora)

    def _score_prompts(self, logits: torch.Tensor, hidden: torch.Tensor | None):
        """Append the prompt logprobs of the last build's prompt rows to their requests;
        return the sampling rows of ``logits`` and of ``hidden`` (None: None)."""
        rows, self._prompt_rows = self._prompt_rows, []
        sampling_sel, prompt_sel = (self._upload(s, torch.int64) for s in self._selects)
        targets = [r.all_token_ids[p + 1] for r, first, n in rows for p in range(first, first + n)]
        ks = [r.sampling.prompt_logprobs for r, _, n in rows for _ in range(n)]
        scored = iter(scored_logprobs(logits.index_select(0, prompt_sel), targets, ks))
        for r, _, n in rows:
            r.prompt_lps += [next(scored) for _ in range(n)]
        return logits.index_select(0, sampling_sel), hidden if hidden is None else hidden.index_select(0, sampling_sel)

    def _upload(self, values: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return upload(values, dtype, self.device)

    @torch.inference_mode()
    def forward_logits(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """Run the step; return logits ``[num_sampling_requests, vocab]``. ``self.interrupt``
        (a ``StepInterrupt``, or None) may raise ``StepInterrupted`` before any layer; a decode
        step replayed from a CUDA graph (``self.graphs``) is not checked."""
        self._prompt_rows, self._hidden = [], None
        if self.graphs is not None and self.graphs.eligible(batch):
            self._sampling = [item.request for item in batch]       # one row each (eligible)
            return self.graphs.forward_logits(batch)
        input_ids, positions, ctx, rows, lora = self._build(batch)
        ctx.interrupt = self.interrupt
        kept = [] if self._pools else None       # the rows' final hidden states (embeddings)
        if self.fast is not None:
            logits = self.fast.forward(input_ids[0], positions[0], ctx, rows, lora, kept)
        else:
            logits = self._hf_forward(input_ids, positions, ctx, rows, kept)
        self._hidden = kept[0] if kept else None
        return logits

    def _hf_forward(self, input_ids, positions, ctx, rows: torch.Tensor, kept: list | None) -> torch.Tensor:
        """transformers' forward of the model with kvharbor's paged attention; ``kept`` as
        ``FastModel.forward``'s (the decoder's last hidden state, read by a hook)."""
        keep = rows if rows.numel() else 1           # a pure prefill chunk samples nothing
        hook = None if kept is None else self.model.get_decoder().register_forward_hook(
            lambda module, args, out: kept.append(out.last_hidden_state[0].index_select(0, rows)))
        # The paged attention is switched on only for the engine's own forward, so
        # ``llm.hf_model`` stays a stock transformers model (the tests' oracle).
        self.model.config._attn_implementation = attention.ATTN_IMPLEMENTATION
        try:
            with attention.stepping(ctx):
                out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                 logits_to_keep=keep)
        finally:
            self.model.config._attn_implementation = self._hf_attention
            if hook is not None:
                hook.remove()
        return out.logits[0] if rows.numel() else out.logits[0, :0]

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledRequest], ahead: int = 0, prev=None):
        """Run a decode step from the graphs without waiting for its tokens (see
        ``DecodeGraphs.launch``); the caller collects them with ``tokens_on_host()``."""
        return self.graphs.launch(batch, sample_on_device, ahead, prev)

    def execute(self, batch: list[ScheduledRequest]) -> list[int]:
        """Run the step and sample one token per request whose tokens are all computed, and one
        per draft token it verifies (request order, then position); score the prompt tokens of
        requests that asked for prompt logprobs."""
        logits = self.forward_logits(batch)
        sampling, hidden = self._sampling, self._hidden
        if self._prompt_rows:
            logits, hidden = self._score_prompts(logits, hidden)
        # An embedding request's answer: its row's hidden state (Engine._account reads it).
        self.pooled = {} if hidden is None else \
            {r: hidden[i] for i, r in enumerate(sampling) if r.pooling is not None}
        tokens = sample(logits, sampling) if sampling else []
        self.last_logprobs = token_logprobs(logits, sampling, tokens)   # None where not asked
        return tokens
