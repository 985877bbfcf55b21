"""``waltz storage`` offline tools through the CLI, on a real storage directory."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from click.testing import CliRunner, Result

from waltz_cli import main
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs.engine import FsStorageEngine

KEY = uuid.UUID("11112222-3333-4444-8555-666677778888")


def _make_storage(directory: Path) -> None:
    async def build() -> None:
        engine = await FsStorageEngine.open(str(directory), cluster_key=KEY, num_partitions=2)
        try:
            part = await engine.add_partition(1)
            await part.append([make_record(t, 1) for t in range(5)])
        finally:
            await engine.close()

    asyncio.run(build())


def test_verify_dump_segment_and_control_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _make_storage(data)
    runner = CliRunner()
    result = runner.invoke(main, ["storage", "verify", str(data)])
    assert result.exit_code == 0, result.output
    assert "partition 1: 1 segment(s), 5 record(s), max transaction id 4" in result.output
    seg = data / "1" / "0000000000000000000.seg"
    result = runner.invoke(main, ["storage", "dump-segment", str(seg)])
    assert result.exit_code == 0, result.output
    assert "records: 5" in result.output
    result = runner.invoke(main, ["storage", "dump-control-file", str(data)])
    assert result.exit_code == 0, result.output
    assert f"cluster key: {KEY}" in result.output
    # damage: verify fails with exit code 1 and says why
    with seg.open("ab") as f:
        f.write(b"garbage")
    result = runner.invoke(main, ["storage", "verify", str(data)])
    assert result.exit_code == 1
    assert "PROBLEM: partition 1: 0000000000000000000.seg: 7 bad bytes" in result.output


def test_verify_reports_the_quarantine_and_holes(tmp_path: Path) -> None:
    """After recovery moved damaged bytes aside: the hole is a problem until repaired, the
    quarantine folder is listed (what, from where, why) and stays after the repair."""
    data = tmp_path / "data"

    async def build() -> None:
        engine = await FsStorageEngine.open(
            str(data), cluster_key=KEY, num_partitions=2, options={"segment_size": 300}
        )
        try:
            part = await engine.add_partition(1)
            for t in range(12):
                await part.append([make_record(t, 1)])
        finally:
            await engine.close()

    async def reopen_and_repair(repair: bool) -> None:
        engine = await FsStorageEngine.open(str(data), options={"segment_size": 300})
        try:
            part = engine.partition(1)
            for first, last in part.missing_ranges() if repair else []:
                await part.repair([make_record(t, 1) for t in range(first, last + 1)])
        finally:
            await engine.close()

    asyncio.run(build())
    segments = sorted((data / "1").glob("*.seg"))
    assert len(segments) >= 3
    middle = segments[1]
    middle.write_bytes(middle.read_bytes()[:-7])  # its last record cut short
    asyncio.run(reopen_and_repair(repair=False))
    runner = CliRunner()
    result = runner.invoke(main, ["storage", "verify", str(data)])
    assert result.exit_code == 1, result.output
    assert "are missing (a hole left by damage" in result.output
    assert f"QUARANTINED: partition 1: {data / 'quarantine' / '1'}" in result.output
    assert f"{middle.name}@" in result.output
    asyncio.run(reopen_and_repair(repair=True))
    result = runner.invoke(main, ["storage", "verify", str(data)])
    assert result.exit_code == 0, result.output
    assert "QUARANTINED: partition 1" in result.output
    assert "1 quarantine folder(s)" in result.output


def test_tools_errors_are_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["storage", "dump-control-file", str(tmp_path)])
    assert result.exit_code == 1
    assert "error: " in result.output and "no such control file" in result.output


def test_config_with_a_subcommand_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["storage", "--config", str(tmp_path / "x.toml"), "verify", str(tmp_path)]
    )
    assert result.exit_code == 2


def test_storage_config_errors_are_reported(tmp_path: Path) -> None:
    config = tmp_path / "storage.toml"
    config.write_text('[storage]\nengine = "no-such-engine"\n')
    result = CliRunner().invoke(main, ["storage", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert "error: " in result.output


def _one_error_line(result: Result, code: int = 1) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_offline_tools_on_missing_or_foreign_files(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = tmp_path / "nothing"
    assert "no such control file" in _one_error_line(
        runner.invoke(main, ["storage", "verify", str(missing)])
    )
    assert "no such segment file" in _one_error_line(
        runner.invoke(main, ["storage", "dump-segment", str(missing / "0.seg")])
    )
    foreign = tmp_path / "foreign.seg"
    foreign.write_bytes(b"this is not a segment file at all" * 4)
    foreign_dump = runner.invoke(main, ["storage", "dump-segment", str(foreign)])
    assert "not a Waltz segment file" in _one_error_line(foreign_dump)
    assert "scan stopped: the segment header" in foreign_dump.stdout
    ctl = tmp_path / "waltz-storage.ctl"
    ctl.write_bytes(b"\0" * 10)
    line = _one_error_line(runner.invoke(main, ["storage", "dump-control-file", str(ctl)]))
    assert "control file" in line


def test_dump_segment_limit_and_data(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _make_storage(data)
    seg = data / "1" / "0000000000000000000.seg"
    result = CliRunner().invoke(
        main, ["storage", "dump-segment", str(seg), "--limit", "2", "--data"]
    )
    assert result.exit_code == 0, result.output
    shown = [line for line in result.stdout.splitlines() if " offset=" in line]
    assert len(shown) == 2 and all(" data=" in line for line in shown)
    assert shown[0].startswith("0 offset=") and shown[1].startswith("1 offset=")
    assert "records: 5, valid bytes" in result.stdout  # counted to the end


def test_admin_commands_without_a_node(tmp_path: Path) -> None:
    runner = CliRunner()
    down = runner.invoke(
        main, ["storage", "list", "--endpoint", "tcp://127.0.0.1:1", "--timeout", "0.5"]
    )
    # nothing listens there: refused at once, exit code 4 (the cluster did not answer)
    assert "tcp://127.0.0.1:1 refused the connection" in _one_error_line(down, 4)
    assert "does not exist" in _one_error_line(
        runner.invoke(main, ["storage", "max-transaction-id", "0", "--config", str(tmp_path / "x")])
    )
    nowhere = runner.invoke(main, ["storage", "stats"])
    assert nowhere.exit_code == 2 and "--endpoint" in nowhere.stderr
    keyless = runner.invoke(
        main, ["storage", "add-partition", "1", "--endpoint", "tcp://127.0.0.1:1"]
    )
    assert keyless.exit_code == 2 and "--cluster-key" in keyless.stderr
