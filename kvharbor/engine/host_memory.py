"""The engine process's host memory: freed buffers kept (CPU), large buffers in huge pages,
startup objects out of the GC, and host lists uploaded through pinned memory (``upload``).

**Freed buffers.** A CPU step allocates activations of a few to tens of MB (``[T, intermediate]`` for a
2,048-token prefill is 12 MB) and frees them at its end. glibc serves blocks that large with
``mmap`` and gives them back with ``munmap`` (or trims the heap top), so the next step touches
fresh pages: one page fault per 4 KB, on every step. Its dynamic threshold adapts only to
sizes it has just seen, and step sizes vary. vLLM's CPU docs ask for tcmalloc preloaded for
the same reason; kvharbor instead sets glibc's own knobs once, in-process (``mallopt``): blocks
up to 32 MB (glibc's largest mmap threshold) come from the heap, and up to 1 GiB of free heap
top is kept. Measured on the 2-core VM, tiny-llama's cold 1,024-token TTFT: 0.070-0.087 s
untuned, 0.066-0.069 s tuned (11 calls each).

The cost: the process keeps its peak host memory instead of returning it, as it would with
tcmalloc. ``KVH_HOST_MALLOC=system`` leaves glibc's defaults; other C libraries are left alone.

**Huge pages.** A CPU decode step at a few rows streams every weight once (the 135M model:
537 MB of fp32 per token), so it runs at the memory bandwidth the process gets, and in 4 KB
pages that is cut by TLB misses (twice over in a VM, whose page walks go through the host's
tables too). torch's CPU allocator advises blocks of 2 MB and more for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) when ``THP_MEM_ALLOC_ENABLE`` is set at its first allocation:
``import kvharbor.engine`` sets it unless it is set already (``THP_MEM_ALLOC_ENABLE=0`` opts
out), which covers the weights, their packed copies, the KV cache and a prefill's
activations. Measured on the 2-core Xeon VM, fresh processes in alternating order: streaming a
512 MB tensor 16.7-18.1 GB/s in 4 KB pages vs 25.3-26.3 GB/s in huge pages; the 135M model's
30 layers of 1-row products (MKL packed) 40-55 vs 26 ms; its batch-1 decode 17-23% more tokens/s
in three pairs, batch 16 within noise. A process whose torch allocated before the import keeps
4 KB pages: the engine logs a warning when a CPU engine starts with none
(:func:`huge_page_bytes`), and the kernel's ``transparent_hugepage`` set to ``never`` turns
them off whatever the process asks.

**Startup objects.** Loading transformers, the model and the tokenizer leaves ~380k objects
the cyclic garbage collector tracks; each full collection walks them all (~200 ms on the 2-core
VM), and serving triggers full collections by itself (every step allocates requests, outputs,
token lists). Those pauses landed inside steps: after a 64-request round, the next cold
1,024-token TTFTs were 0.07-0.12 s instead of 0.066. :func:`freeze_startup_objects` moves
everything alive once the engine is built into the GC's permanent generation (as vLLM's
engine core does after startup), so later collections walk only what serving allocates.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import gc
import logging
import os

import numpy as np
import torch

logger = logging.getLogger(__name__)


def upload(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor of ``dtype``) as a tensor on ``device``: on CUDA staged in
    pinned memory and copied without blocking the host (ordered before later kernels on the
    stream; a plain ``torch.tensor(..., device=...)`` would wait for the stream, stalling a step
    launched ahead of the previous one's results). A CPU tensor stays itself on a CPU device.
    A list goes through numpy, which reads Python numbers ~4x faster than ``torch.tensor``
    (64 ints: 2.9 against 10.8 us; 1,024: 20 against 76 us)."""
    if not isinstance(values, torch.Tensor):
        np_dtype = _NUMPY_DTYPES.get(dtype)
        values = (torch.from_numpy(np.array(values, dtype=np_dtype)) if np_dtype is not None
                  else torch.tensor(values, dtype=dtype))
    if device.type != "cuda":
        return values
    return values.pin_memory().to(device, non_blocking=True)


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                 torch.float64: np.float64, torch.bool: np.bool_}


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}


@functools.cache
def keep_freed_memory() -> bool:
    """Apply :data:`SETTINGS` once per process; True when glibc accepted all of them."""
    return _apply()


def _apply() -> bool:
    if os.environ.get("KVH_HOST_MALLOC", "keep") == "system":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):           # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS.items())


def huge_page_bytes() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages
    (``AnonHugePages`` of ``/proc/self/smaps_rollup``; 0 where that cannot be read)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_huge_pages() -> int:
    """:func:`huge_page_bytes`, with a warning when a CPU engine's process has none although
    nobody opted out (torch allocated before ``kvharbor.engine`` was imported)."""
    held = huge_page_bytes()
    if not held and os.environ.get("THP_MEM_ALLOC_ENABLE", "1") not in ("0", ""):
        logger.warning("no host memory is in huge pages: weights stream at 4 KB pages' bandwidth "
                       "(about 2/3 of it on the VMs measured). Set THP_MEM_ALLOC_ENABLE=1 in the "
                       "environment, or import kvharbor before torch allocates; check "
                       "/sys/kernel/mm/transparent_hugepage/enabled is not 'never'")
    return held


def freeze_startup_objects() -> int:
    """Once per process: collect, then exempt every surviving object from later collections
    (the first engine's model, tokenizer and libraries). Later engines in the same process
    (tests) are not frozen: freezing again would also pin whatever cyclic garbage they leave.
    Returns how many objects are frozen (``gc.get_freeze_count()``)."""
    _freeze_once()
    return gc.get_freeze_count()


@functools.cache
def _freeze_once() -> None:
    gc.collect()
    gc.freeze()
    # Frozen objects are never collected, at shutdown included: extension modules (Triton's
    # nanobind) then report them as leaks. Thawed at exit, they are freed.
    atexit.register(gc.unfreeze)
