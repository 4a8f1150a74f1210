"""The C++ extensions' build folder: a lock file left by a killed build does not hang the next
load (a replica stuck in ``__init__`` for good after Ctrl-C during the first start)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from kvharbor.config import EngineConfig
from kvharbor.engine import engine as engine_module
from kvharbor.kernels import build_cpu_kernels, cpu_ops, cpu_prefill, inline_cpp


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here: nothing is built")
def test_a_lock_file_left_by_a_killed_build_does_not_stop_the_next_load():
    """torch's lock file (``FileBaton``) in the built extension's folder, as a builder killed
    mid-build leaves it: a new process still loads the extension, in seconds. (Without the
    flock that clears it, the load waited on that file for good: the child timed out.)"""
    folder = cpu_ops._EXT.build_directory()
    assert (folder / "lock").exists() is False
    (folder / "lock").touch()
    code = textwrap.dedent("""
        from kvharbor.kernels import cpu_ops
        assert cpu_ops.available(), cpu_ops._EXT.failed
        print("loaded")
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the load waited on the stale lock file for 120 s")
    finally:
        (folder / "lock").unlink(missing_ok=True)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]


def test_build_all_compiles_the_extensions_side_by_side(monkeypatch):
    """Each build waits (at a barrier) until every other has started: run one after another,
    the first would wait until the barrier breaks and none would finish. One already built is
    not built again."""
    barrier, finished = threading.Barrier(3, timeout=10), []

    class Build:
        module = failed = None

        def __init__(self, name: str) -> None:
            self.name = name

        def available(self) -> bool:
            barrier.wait()
            finished.append(self.name)
            return True

    built = Build("built")
    built.module, built.available = object(), lambda: finished.append("built again")
    monkeypatch.setattr(inline_cpp, "EXTENSIONS", [Build("a"), built, Build("b"), Build("c")])
    inline_cpp.build_all()
    assert sorted(finished) == ["a", "b", "c"]


def test_a_cpu_engine_builds_its_kernels_first(monkeypatch):
    """The engine asks for all of them at once before loading its model, not one at a time at
    each first use."""
    calls = []
    monkeypatch.setattr(engine_module, "build_cpu_kernels", lambda: calls.append("built"))
    engine_module.Engine(EngineConfig(model="kvharbor/tiny-llama", device="cpu", num_kv_blocks=16))
    assert calls == ["built"]


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here: nothing is built")
def test_no_kernel_build_parses_torchs_whole_cpp_frontend():
    """``torch/extension.h`` (autograd, nn, optim, serialization...) was most of each build's
    time: 50-57 s per extension fresh, 20-25 s without it. Each built source includes only the
    ATen and pybind headers it uses."""
    build_cpu_kernels()
    names = {ext.name for ext in inline_cpp.EXTENSIONS}
    assert {"kvharbor_cpu_ops", "kvharbor_cpu_gemv", "kvharbor_cpu_decode",
            "kvharbor_cpu_prefill"} <= names
    for ext in inline_cpp.EXTENSIONS:
        assert ext.module is not None, ext.failed
        source = (ext.build_directory() / "main.cpp").read_text()
        assert "torch/extension.h" not in source, ext.name
        assert "#include <ATen/core/Tensor.h>" in source, ext.name


def test_each_python_environment_builds_in_a_folder_of_its_own(monkeypatch):
    """Two virtualenvs (different include paths) never rebuild each other's copy."""
    here = cpu_ops._EXT.build_directory()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv")
    assert cpu_ops._EXT.build_directory() != here
    assert cpu_ops._EXT.build_directory().parent == here.parent


def test_torch_extensions_dir_moves_the_builds(monkeypatch, tmp_path):
    """``TORCH_EXTENSIONS_DIR`` (torch's own switch, e.g. for a read-only home folder) is where
    the kernels build; without it, torch's default cache folder."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    default = cpu_ops._EXT.build_directory()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_ops._EXT.build_directory() == tmp_path / default.name


@pytest.mark.skipif(not cpu_prefill.available(), reason="no C++ compiler here: nothing is built")
def test_other_threads_run_python_while_a_kernel_computes():
    """The kernels run without the GIL, like torch's own ops: while a replica's step thread
    is inside one, its event loop keeps streaming tokens and taking arrivals. A thread counts
    in Python while the main thread is in a prefill kernel call, then for as long again while
    the main thread sleeps. (Bound with ``load_inline(functions=...)``, a call held the GIL
    throughout: the counter moved 6-7 % as far during the call as during the sleep.)"""
    torch.manual_seed(0)
    T, H, D = 2048, 8, 64
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    out = torch.empty(T, H, D)
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # the counter has a core of its own on 2 cores
    worker = threading.Thread(target=counter)
    worker.start()
    try:
        time.sleep(0.05)
        before, start = count[0], time.perf_counter()
        cpu_prefill.causal_attention(q, k, v, out, 0, D ** -0.5)
        took, during = time.perf_counter() - start, count[0] - before
        before = count[0]
        time.sleep(took)
        asleep = count[0] - before
    finally:
        stop.set()
        worker.join()
        torch.set_num_threads(threads)
    assert took > 0.02, "the call was too short to tell"
    assert during > 0.3 * asleep, (f"the counter moved {during} during a {took:.3f} s kernel "
                                   f"call, {asleep} while the caller slept as long")
