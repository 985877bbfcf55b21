"""The storage conformance suite against ``fs`` (real files, real fsync) and ``memory``."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import PluginRegistry
from waltz_conformance.reference import storage as memory_storage
from waltz_conformance.reference.conformance import storage as memory_harness
from waltz_conformance.suites.storage import StorageHarness, StorageSuite
from waltz_storage_fs.conformance import harness as fs_harness


class TestFsStorage(StorageSuite):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> StorageHarness:
        # a small index checkpoint interval: recovery then both trusts index
        # checkpoints and scans after them within a few records; small
        # segments: the crash tests roll over segments while being killed
        return fs_harness({"index_checkpoint_interval": 4, "segment_size": 4096}, root=tmp_path)


class TestFsStorageDefaultCheckpoints(StorageSuite):
    """The spec's checkpoint interval (1000): recovery scans every record."""

    damage_sweep_variants = 200

    @pytest.fixture
    def harness(self, tmp_path: Path) -> StorageHarness:
        return fs_harness(root=tmp_path)


class TestMemoryStorage(StorageSuite):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> Iterator[StorageHarness]:
        harness = memory_harness(root=tmp_path)
        yield harness
        for i in range(1, 100):
            memory_storage.forget(str(tmp_path / f"storage-{i}"))


@pytest.mark.parametrize("name", ["fs", "memory"])
def test_storage_plugins_are_registered(name: str) -> None:
    registry = PluginRegistry()
    descriptor = registry.get(PluginKind.STORAGE, name)
    assert descriptor.kind is PluginKind.STORAGE
    assert descriptor.conformance_harness
    module_name, _, attribute = descriptor.conformance_harness.partition(":")
    harness = getattr(importlib.import_module(module_name), attribute)()
    assert isinstance(harness, StorageHarness)
    assert harness.name == name
    assert harness.engine_class is descriptor.factory
    assert harness.capabilities == descriptor.capabilities
    if harness.root.is_dir():  # the fs harness made itself a temp dir
        harness.root.rmdir()
    if name == "fs":
        assert {"crash_reopen", "repair", "availability"} <= descriptor.capabilities
    else:
        assert "crash_reopen" not in descriptor.capabilities
