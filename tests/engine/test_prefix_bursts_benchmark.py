"""benchmarks/prefix_bursts.py's workload and its rule-off arm: the arm it compares against
really is the engine without one-prefill-per-shared-prefix, and the engine is left as it was."""

from __future__ import annotations

import argparse

from kvharbor import LLM
from kvharbor.engine.scheduler import Scheduler

from benchmarks.prefix_bursts import hit_share, ours_round, workload


def test_each_groups_copies_share_exactly_the_system_prompt_and_arrive_interleaved():
    args = argparse.Namespace(seed=3, groups=4, copies=3, prefix_tokens=64)
    prompts = workload(args, 256)
    assert len(prompts) == 12 and all(80 <= len(p) <= 128 for p in prompts)
    systems = [tuple(p[:64]) for p in prompts]
    assert sorted(systems.count(s) for s in set(systems)) == [3, 3, 3, 3]
    assert systems != sorted(systems, key=systems.index)          # not group by group
    assert workload(args, 256) == prompts


def test_the_rule_off_arm_recomputes_the_prefix_and_puts_the_rule_back():
    args = argparse.Namespace(seed=1, groups=2, copies=4, prefix_tokens=128)
    prompts = workload(args, 256)
    llm = LLM(device="cpu", num_kv_blocks=256)
    on = ours_round(llm, prompts, 2, sharing=True)
    off = ours_round(llm, prompts, 2, sharing=False)
    assert on["outputs"] == off["outputs"]
    bound = 6 * 128 / sum(map(len, prompts))
    assert abs(hit_share(on, prompts) - bound) < 1e-9 and hit_share(off, prompts) < bound - 0.2
    assert "_joins_computing" not in vars(llm.engine.scheduler)
    assert llm.engine.scheduler._joins_computing.__func__ is Scheduler._joins_computing
