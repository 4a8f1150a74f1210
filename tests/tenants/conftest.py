"""Fixtures for the tenants tests: a writable copy of the example file and a fake clock."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "tenants.yaml"
PACKAGED = REPO / "kvharbor" / "data" / "tenants.yaml"
T0 = 1_800_000_000.0          # 2027-01-15 08:00 UTC; the next UTC midnight is 57,600 s later


class FakeClock:
    """A settable Unix-seconds clock."""

    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    """A private copy of the example tenants.yaml."""
    path = tmp_path / "tenants.yaml"
    shutil.copy(EXAMPLE, path)
    return path
