"""benchmarks/kernels.py and gpu_decode.py without a GPU: a clear message, exit status 0,
nothing written."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str = "kernels"):
    spec = importlib.util.spec_from_file_location(f"kvharbor_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the benchmark runs")
@pytest.mark.parametrize("name", ["kernels", "gpu_decode"])
def test_benchmark_without_gpu_writes_nothing(name, tmp_path, capsys):
    bench = _load(name)
    assert bench.main(["--out", str(tmp_path / "results")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


def test_hbm_peak_is_detected_from_the_device_name():
    bench = _load()
    assert bench.detect_peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench.detect_peak_gbps("NVIDIA H100 PCIe") == 2000.0
    assert bench.detect_peak_gbps("NVIDIA H200") == 4800.0
    assert bench.detect_peak_gbps("NVIDIA A100-SXM4-80GB") is None
