"""The vLLM peer of the engine benchmarks runs as vLLM ships unless told otherwise."""

from __future__ import annotations

from benchmarks.engine_peers import vllm_env


def test_vllm_peer_does_not_inherit_kvharbor_huge_pages(tmp_path, monkeypatch):
    """Importing kvharbor's engine sets THP_MEM_ALLOC_ENABLE in the benchmark's process; the
    peer would inherit it and stop being vLLM as its users run it. Asked for, it gets it."""
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert "THP_MEM_ALLOC_ENABLE" not in vllm_env(tmp_path)
    assert vllm_env(tmp_path, huge_pages=True)["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert vllm_env(tmp_path, huge_pages=True)["THP_MEM_ALLOC_ENABLE"] == "1"
