"""The C++ extensions' build folder: a lock file left by a killed build does not hang the next
load (a replica stuck in ``__init__`` for good after Ctrl-C during the first start)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvharbor.kernels import cpu_ops


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


def test_each_python_environment_builds_in_a_folder_of_its_own(monkeypatch):
    """Two virtualenvs (different include paths) never rebuild each other's copy."""
    here = cpu_ops._EXT.build_directory()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv")
    assert cpu_ops._EXT.build_directory() != here
    assert cpu_ops._EXT.build_directory().parent == here.parent
