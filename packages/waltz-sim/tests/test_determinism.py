"""A seed replays exactly: the same trace (every event, every network frame) each run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from waltz_sim import SimConfig, run_seed

SEED = 3


def test_one_seed_twice_gives_the_same_trace() -> None:
    first = run_seed(SimConfig(seed=SEED, faults="chaos"), keep_trace=True)
    second = run_seed(SimConfig(seed=SEED, faults="chaos"), keep_trace=True)
    assert first.faults >= 5
    assert first.trace_events > 100
    assert first.trace_text == second.trace_text
    assert first.digest == second.digest


def test_another_seed_gives_another_trace() -> None:
    one = run_seed(SimConfig(seed=SEED, duration=20))
    other = run_seed(SimConfig(seed=SEED + 1, duration=20))
    assert one.digest != other.digest


def test_the_replay_command_replays_it_in_another_process() -> None:
    """Another interpreter, with another hash seed (set iteration order of str)."""
    here = run_seed(SimConfig(seed=SEED, duration=20))
    command = here.replay_command().split()[2:]  # after "waltz simulate"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-m", "waltz_sim", *command, "--verbose"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    found = re.search(r"trace digest ([0-9a-f]{64})", out.stdout)
    assert found is not None, out.stdout + out.stderr
    assert found.group(1) == here.digest
