"""A step's block table kept from one step to the next, written only where it changed.

Row ``i`` holds the block ids of the request a step puts at position ``i``. A request's block
list only grows while it runs (``KVCacheManager`` appends to it), except when it is freed (a
new list) or blocks behind a sliding window are released (its ``window_start`` moves). So
while the request at a row has the same list and window start as at the last step that wrote
it, the row already holds that prefix and only the blocks appended since are written: a decode
step writes a block id every ``block_size`` tokens per request instead of every request's
whole table. Entries past a request's blocks are stale (another request's ids): every reader
bounds its reads by the sequence length.

A step's token positions and cache slots are read from that table with array operations
(:func:`token_slots`), so the Python of a step touches each request once, not each token.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTableRows:
    """Keeps ``table`` (a host ``int32`` array ``[rows, width]``) current, row by row."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        # Per row: (the request's block list, its window start, entries written), or None.
        self.written: list = [None] * table.shape[0]
        self.entries_written = 0          # block ids written so far (what a step's table costs)

    def write(self, i: int, request) -> int:
        """Make row ``i`` hold ``request``'s block ids; returns how many it has."""
        blocks, start, nb = request.blocks, request.window_start, len(request.blocks)
        w = self.written[i]
        done = w[2] if w is not None and w[0] is blocks and w[1] == start and w[2] <= nb else 0
        if done < nb:
            self.table[i, done:nb] = [b.block_id for b in blocks[done:]]
            self.entries_written += nb - done
        self.written[i] = (blocks, start, nb)
        return nb

    def forget(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` were written by someone else (padding): rewrite them next."""
        self.written[start:stop] = [None] * (stop - start)


class StepBlockTable:
    """The block table of a step's batch (``ModelRunner``'s, eager steps) on the CPU: a host
    tensor that grows to the most requests and blocks a step has needed."""

    def __init__(self) -> None:
        self.host = torch.zeros((0, 0), dtype=torch.int32)
        self.rows = BlockTableRows(self.host.numpy())

    def build(self, requests: list) -> torch.Tensor:
        """The table ``[len(requests), most blocks]`` of ``requests`` in this order: a view of
        the host tensor, valid until the next call."""
        n = len(requests)
        width = max(len(r.blocks) for r in requests)
        if n > self.host.shape[0] or width > self.host.shape[1]:
            self._grow(n, width)
        write = self.rows.write
        for i, r in enumerate(requests):
            write(i, r)
        return self.host[:n, :width]

    def _grow(self, n: int, width: int) -> None:
        rows, cols = self.host.shape
        bigger = torch.zeros((max(n, 2 * rows), max(width, 2 * cols)), dtype=torch.int32)
        bigger[:rows, :cols] = self.host          # the rows written so far stay written
        self.host, self.rows.table = bigger, bigger.numpy()
        self.rows.written += [None] * (bigger.shape[0] - rows)


def token_slots(table: np.ndarray, starts: list[int], qsl: list[int], block_size: int):
    """Positions and cache slots (``int64`` arrays ``[qsl[-1]]``) of a step's token rows:
    request ``i`` computes rows ``qsl[i]:qsl[i+1]`` from position ``starts[i]`` on, into the
    blocks of ``table`` row ``i`` (each request computes at least one token)."""
    n = len(starts)
    rows = np.arange(n)
    if qsl[-1] == n:                      # one token each (decodes): no per-token expansion
        pos = np.array(starts, dtype=np.int64)
    else:
        counts = np.diff(qsl)
        rows = np.repeat(rows, counts)
        pos = np.arange(qsl[-1], dtype=np.int64) + np.repeat(np.subtract(starts, qsl[:-1]), counts)
    return pos, table[rows, pos // block_size].astype(np.int64) * block_size + pos % block_size
