"""The step's block table is kept between steps: each row is written only where its request's
blocks changed, and every row still holds exactly its request's block ids."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvharbor import LLM
from kvharbor.engine.block_tables import BlockTableRows, StepBlockTable

from .conftest import greedy, random_prompt


def fake_request(ids: list[int], window_start: int = 0) -> SimpleNamespace:
    return SimpleNamespace(blocks=[SimpleNamespace(block_id=i) for i in ids], window_start=window_start)


def row(rows: BlockTableRows, i: int, n: int) -> list[int]:
    return rows.table[i, :n].tolist()


def test_a_growing_request_writes_only_its_new_blocks():
    rows = BlockTableRows(np.zeros((4, 8), dtype=np.int32))
    r = fake_request([5, 9, 2])
    assert rows.write(0, r) == 3 and rows.entries_written == 3
    assert rows.write(0, r) == 3 and rows.entries_written == 3        # unchanged: nothing written
    r.blocks.append(SimpleNamespace(block_id=7))
    assert rows.write(0, r) == 4 and rows.entries_written == 4
    assert row(rows, 0, 4) == [5, 9, 2, 7]


def test_a_new_list_another_request_or_a_moved_window_rewrites_the_row():
    rows = BlockTableRows(np.zeros((4, 8), dtype=np.int32))
    r = fake_request([5, 9, 2])
    rows.write(0, r)
    r.blocks = [SimpleNamespace(block_id=i) for i in (1, 3)]          # freed, then reallocated
    rows.write(0, r)
    assert row(rows, 0, 2) == [1, 3]
    other = fake_request([4, 6])                                       # another request at row 0
    rows.write(0, other)
    assert row(rows, 0, 2) == [4, 6]
    other.blocks[0] = SimpleNamespace(block_id=99)                     # released behind a window
    other.window_start = 1
    rows.write(0, other)
    assert row(rows, 0, 2) == [99, 6]
    rows.write(1, other)
    rows.table[1, :2] = [8, 8]                                         # padding wrote row 1
    rows.forget(1, 2)
    rows.write(1, other)
    assert row(rows, 1, 2) == [99, 6]


def test_every_step_table_holds_its_requests_blocks_and_costs_its_new_blocks():
    """A decode run through the engine: each eager step's table rows equal the block ids of the
    request at that row, and over the whole run the table wrote about one entry per block a
    request ever held, not one per block per step (the code before wrote every request's whole
    list at every step: ~40x more here)."""
    llm = LLM(device="cpu", num_kv_blocks=512, block_size=16)
    runner = llm.engine.runner
    table = runner._table
    build, checked = table.build, []

    def checking_build(requests):
        out = build(requests)
        for i, r in enumerate(requests):
            assert out[i, :len(r.blocks)].tolist() == [b.block_id for b in r.blocks]
        checked.append(len(requests))
        return out

    table.build = checking_build
    prompts = [random_prompt(200 + 7 * i, seed=i) for i in range(4)]
    outs = llm.generate(prompts, greedy(64))
    assert [len(o.token_ids) for o in outs] == [64] * 4
    assert len(checked) >= 64 and max(checked) == 4
    held = sum(-(-(len(p) + 64) // 16) for p in prompts)               # blocks at the end
    assert held <= table.rows.entries_written <= 2 * held


def test_the_table_grows_keeping_what_it_wrote():
    table = StepBlockTable()
    a, b = fake_request([1, 2]), fake_request([3])
    table.build([a, b])
    written = table.rows.entries_written
    a.blocks += [SimpleNamespace(block_id=i) for i in range(10, 40)]  # wider than the table
    c = fake_request([7, 8, 9])
    out = table.build([a, b, c])
    assert out.shape == (3, 32)
    assert out[0].tolist() == [1, 2] + list(range(10, 40))
    assert out[1, :1].tolist() == [3] and out[2, :3].tolist() == [7, 8, 9]
    assert table.rows.entries_written == written + 30 + 3              # b kept, a only its new
