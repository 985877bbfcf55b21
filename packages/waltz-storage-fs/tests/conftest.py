"""Fixtures shared by the fs engine's tests."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_storage_fs import format as fmt
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.powerloss import scratch_directory

sys.path.insert(0, str(Path(__file__).parent))  # the tests share test_recovery's helpers


@pytest.fixture
def crash_states(tmp_path: Path) -> Iterator[Path]:
    """Where a power-loss test writes each crash state and the real engine opens it: a
    tmpfs when there is one (the power loss is simulated: real fsyncs there test
    nothing, and cost most of the test's time on a busy disk), else under tmp_path."""
    made = scratch_directory("waltz-power-loss-")
    yield tmp_path / "states" if made is None else made
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def journal_level(monkeypatch: pytest.MonkeyPatch) -> int:
    """Feature level 3 (control file format 4, the node journal) for the engine, whether
    or not waltz_api.features registers it yet: the level to open or raise to."""
    monkeypatch.setitem(fmt.FORMAT_OF_LEVEL, fmt.JOURNAL_LEVEL, fmt.JOURNAL_CONTROL_VERSION)
    monkeypatch.setattr(FsStorageEngine, "max_feature_level", max(fmt.FORMAT_OF_LEVEL))
    return fmt.JOURNAL_LEVEL
