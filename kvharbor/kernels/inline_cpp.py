"""C++ kernels built on first use with the system compiler (``torch.utils.cpp_extension``).

The build is cached under ``~/.cache/torch_extensions``. A missing compiler, headers or ninja
leaves the extension unavailable and the caller on its torch fallback. Every extension is built
with ``-fopenmp``: ATen's ``parallel_for`` is inlined from headers, and without OpenMP its
pragma is dropped and every call runs on one thread. At run time the extension shares torch's
own libgomp, already loaded under the same soname.
"""

from __future__ import annotations

import os
import threading


class InlineExtension:
    """One lazily built C++ extension; ``env`` set to ``0`` disables it."""

    def __init__(self, name: str, source: str, functions: list[str], env: str,
                 extra_cflags: tuple[str, ...] = ()) -> None:
        self.name, self.source, self.functions, self.env = name, source, functions, env
        self.cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        self.module = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        """True when built (building it now if needed) and not disabled by ``env``."""
        if os.environ.get(self.env, "1") == "0":
            return False
        with self._lock:
            if self.module is None and self.failed is None:
                try:
                    from torch.utils.cpp_extension import load_inline  # noqa: PLC0415

                    self.module = load_inline(self.name, cpp_sources=self.source,
                                              functions=self.functions, extra_cflags=self.cflags,
                                              extra_ldflags=["-fopenmp"], verbose=False)
                except Exception as e:  # noqa: BLE001 - no compiler, headers or ninja
                    self.failed = f"{type(e).__name__}: {e}"
        return self.module is not None
