"""Where the engine runs: its device and dtype from the config's names, and the CPU's
flush-to-zero mode around the model's forward."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def flush_denormals(enabled: bool):
    """Treat subnormal floats as zero (FTZ/DAZ) in this thread's CPU math while the block runs.

    Subnormal activations take the CPU's slow path: with the builtin tiny-llama a decode step
    on the main thread took 448 ms instead of 17 ms (measured on the 2-core VM). The flag lives
    in the calling thread's floating-point control register and also changes how Python
    compares subnormal doubles, so it is set only around the model's forward and cleared
    after. Values below ~1.2e-38 become 0 there; sampled tokens do not change in practice.
    """
    if not enabled:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def resolve_device(name: str) -> torch.device:
    """``name`` ('cpu', 'cuda', 'cuda:N') as a device; 'auto': CUDA when available.

    Raises:
        ValueError: another device type, or CUDA asked for where this torch has none (torch
            itself would fail later, with a RuntimeError or an AssertionError).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count()       # 0 on a CPU-only torch
        if (device.index or 0) >= count:
            raise ValueError(f"device {name!r}: this machine's torch sees {count} CUDA device(s) "
                             f"(torch {torch.__version__}); use device='cpu' or 'auto'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``name`` as a dtype; 'auto': bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"dtype must be float32, float16, bfloat16 or auto, got {name!r}") from None
