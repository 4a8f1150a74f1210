"""Every benchmark runs as a script (``python benchmarks/X.py``, as the docs say): Python puts
``benchmarks/`` first on the path then, and the Serve replicas the script starts inherit it, so
a benchmark file named like a package that a dependency probes for shadows it. transformers
probed for ``kernels`` (Hugging Face's kernel hub) and found ``benchmarks/kernels.py``: every
app-deploying benchmark failed at deploy ("cannot import name 'CUDAProperties' from
'kernels'") until it was renamed ``attention_kernels.py``."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import transformers.utils.import_utils as import_utils

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _script_names() -> set[str]:
    return {p.stem for p in BENCHMARKS.glob("*.py")} - {"__init__"}


def test_no_benchmark_is_named_like_a_package_transformers_probes_for():
    probed = set(re.findall(r'_is_package_available\("(\w+)"',
                            pathlib.Path(import_utils.__file__).read_text()))
    assert "kernels" in probed and len(probed) > 50        # the probe list was read
    assert not _script_names() & probed


def test_no_benchmark_is_named_like_an_installed_module():
    found = {n: importlib.util.find_spec(n) for n in _script_names()}
    shadowing = sorted(n for n, spec in found.items()     # not the benchmark itself (a test
                       if spec is not None                 # that put benchmarks/ on the path)
                       and BENCHMARKS not in pathlib.Path(spec.origin or "").parents)
    assert not shadowing
