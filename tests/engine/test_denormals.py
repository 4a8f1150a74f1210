"""Subnormal floats are flushed to zero inside the model's forward on the CPU, and only there.

The slow path for subnormal activations made tiny-llama's decode steps ~25x slower on the main
thread; the flag is per thread and also changes how Python compares subnormal doubles, so the
engine sets it around the forward and clears it after (``kvharbor.engine.device.flush_denormals``).
"""

from __future__ import annotations

import threading

import torch

from kvharbor.engine.llm import LLM
from kvharbor.engine.request import SamplingParams

SUBNORMAL = 1e-39          # below float32's smallest normal (1.18e-38)


def _flushed() -> bool:
    return (torch.tensor([SUBNORMAL]) * 1.0).item() == 0.0


def test_the_forward_runs_with_subnormals_flushed_and_the_caller_keeps_them():
    llm = LLM("kvharbor/tiny-llama", device="cpu", num_kv_blocks=64)
    seen = []
    execute = llm.engine.runner.execute

    def spy(batch):
        seen.append(_flushed())
        return execute(batch)

    llm.engine.runner.execute = spy
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate(["subnormal"], params)
    worker = threading.Thread(target=lambda: llm.generate(["in a worker thread"], params))
    worker.start()
    worker.join()
    assert seen and all(seen), seen                       # every forward, in both threads
    assert not _flushed()                                 # restored for the caller
    assert 5e-324 > 0.0 and SamplingParams(top_p=5e-324).top_p > 0.0
