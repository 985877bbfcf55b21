"""``waltz simulate``: seeds, the per-seed report, a failing seed's replay and trace."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner
from planted import planted

from waltz_server.cli import main
from waltz_sim.cli import parse_seeds


def test_seed_ranges() -> None:
    assert parse_seeds(7, None) == (7, 7)
    assert parse_seeds(None, None) == (0, 0)
    assert parse_seeds(None, "3..5") == (3, 5)
    assert parse_seeds(None, "10..") == (10, None)
    assert parse_seeds(None, "4") == (4, 4)
    for bad in ("a..b", "5..3"):
        with pytest.raises(click.UsageError):
            parse_seeds(None, bad)
    with pytest.raises(click.UsageError):
        parse_seeds(1, "1..2")


def test_a_range_of_seeds_reports_each_and_a_summary() -> None:
    result = CliRunner().invoke(
        main, ["simulate", "--seeds", "0..1", "--duration", "20", "--faults", "mild"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # what a seed chose of its configuration, when not the defaults, follows its number
    assert lines[0].startswith("seed 0 (5 storage nodes, a replica replaced): ok: ")
    assert any(
        line.startswith("seed 1 (plain callbacks, a replica replaced): ok: ") for line in lines
    )
    assert "commits" in lines[0] and "simulated in" in lines[0]
    assert lines[-1].startswith("2 seeds, 2 passed, 0 failed;")


def test_a_failing_seed_prints_its_replay_the_violations_and_the_trace() -> None:
    args = ["simulate", "--seeds", "0..9", "--duration", "20", "--stop-on-failure"]
    with planted("forget-append"):
        result = CliRunner().invoke(main, [*args, "--lock-table", "planted-forget-append"])
    assert result.exit_code == 1, result.output
    out = result.output
    failed = re.search(r"^seed (\d+)[^:]*: FAILED", out, re.MULTILINE)
    assert failed is not None, out
    seed = failed.group(1)
    assert f"replay: waltz simulate --seed {seed} --duration 20" in out
    assert "--lock-table planted-forget-append" in out
    assert "[lock-safety]" in out
    assert "trace around the first violation" in out
    assert "the first violation: [lock-safety]" in out
    assert f"failed seeds: {seed}" in out


def test_an_open_range_runs_until_the_budget_is_spent() -> None:
    result = CliRunner().invoke(
        main,
        ["simulate", "--seeds", "5..", "--budget", "0.01", "--duration", "20", "--faults", "none"],
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith("seed 5 (plain callbacks, archive): ok: ")
    assert result.output.splitlines()[-1].startswith("1 seeds, 1 passed, 0 failed;")


def test_usage_errors_are_one_line() -> None:
    result = CliRunner().invoke(main, ["simulate", "--seeds", "9..1"])
    assert result.exit_code == 2
    assert "the last seed is below the first" in result.output
