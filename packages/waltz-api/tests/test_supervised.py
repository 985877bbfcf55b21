"""The supervised child process (waltz_api.supervised), on real child processes: its
ready line (this run's only), an exit or a deadline while starting (with the log's
end in the error), SIGTERM then SIGKILL, pause and resume, and the kill at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_api.errors import ProcessStartError
from waltz_api.supervised import SupervisedProcess

DEADLINE = 60.0
"""Generous: the machine may be loaded."""


def python(code: str, log_path: Path, **options: object) -> SupervisedProcess:
    return SupervisedProcess(
        [sys.executable, "-u", "-c", code],
        log_path,
        name="child",
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
def children() -> Iterator[list[SupervisedProcess]]:
    started: list[SupervisedProcess] = []
    yield started
    for child in started:
        child.kill()


def state_of(pid: int) -> str:
    """The kernel's state letter of ``pid`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_for(check: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


async def test_the_ready_line_of_this_run_counts(
    tmp_path: Path, children: list[SupervisedProcess]
) -> None:
    code = "import time; print('ready on port', 7); time.sleep(600)"
    child = python(code, tmp_path / "logs" / "child.log")
    children.append(child)
    child.start()
    found = await child.wait_ready(r"ready on port (\d+)", timeout=DEADLINE)
    assert found is not None and found.group(1) == "7"
    assert child.running and child.pid is not None
    assert child.terminate(timeout=DEADLINE) == -signal.SIGTERM
    assert not child.running
    # the second run's log is appended to; its ready line is not the first run's
    child.argv = [
        sys.executable,
        "-u",
        "-c",
        "import time; time.sleep(0.5); print('ready on port', 9); time.sleep(600)",
    ]
    child.start()
    assert child.output() == ""
    found = child.wait_ready_sync(r"ready on port (\d+)", timeout=DEADLINE)
    assert found is not None and found.group(1) == "9"
    assert child.whole_log().count("ready on port") == 2
    assert child.output().count("ready on port") == 1


async def test_an_exit_while_starting_raises_with_the_end_of_its_log(tmp_path: Path) -> None:
    child = python("import sys; print('bad key storage.x'); sys.exit(3)", tmp_path / "c.log")
    child.start()
    with pytest.raises(ProcessStartError, match="exited with 3") as caught:
        await child.wait_ready("ready on", timeout=DEADLINE)
    assert "bad key storage.x" in str(caught.value)
    assert str(tmp_path / "c.log") in str(caught.value)
    assert caught.value.returncode == 3


async def test_a_late_child_raises_with_what_it_waited_for(
    tmp_path: Path, children: list[SupervisedProcess]
) -> None:
    child = python("print('starting up'); import time; time.sleep(600)", tmp_path / "c.log")
    children.append(child)
    child.start()
    calls = 0

    async def never() -> bool:
        nonlocal calls
        calls += 1
        return False

    with pytest.raises(ProcessStartError, match=r"not ready after 0.5s \(a handshake\)") as late:
        await child.wait_ready(never, timeout=0.5, waiting_for=lambda: "a handshake")
    assert calls > 0
    assert child.running  # late, not dead: the caller decides
    wait_for(lambda: "starting up" in child.output(), "the child's first line")
    with pytest.raises(ProcessStartError, match="starting up"):
        child.wait_ready_sync(lambda: False, deadline=time.monotonic())
    assert late.value.returncode is None


def test_a_child_ignoring_sigterm_is_killed_after_the_timeout(
    tmp_path: Path, children: list[SupervisedProcess]
) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ignoring'); time.sleep(600)"
    )
    child = python(code, tmp_path / "c.log")
    children.append(child)
    child.start()
    child.wait_ready_sync("ignoring", timeout=DEADLINE)
    started = time.monotonic()
    assert child.terminate(timeout=0.5) == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5
    assert not child.running


async def test_a_paused_child_stops_and_resumes_and_stops_when_asked(
    tmp_path: Path, children: list[SupervisedProcess]
) -> None:
    child = python("print('up'); import time; time.sleep(600)", tmp_path / "c.log")
    children.append(child)
    child.start()
    await child.wait_ready("up", timeout=DEADLINE)
    assert child.pid is not None
    assert child.pause()
    assert not child.pause()  # once
    wait_for(lambda: state_of(child.pid) == "T", "the child to stop")  # type: ignore[arg-type]
    assert child.resume()
    wait_for(lambda: state_of(child.pid) != "T", "the child to run again")  # type: ignore[arg-type]
    assert child.pause()
    # a paused child is resumed to take its SIGTERM (else it would wait for the SIGKILL)
    assert await child.stop(timeout=DEADLINE) == -signal.SIGTERM
    assert not child.paused


def test_kill_at_exit_kills_what_a_crashed_run_left(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from waltz_api.supervised import SupervisedProcess\n"
        "child = SupervisedProcess([sys.executable, '-c', 'import time; time.sleep(600)'], "
        "Path(sys.argv[1]), kill_at_exit=True)\n"
        "child.start()\n"
        "print(child.pid, flush=True)\n"
        "raise SystemExit(1)  # nobody stops it\n"
    )
    parent = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "c.log")],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert parent.returncode == 1, parent.stderr
    pid = int(parent.stdout.split()[0])

    def gone() -> bool:
        try:
            return state_of(pid) == "Z"
        except OSError:
            return True

    try:
        wait_for(gone, f"the leftover child {pid} to die")
    finally:
        if not gone():
            os.kill(pid, signal.SIGKILL)


def test_without_a_log_its_output_is_discarded(tmp_path: Path) -> None:
    child = SupervisedProcess([sys.executable, "-c", "print('x')"], None, name="quiet")
    child.start()
    with pytest.raises(
        ProcessStartError, match="quiet exited with 0 while starting; it has no log"
    ):
        child.wait_ready_sync("never", timeout=DEADLINE)
    assert child.output() == ""
    assert child.kill() == 0
