"""Decode steps run through the CUDA-graph runner's static buffers stay token-exact.

On a CPU nothing is captured (``capture=False``): the same padded static-buffer forward that a
CUDA graph records runs eagerly, so padding rows, bucket changes and stale table rows from a
wider earlier step are checked here; the replay itself is checked on a GPU by
``test_greedy_exact.py::test_cuda_bf16_greedy_matches_transformers_bf16``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvharbor import LLM
from kvharbor.engine.decode_graphs import DecodeGraphs

from .test_greedy_exact import run_and_compare


def snapshot(runner) -> list:
    """A copy of every layer's K and V cache."""
    return [(c.key.clone(), c.value.clone()) for c in runner.caches]


def restore(runner, before: list) -> None:
    for (k0, v0), c in zip(before, runner.caches):
        c.key.copy_(k0)
        c.value.copy_(v0)


def assert_wrote_only_the_batch_slots(runner, before: list, batch) -> None:
    """Since ``before``, every layer's cache changed at exactly the slots of the decode
    positions of ``batch``'s requests, apart from the null block (where padding rows write)."""
    bs = runner.block_size
    expected = {r.blocks[r.num_computed_tokens // bs].block_id * bs + r.num_computed_tokens % bs
                for r in (item.request for item in batch)}
    for (k0, v0), c in zip(before, runner.caches):
        changed = ((c.key != k0) | (c.value != v0)).flatten(2).any(-1).flatten().nonzero().flatten()
        assert {s for s in changed.tolist() if s // bs != runner.null_block_id} == expected


@pytest.mark.parametrize("model", ["kvharbor/tiny-llama", "kvharbor/tiny-mistral"])
def test_padded_decode_buffers_match_transformers(model, oracle_cache):
    # A small prefill budget staggers the requests, so decode batches of many sizes occur;
    # batches above 12 requests (16 prompts) are not eligible and run the ordinary path.
    llm = LLM(model=model, device="cpu", num_kv_blocks=1024, max_num_batched_tokens=96)
    runner = llm.engine.runner
    runner.graphs = graphs = DecodeGraphs(runner, max_batch=12, max_model_len=llm.engine.max_model_len,
                                          capture=False)
    run_and_compare(llm, model, oracle_cache)
    assert graphs.steps >= 5 and graphs.padded_steps > 0


def test_only_decode_steps_are_eligible():
    llm = LLM(device="cpu", num_kv_blocks=64)
    graphs = DecodeGraphs(llm.engine.runner, max_batch=4, max_model_len=256, capture=False)
    assert graphs.buckets == [1, 2, 4]
    # more requests per step than the largest bucket: those steps run eagerly
    assert DecodeGraphs(llm.engine.runner, max_batch=1000, max_model_len=256,
                        capture=False).buckets[-1] == 256

    class Item:
        def __init__(self, n, samples=True, lora=None, pooling=None):
            self.num_new_tokens, self.samples = n, samples
            self.request = SimpleNamespace(lora=lora, pooling=pooling)

    assert graphs.eligible([Item(1)] * 4)
    assert not graphs.eligible([Item(1)] * 5)           # above the largest bucket
    assert not graphs.eligible([Item(1), Item(2)])      # a prefill chunk in the step
    assert not graphs.eligible([Item(1, samples=False)])
    assert not graphs.eligible([])
    assert not graphs.eligible([Item(1), Item(1, lora=object())])   # the graphs hold no adapter
    assert not graphs.eligible([Item(1), Item(1, pooling=object())])   # nor keep hidden states


def test_a_padded_step_writes_kv_only_at_its_requests_slots():
    """Three requests in a bucket of four: the padding row writes only the null block, and the
    logits equal the ordinary path's on the same step."""
    import torch

    from kvharbor import SamplingParams
    from kvharbor.engine.model_runner import ScheduledRequest

    llm = LLM(device="cpu", num_kv_blocks=64)
    engine, runner = llm.engine, llm.engine.runner
    for i, n in enumerate((5, 20, 37)):
        engine.add_request(f"r{i}", list(range(60 * i + 1, 60 * i + n + 1)),  # no shared block
                           SamplingParams(max_tokens=8, temperature=0.0))
    engine.step()                                         # every prompt prefilled in one step
    batch = [ScheduledRequest(r, 1) for r in engine.requests.values()]
    assert all(item.samples for item in batch)
    graphs = DecodeGraphs(runner, max_batch=4, max_model_len=256, capture=False)
    before = snapshot(runner)
    logits = graphs.forward_logits(batch).clone()
    assert graphs.padded_steps == 1
    assert_wrote_only_the_batch_slots(runner, before, batch)
    restore(runner, before)
    assert torch.allclose(logits, runner.forward_logits(batch), atol=1e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.integers(1, 60), min_size=1, max_size=8),
       max_batch=st.integers(1, 8), max_tokens=st.integers(2, 6))
def test_graph_steps_write_only_their_slots_and_match_the_ordinary_path(prompts, max_batch, max_tokens):
    """Random batches through a whole generation: at every graph step the KV cache changes at
    exactly the batch's own slots (padding touches only the null block) and the logits equal
    the ordinary path's on the same inputs."""
    import torch

    from kvharbor import SamplingParams

    llm = LLM(device="cpu", num_kv_blocks=128, max_num_batched_tokens=64)
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(runner, max_batch=max_batch, max_model_len=256, capture=False)
    graph_forward = graphs.forward_logits

    def checked(batch):
        before = snapshot(runner)
        runner.graphs = None
        want = runner.forward_logits(batch)                    # the ordinary path, same step
        runner.graphs = graphs
        restore(runner, before)
        got = graph_forward(batch)
        assert_wrote_only_the_batch_slots(runner, before, batch)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        return got

    graphs.forward_logits = checked
    runner.graphs = graphs
    rng = random.Random(len(prompts) * 100 + max_batch)
    for i, n in enumerate(prompts):
        engine.add_request(f"r{i}", [rng.randrange(3, 250) for _ in range(n)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason is not None:
                outs[out.request_id] = out
    assert all(len(o.token_ids) == max_tokens for o in outs.values()) and len(outs) == len(prompts)
    assert graphs.steps > 0 or len(prompts) > max_batch     # decode steps of the whole batch fit
    llm.check_integrity()


@pytest.mark.parametrize("run_ahead", [False, True], ids=["waiting", "ahead"])
def test_staged_block_tables_equal_the_requests_blocks(run_ahead):
    """Rows are written incrementally (only blocks added since the row's last write): after
    staging, each row still equals its request's block ids, as requests finish and rows
    shift and as the sliding window replaces released blocks with the null block."""
    from kvharbor import SamplingParams

    llm = LLM(model="kvharbor/tiny-mistral", device="cpu", num_kv_blocks=256,
              max_num_batched_tokens=64, block_size=8)
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(runner, max_batch=8, max_model_len=engine.max_model_len, capture=False)
    runner.graphs, engine.async_scheduling = graphs, run_ahead
    stage, checked = graphs.forward_logits, []

    def staged(batch, *args):
        out = stage(batch, *args)
        table = graphs.np[(graphs.steps - 1) % 2]["table"]
        for i, item in enumerate(batch):
            want = [blk.block_id for blk in item.request.blocks]
            assert table[i, :len(want)].tolist() == want, f"row {i}"
        checked.append(len(batch))
        return out

    graphs.forward_logits = staged
    rng = random.Random(41)
    for i in range(6):
        engine.add_request(f"r{i}", [rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))],
                           SamplingParams(max_tokens=40 + 12 * i, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.window_freed > 0 and len(set(checked)) > 2
    assert (engine.steps_ahead > 0) == run_ahead
