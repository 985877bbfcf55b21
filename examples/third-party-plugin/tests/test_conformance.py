"""The shared StorageEngine suite against the installed ``sqlite`` plugin.

Exactly what docs/plugin-authors.md asks of a plugin author: subclass the
suite of the contract and provide its ``harness`` fixture. The harness is
built from the descriptor the installed entry point registers, so the suite
checks what a storage node would load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz_api.contracts.storage import StorageEngine
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_conformance.suites.storage import StorageHarness, StorageSuite


class TestSqliteStorage(StorageSuite):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> StorageHarness:
        descriptor = get_registry().get(PluginKind.STORAGE, "sqlite")
        engine_class = descriptor.factory
        assert isinstance(engine_class, type) and issubclass(engine_class, StorageEngine)
        return StorageHarness(
            name="sqlite",
            engine_class=engine_class,
            capabilities=descriptor.capabilities,
            root=tmp_path,
            # the crash test's writer process opens the engine by reference
            engine_ref="waltz_storage_sqlite.engine:SqliteStorageEngine",
        )
