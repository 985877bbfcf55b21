"""The command: its options, its usage errors, and what it imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from waltz_chaos.cli import parse_duration
from waltz_server.cli import main


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("15m", 900.0), ("1h", 3600.0), ("1h30m", 5400.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_waltz_chaos_is_a_waltz_command() -> None:
    result = CliRunner().invoke(main, ["chaos", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--seed", "--duration", "--faults", "--schedule", "--network", "--clean"):
        assert option in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--duration", "10"], "at least 30 seconds"),
        (["--duration", "ten"], "give seconds"),
        (["--workloads", "bank,nope"], "unknown workloads"),
        (["--network", "maybe"], "maybe"),
    ],
)
def test_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["chaos", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_the_run_imports_no_pytest() -> None:
    code = (
        "import sys, waltz_chaos.cli, waltz_chaos.run, waltz_chaos.client, "
        "waltz_conformance.servers.zookeeper, waltz_conformance.servers.etcd; "
        "bad = [m for m in ('pytest', 'hypothesis') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
