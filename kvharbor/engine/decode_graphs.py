"""Decode steps replayed from CUDA graphs.

A decode step (every scheduled request computes one token and samples) launches a few hundred
small kernels; on a GPU the host cannot launch them as fast as the GPU runs them (a 1.2B Llama
at batch 64 on an H200: 11.8 ms a step eagerly against 0.86 ms of memory traffic). So on CUDA,
with the Triton backend and kvharbor's own model path, the runner records the forward of such a
step once per *key* (batch bucket, split-K count) as a CUDA graph and replays it afterwards.

The graphs read static input tensors, shared by all of them. Row ``i`` is request ``i`` of the
step; rows past the batch, up to its bucket, are padding::

    input_ids, positions, slot_mapping  [M]      seq_lens [M]      query_start_loc [M + 1]
    block_tables [M, W]   (W = blocks of the longest sequence the model allows)

A padding row is a one-token sequence on the null block (slot ``null_block * block_size``,
length 1): attention reads it and no request's KV changes. Each step writes its rows into
pinned host copies of these tensors and copies them to the device without blocking, then
replays; the logits are the first ``len(batch)`` rows of the graph's output. The split-K count
is part of the key because the attention kernel's grid depends on it (it follows the longest
sequence of the step).

Host buffers come in two sets, used by alternate steps, so a step launched ahead stages into
the set the step in flight does not read; each set's copies are followed by an event that is
waited for before the set is written again.

What a graphed step does not do: check the engine's step interrupt before each layer (a decode
step is a few milliseconds on a GPU). ``capture=False`` runs the same static-buffer forward
eagerly, which is how the padding is tested on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import attention
from .block_tables import BlockTableRows, token_slots

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
"""Batch sizes captured: a step of ``n`` requests replays the smallest bucket >= ``n``."""


@dataclass(slots=True)
class Launched:
    """A decode step launched and not yet collected: ``batch`` (``ScheduledRequest``s), the
    sampled ids on the device (``tokens``) and their host copy, complete once ``done`` fires."""

    batch: list
    tokens: torch.Tensor
    host: torch.Tensor
    done: object                 # torch.cuda.Event, or None on the CPU (already complete)

    def tokens_on_host(self) -> list[int]:
        """The sampled ids, waiting for the step to finish (the host's one sync per step)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class DecodeGraphs:
    """The decode-step graphs of one :class:`~kvharbor.engine.model_runner.ModelRunner`."""

    def __init__(self, runner, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """``max_batch``: the most requests a step may hold (capped at ``BUCKETS[-1]``; larger
        decode steps run eagerly)."""
        if runner.fast is None:
            raise ValueError("decode graphs need kvharbor's model path (model_path='kvharbor')")
        self.runner = runner
        self.capture = capture
        max_batch = min(max_batch, BUCKETS[-1])
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        m, bs = self.buckets[-1], runner.block_size
        self.max_batch = m
        self.max_blocks = -(-max_model_len // bs)
        self.null_block = runner.null_block_id
        dev, pin = runner.device, runner.device.type == "cuda"

        shapes = {"ids": ((m,), torch.int64, 0), "pos": ((m,), torch.int64, 0),
                  "slots": ((m,), torch.int64, self.null_block * bs), "lens": ((m,), torch.int32, 1),
                  "table": ((m, self.max_blocks), torch.int32, self.null_block),
                  "prev_rows": ((m,), torch.int64, 0), "tokens": ((m,), torch.int64, 0)}
        # Two sets of pinned host buffers, used by alternate steps: a step launched ahead
        # (``launch``) stages its inputs while the copies of the step before it may still be
        # queued behind the GPU's work; the step two back has always been collected.
        self.host = [{k: torch.full(shape, fill, dtype=dt, pin_memory=pin)
                      for k, (shape, dt, fill) in shapes.items()} for _ in range(2)]
        self.np = [{k: t.numpy() for k, t in h.items()} for h in self.host]
        # Per set: its table's rows, each rewritten only where its request's blocks changed.
        self.rows = [BlockTableRows(arrays["table"]) for arrays in self.np]
        # Per set: an event after the copies that read it (None on a CPU or before any),
        # waited for before the set is written again. A decode step that the engine runs
        # between two launched ones (e.g. ``pin_prefix`` of one token) could otherwise make a
        # launched step's set come round again before its copies ran.
        self.copied: list = [None, None]
        self.launches = 0
        self.d_ids, self.d_pos, self.d_slots, self.d_lens, self.d_table = (
            self.host[0][k].to(dev, copy=True) for k in ("ids", "pos", "slots", "lens", "table"))
        self.d_prev_rows = torch.zeros(m, dtype=torch.int64, device=dev)
        self.d_qsl = torch.arange(m + 1, dtype=torch.int32, device=dev)       # one token each
        self.d_rows = torch.arange(m, dtype=torch.int64, device=dev)          # every row samples
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0                  # graph replays (capture=True)
        self.padded_steps = 0             # steps whose batch was padded up to its bucket
        self.steps = 0

    def eligible(self, batch) -> bool:
        """A decode step the graphs can run: every request one token and sampling, none of a
        LoRA adapter (the graphs hold the base model's products only) or an embedding request
        (whose hidden state they do not keep)."""
        return (0 < len(batch) <= self.max_batch
                and all(item.num_new_tokens == 1 and item.samples and item.request.lora is None
                        and item.request.pooling is None for item in batch))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def forward_logits(self, batch, ahead: int = 0, prev: "Launched | None" = None) -> torch.Tensor:
        """Logits ``[len(batch), vocab]`` of a decode step (``eligible(batch)`` holds).

        ``ahead`` = 1, ``prev``: the step computes each request's position
        ``num_computed_tokens + 1``, whose token ``prev`` (the launched step before it, which
        computes ``num_computed_tokens``) sampled and still holds on the device: the ids are
        gathered there, not read from the host."""
        n, bs = len(batch), self.runner.block_size
        b = self.bucket(n)
        parity = self.steps % 2
        host, arrays, rows = self.host[parity], self.np[parity], self.rows[parity]
        if self.copied[parity] is not None:    # its last copies out have run (at once, in
            self.copied[parity].synchronize()  # steady state: that step was collected)
        self.steps += 1
        self.padded_steps += n < b
        ids, pos, slots, lens, table = (arrays[k] for k in ("ids", "pos", "slots", "lens", "table"))
        reqs = [item.request for item in batch]
        write = rows.write
        width = max(write(i, r) for i, r in enumerate(reqs))
        starts = [r.num_computed_tokens + ahead for r in reqs]
        pos[:n], slots[:n] = token_slots(table, starts, range(n + 1), bs)
        lens[:n] = pos[:n] + 1
        ids[:n] = [r.all_token_ids[p] for r, p in zip(reqs, starts)] if prev is None else 0
        if n < b:                              # padding rows: one token on the null block
            ids[n:b], pos[n:b], lens[n:b] = 0, 0, 1
            slots[n:b] = self.null_block * bs
            table[n:b, 0] = self.null_block
            rows.forget(n, b)
        for name in ("ids", "pos", "slots", "lens"):
            getattr(self, f"d_{name}")[:b].copy_(host[name][:b], non_blocking=True)
        self.d_table[:b, :width].copy_(host["table"][:b, :width], non_blocking=True)
        if prev is not None:                   # this step's ids: the tokens prev sampled
            index = {id(item.request): j for j, item in enumerate(prev.batch)}
            arrays["prev_rows"][:n] = [index[id(item.request)] for item in batch]
            self.d_prev_rows[:n].copy_(host["prev_rows"][:n], non_blocking=True)
            torch.index_select(prev.tokens, 0, self.d_prev_rows[:n], out=self.d_ids[:n])
        if self.runner.device.type == "cuda":
            self.copied[parity] = torch.cuda.Event()
            self.copied[parity].record()
        max_len = int(lens[:n].max())
        if not self.capture:
            return self._forward(b, max_len)[:n]
        key = (b, self._splits(b, max_len))
        if key not in self.graphs:
            self.graphs[key] = self._record(b, max_len)
        graph, logits = self.graphs[key]
        graph.replay()
        self.replays += 1
        return logits[:n]

    def launch(self, batch, sample, ahead: int = 0, prev: "Launched | None" = None) -> "Launched":
        """Stage, replay and sample a decode step without waiting for it: ``sample(logits,
        requests)`` picks the tokens on the device, and they are copied to pinned host memory
        behind an event that :meth:`Launched.tokens_on_host` waits for. ``ahead``/``prev`` as
        in :meth:`forward_logits`. The logits are not kept (the next replay overwrites them)."""
        logits = self.forward_logits(batch, ahead, prev)
        tokens = sample(logits, [item.request for item in batch])
        n = len(batch)
        self.launches += 1
        if self.runner.device.type != "cuda":
            return Launched(batch, tokens, tokens, None)
        # Alternate by launch: launch k's copy is read (collected) before launch k + 2.
        out = self.host[self.launches % 2]["tokens"][:n]
        out.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(batch, tokens, out, done)

    def _splits(self, b: int, max_len: int) -> int:
        r = self.runner
        return r.backend.decode_splits(b, r.num_kv_heads, max_len, r.device)

    def _forward(self, b: int, max_len: int) -> torch.Tensor:
        r = self.runner
        ctx = attention.AttentionContext(r.caches, r.backend, self.d_slots[:b], self.d_table[:b],
                                         self.d_lens[:b], self.d_qsl[:b + 1], max_len)
        return r.fast.forward(self.d_ids[:b], self.d_pos[:b], ctx, self.d_rows[:b])

    def _record(self, b: int, max_len: int):
        """Warm up (compiles kernels; writes the same K/V the replay writes) and capture."""
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            self._forward(b, max_len)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(b, max_len)
        return graph, logits
