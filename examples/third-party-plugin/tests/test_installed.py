"""The plugin as its users get it: from the installed wheel, through the entry point."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import sysconfig
import uuid
from importlib.metadata import distribution, entry_points
from pathlib import Path

import pytest
import waltz_storage_sqlite
import waltz_storage_sqlite.plugin
from waltz_storage_sqlite.engine import SqliteStorageEngine

from waltz_api.contracts.storage import StorageEngine
from waltz_api.errors import StorageError
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_conformance.suites.storage import make_record

SOURCE_TREE = Path(__file__).resolve().parents[1] / "src"


def test_imported_from_the_installed_wheel_not_the_source_tree() -> None:
    module = Path(waltz_storage_sqlite.plugin.__file__).resolve()
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert module.is_relative_to(site_packages), (
        f"{module} is not in {site_packages}: install the built wheel (not -e) to run these tests"
    )
    assert not module.is_relative_to(SOURCE_TREE)
    dist = distribution("waltz-storage-sqlite")
    assert dist.version == waltz_storage_sqlite.__version__
    # a wheel install records its files; an editable one records only a .pth or finder
    recorded = {str(f) for f in dist.files or ()}
    assert "waltz_storage_sqlite/engine.py" in recorded
    assert "waltz_storage_sqlite/py.typed" in recorded


def test_entry_point_in_the_waltz_group() -> None:
    (entry,) = [e for e in entry_points(group="waltz") if e.name == "waltz_storage_sqlite"]
    assert entry.value == "waltz_storage_sqlite.plugin"
    assert entry.dist is not None and entry.dist.name == "waltz-storage-sqlite"
    assert entry.load() is waltz_storage_sqlite.plugin


def test_registry_resolves_the_plugin_by_name_and_scheme() -> None:
    registry = get_registry()
    descriptor = registry.get(PluginKind.STORAGE, "sqlite")
    assert descriptor.factory is SqliteStorageEngine
    assert descriptor.capabilities == {"reopen", "crash_reopen", "availability"}
    assert registry.resolve("storage", "sqlite:///var/lib/waltz") == descriptor
    assert "sqlite" in registry.names("storage")
    assert "fs" in registry.names("storage"), "the built-in engine is still there beside it"


def test_waltz_plugins_list_shows_it() -> None:
    waltz = Path(sys.executable).parent / "waltz"
    assert waltz.exists(), "the `waltz` command (waltz-server) is installed in the test extra"
    result = subprocess.run(
        [str(waltz), "plugins", "list"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "sqlite" in line]
    assert lines, result.stdout
    assert any("storage" in line or "SQLite" in line for line in lines), result.stdout


async def test_bad_options_are_refused_with_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="valid options: synchronous, wal_autocheckpoint"):
        await SqliteStorageEngine.open(
            str(tmp_path / "s"), cluster_key=uuid.uuid4(), num_partitions=1, options={"x": 1}
        )
    with pytest.raises(StorageError, match="synchronous must be one of full, extra"):
        await SqliteStorageEngine.open(
            str(tmp_path / "s"),
            cluster_key=uuid.uuid4(),
            num_partitions=1,
            options={"synchronous": "off"},
        )
    assert not (tmp_path / "s").exists(), "a refused open creates nothing"


async def test_group_commit_batches_concurrent_appends(tmp_path: Path) -> None:
    """Appends of many partitions at once share SQLite commits (one sync for several)."""
    engine = await SqliteStorageEngine.open(
        str(tmp_path / "s"), cluster_key=uuid.uuid4(), num_partitions=8
    )
    try:
        parts = [await engine.add_partition(pid) for pid in range(8)]
        before = engine.stats()

        async def write(pid: int) -> None:
            for txid in range(20):
                await parts[pid].append([make_record(txid, pid)])

        await asyncio.gather(*(write(pid) for pid in range(8)))
        after = engine.stats()
        changes = after["changes"] - before["changes"]
        commits = after["commits"] - before["commits"]
        assert changes == 160
        assert commits < changes, f"{commits} commits for {changes} appends: no grouping"
        for pid in range(8):
            assert parts[pid].max_transaction_id() == 19
            assert await parts[pid].read_record(19) == make_record(19, pid)
    finally:
        await engine.close()


async def test_another_engines_directory_is_refused(tmp_path: Path) -> None:
    """Switching a storage node's engine to sqlite on an fs data dir must not start afresh."""
    fs_class = get_registry().get(PluginKind.STORAGE, "fs").factory
    assert isinstance(fs_class, type) and issubclass(fs_class, StorageEngine)
    key = uuid.uuid4()
    fs_engine = await fs_class.open(str(tmp_path / "data"), cluster_key=key, num_partitions=2)
    await fs_engine.close()
    with pytest.raises(StorageError, match="not a Waltz SQLite storage"):
        await SqliteStorageEngine.open(str(tmp_path / "data"), cluster_key=key, num_partitions=2)
    assert not (tmp_path / "data" / "waltz-storage.sqlite3").exists()


async def test_a_waltz_storage_process_runs_on_it(tmp_path: Path) -> None:
    """``waltz storage --config`` with ``engine = "sqlite"`` loads the plugin from the wheel,
    creates its database and hosts the configured partitions; stopped by its pid."""
    key = uuid.uuid4()
    data_dir = tmp_path / "data"
    config = tmp_path / "storage.toml"
    config.write_text(
        "[storage]\n"
        f'data_dir = "{data_dir}"\n'
        'engine = "sqlite"\n'
        f'cluster_key = "{key}"\n'
        "num_partitions = 3\n"
        "partitions = [0, 2]\n"
        "[transport]\n"
        'plugin = "memory"\n'
        f'endpoint = "memory://sqlite-node-{key.hex[:8]}"\n'
        "[http]\n"
        "enabled = false\n"
    )
    log_path = tmp_path / "storage.log"
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "waltz"),
            "storage",
            "--config",
            str(config),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        for _ in range(600):  # at most 60 s
            if "storage node ready on" in log_path.read_text() or process.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert "storage node ready on" in log_path.read_text(), log_path.read_text()
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await asyncio.wait_for(process.wait(), 30)
    assert process.returncode == 0, log_path.read_text()
    engine = await SqliteStorageEngine.open(str(data_dir), cluster_key=key, num_partitions=3)
    try:
        assert engine.partition_ids() == [0, 2]
    finally:
        await engine.close()
