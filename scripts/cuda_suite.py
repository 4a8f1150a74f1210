"""pytest plugin: the engine's tests with every engine on a CUDA GPU, in float32.

The engine tests build their engines with ``device="cpu"`` (or "auto") and compare them with
transformers on the CPU in float32. Loaded with ``-p cuda_suite`` (``scripts/`` on
``PYTHONPATH``), this plugin makes each ``Engine`` take the GPU whatever device it is given,
float32 where the test left the dtype to the engine, and a 4,096-block KV cache (the CPU
default) instead of a share of the GPU's free memory, so sixteen workers share one GPU. So
every feature the suite covers (prefix caching, preemption and swap, the host tier, spec
decode, LoRA, logprobs, penalties, quantized caches, sessions, ...) also runs through the CUDA
path: graphs, Triton kernels, pinned staging. A failure is either a CUDA bug or a test that
reads its engine's tensors as CPU tensors; the run's log says which. Used by
``scripts/gpu_checks.sh suite``. ``KVHARBOR_SUITE_DEVICE`` names another device (``cpu``
checks the wiring on a machine without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvharbor.engine import device as _device
from kvharbor.engine import engine as _engine

DEVICE = os.environ.get("KVHARBOR_SUITE_DEVICE", "cuda")


def _resolve_device(name: str) -> torch.device:
    _device.resolve_device(name)                 # the same refusals for bad names
    return torch.device(DEVICE)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return torch.float32 if name == "auto" else _device.resolve_dtype(name, device)


_engine.resolve_device = _resolve_device
_engine.resolve_dtype = _resolve_dtype
_engine.Engine._default_num_blocks = lambda self: 4096
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

CPU_ONLY = {
    # What these tests hold is the CPU path's own; on the H200 (2026-12-04) each failed for
    # that reason alone (the note beside each), not for a wrong token.
    "tests/engine/test_denormals.py": "flush-to-zero is set around the CPU forward only",
    "tests/engine/test_greedy_exact.py::test_steps_of_few_rows_through_either_product":
        "the CPU layers' few-row products (a CUDA TritonLayer has no such choice)",
    "tests/engine/test_greedy_exact.py::test_layers_drop_onednn_copies_no_row_count_reaches":
        "oneDNN's packed weights are CPU-only",
    "tests/engine/test_greedy_exact.py::test_last_layer_projects_only_the_sampled_rows":
        "asserts the CPU fused layers (CUDA runs the Triton layers)",
    "tests/engine/test_lora.py::test_adapters_and_base_in_one_batch_match_peft[modules]":
        "asserts the CPU layer path it forced",
    "tests/engine/test_host_memory.py::test_embedding_of_a_checkpoint_leaves_the_file_map":
        "the CPU engine's memory map of the checkpoint (CUDA weights leave it anyway)",
    "tests/engine/test_block_tables.py::test_every_step_table_holds_its_requests_blocks":
        "spies on the eager step's tables; CUDA decode steps replay graphs",
    "tests/engine/test_decode_graphs.py::test_graph_steps_write_only_their_slots":
        "runs the graph path on the CPU with a one-argument forward of its own",
    "tests/engine/test_step_interrupt.py::test_a_premium_arrival_cuts_a_decode_step":
        "a replayed decode graph has no layer boundary to cut at",
    "tests/engine/test_step_interrupt.py::test_no_cut_for_a_peer_prefill_a_lower_class":
        "a replayed decode graph has no layer boundary to cut at",
    "tests/engine/test_step_budget.py::test_an_idle_gap_between_steps_is_not_a_step_cost_sample":
        "steps run ahead on CUDA are untimed (Scheduler.untimed)",
    "tests/engine/test_step_budget.py::test_lower_classes_progress_even_when_one_step_costs":
        "spies on Scheduler.schedule, which a step run ahead does not call",
    "tests/engine/test_logprobs.py::test_offline_engine_reports_logprobs_per_generated_token":
        "equal to the last bit across batch shapes: CUDA products differ by ~1e-6 between them",
    "tests/kernels/test_engine_kernels.py::test_a_one_byte_cache_gets_more_blocks_from_the_same":
        "sizes the cache from GPU memory, which this plugin fixes at 4,096 blocks",
}
"""Tests not run under this plugin on CUDA (node id prefix -> why)."""


def pytest_collection_modifyitems(config, items):
    if torch.device(DEVICE).type != "cuda":
        return
    for item in items:
        why = next((why for prefix, why in CPU_ONLY.items() if item.nodeid.startswith(prefix)), None)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"CPU path: {why}"))


def pytest_report_header(config):
    return f"cuda_suite: every Engine on {DEVICE!r}, float32 unless a test names a dtype"


def pytest_runtest_logreport(report):
    """Each failure's traceback, to ``$KVHARBOR_SUITE_FAILURES`` as it happens: under xdist
    the summary comes only at the session's end, which a stage's time limit can cut off."""
    path = os.environ.get("KVHARBOR_SUITE_FAILURES")
    if path and report.failed:
        with open(path, "a") as out:
            out.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
