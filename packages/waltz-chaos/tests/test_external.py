"""An attached cluster's process: paused and killed by its pid, restarted with the
command line, directory and environment it had."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from waltz_chaos.cluster import ExternalProcess
from waltz_chaos.errors import ChaosError

SCRIPT = (
    "import os, sys, time; "
    "print(os.getcwd(), os.environ['CHAOS_TEST_MARK'], sys.argv[1:], flush=True); "
    "time.sleep(300)"
)


def test_an_external_process_is_killed_and_restarted_as_it_was(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    original = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "--flag", "value"],
        cwd=work,
        env={**os.environ, "CHAOS_TEST_MARK": "marked"},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    restarted: int | None = None
    try:
        for _ in range(200):  # until it has exec'd
            if b"--flag" in Path(f"/proc/{original.pid}/cmdline").read_bytes():
                break
            time.sleep(0.01)
        handle = ExternalProcess(original.pid, tmp_path / "log")
        assert handle.running and handle.pid == original.pid
        assert handle.argv[-2:] == [b"--flag", b"value"]
        assert handle.cwd == str(work)
        handle.kill()
        original.wait(timeout=10)  # (reaped by its parent, this test)
        assert not handle.running
        handle.start()
        restarted = handle.pid
        assert restarted != original.pid and handle.running
        for _ in range(200):
            if handle.output():
                break
            time.sleep(0.05)
        assert handle.output().strip() == f"{work} marked ['--flag', 'value']"
        handle.kill()
        assert not handle.running
    finally:
        for pid in (original.pid, restarted):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
        original.wait(timeout=10)


def test_a_process_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ChaosError, match="cannot read process"):
        ExternalProcess(2**22 + 12345, tmp_path / "log")
