"""benchmarks/attention_kernels.py and gpu_decode.py without a GPU: a clear message, exit status 0,
nothing written."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str = "attention_kernels"):
    spec = importlib.util.spec_from_file_location(f"kvharbor_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the benchmark runs")
@pytest.mark.parametrize("name", ["attention_kernels", "gpu_decode"])
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


@pytest.mark.parametrize("name, parse, argv", [
    ("routing", "parse", ["--out", "benchmarks/results/routing_s13.json"]),
    ("routing_decision", "parse", ["--out", "/tmp/rd.json"]),
    ("engine", "parse", ["--tag", "_s0/x"]),
    ("structured", "parse", ["--tag", "_s0/x"]),
    ("qos", "parse_args", ["--name", "qos.png"]),
])
def test_a_results_path_is_refused_when_the_arguments_are_parsed(name, parse, argv, capsys):
    """``--out`` / ``--name`` / ``--tag`` name a file under benchmarks/results/: a path used to
    fail only when the results were written, after the whole run (a stack trace, no JSON)."""
    bench = _load(name)
    with pytest.raises(SystemExit) as exc:
        getattr(bench, parse)(argv)
    assert exc.value.code == 2
    assert "give a name" in capsys.readouterr().err
    flag = argv[0]
    assert getattr(getattr(bench, parse)([flag, "ok_name"]), flag.lstrip("-")) == "ok_name"
