"""`waltz client tail --follow` ends on Ctrl-C with exit 0 whenever it comes, even while
the client is still connecting (before the follow loop takes SIGINT over): a race a
loaded CI hit (`test_dev.py`'s follower printed "Aborted!" and exited 1)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from waltz_conformance.servers import BlackHole

pytestmark = pytest.mark.timeout(120)

DEADLINE = 60.0  # seconds, for a process start on a slow, loaded machine


def test_ctrl_c_while_connecting_ends_follow_with_exit_0() -> None:
    hole = BlackHole()  # a ZooKeeper that accepts and never answers: connecting hangs
    follow = subprocess.Popen(
        [sys.executable, "-m", "waltz_cli", "client", "tail", "--coordination",
         f"zk://127.0.0.1:{hole.port}/waltz", "--partition", "0", "--follow",
         "--timeout", "50"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hole.first_accept.wait(DEADLINE), "the client never connected"
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=DEADLINE)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait(timeout=30)
        hole.close()
    assert "Aborted" not in err, err
    assert follow.returncode == 0, err
