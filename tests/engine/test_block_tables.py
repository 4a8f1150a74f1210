"""The step's block table is kept between steps: each row is written only where its request's
blocks changed, and every row still holds exactly its request's block ids. A step's token
positions and cache slots, read from that table with array operations, are each token's own."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvharbor import LLM
from kvharbor.engine.block_tables import BlockTableRows, StepBlockTable, token_slots

from .conftest import greedy, hf_greedy, random_prompt


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


def test_forgetting_padded_rows_rewrites_those_rows_only():
    """Graph padding wrote rows 1 and 2: those are rewritten at the next write, rows 0 and 3
    still hold their requests' blocks and cost nothing."""
    rows = BlockTableRows(np.zeros((4, 8), dtype=np.int32))
    requests = [fake_request([10 * i + j for j in range(3)]) for i in range(4)]
    for i, r in enumerate(requests):
        rows.write(i, r)
    rows.table[1:3, :3] = 0
    rows.forget(1, 3)
    before = rows.entries_written
    for i, r in enumerate(requests):
        rows.write(i, r)
    assert rows.entries_written - before == 6 and len(rows.written) == 4
    assert [row(rows, i, 3) for i in range(4)] == [[0, 1, 2], [10, 11, 12], [20, 21, 22], [30, 31, 32]]


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


def expected_slots(blocks: list[list[int]], starts: list[int], counts: list[int], bs: int):
    """Each token's position and slot, one token at a time (what the step computed before)."""
    pos = [p for s, n in zip(starts, counts) for p in range(s, s + n)]
    slots = [blocks[i][p // bs] * bs + p % bs
             for i, (s, n) in enumerate(zip(starts, counts)) for p in range(s, s + n)]
    return pos, slots


def test_token_slots_are_each_tokens_own():
    """A prefill chunk starting mid-block, decodes, a draft verification and a fresh prefill
    in one step, rows of unequal length in a wider table; then a step of decodes only."""
    bs = 4
    blocks = [[7, 3, 11, 2], [5], [9, 8, 1], [4, 6, 10, 12, 13]]
    starts, counts = [5, 2, 6, 0], [9, 1, 4, 17]
    table = np.full((6, 8), -1, dtype=np.int32)
    for i, b in enumerate(blocks):
        table[i, :len(b)] = b
    qsl = np.concatenate([[0], np.cumsum(counts)]).tolist()
    pos, slots = token_slots(table[:4], starts, qsl, bs)
    assert (pos.tolist(), slots.tolist()) == expected_slots(blocks, starts, counts, bs)
    assert pos.dtype == slots.dtype == np.int64
    decodes = [14, 3, 9, 19]                     # one token each (the decodes-only path)
    pos, slots = token_slots(table[:4], decodes, [0, 1, 2, 3, 4], bs)
    assert (pos.tolist(), slots.tolist()) == expected_slots(blocks, decodes, [1] * 4, bs)
    assert pos.dtype == slots.dtype == np.int64
    big = np.array([[2**28, 2**29]], dtype=np.int32)   # slot ids past int32: computed in int64
    assert token_slots(big, [3], [0, 2], 16)[1].tolist() == [2**32 + 3, 2**32 + 4]
    assert token_slots(big, [17], [0, 1], 16)[1].tolist() == [2**33 + 1]


def test_every_step_computes_each_tokens_position_and_slot():
    """Chunked prefills next to decodes, through ``LLM.generate``: every
    eager step's positions and slot mapping equal each scheduled token's position and its
    request's block for it, and the run's greedy tokens equal transformers'."""
    llm = LLM(device="cpu", num_kv_blocks=512, block_size=16, max_num_batched_tokens=96)
    runner = llm.engine.runner
    build, steps = runner._build, []

    def checking_build(batch):
        ids, positions, ctx, rows, lora = build(batch)
        starts = [item.request.num_computed_tokens for item in batch]
        counts = [item.num_new_tokens for item in batch]
        blocks = [[b.block_id for b in item.request.blocks] for item in batch]
        pos, slots = expected_slots(blocks, starts, counts, 16)
        assert positions[0].tolist() == pos and ctx.slot_mapping.tolist() == slots
        steps.append(counts)
        return ids, positions, ctx, rows, lora

    runner._build = checking_build
    prompts = [random_prompt(150 + 41 * i, seed=i) for i in range(4)]
    outs = llm.generate(prompts, greedy(24))
    assert any(len(c) > 1 and max(c) > 1 and min(c) == 1 for c in steps)     # mixed steps ran
    assert [o.token_ids for o in outs] == hf_greedy(llm.hf_model, prompts, 24)
