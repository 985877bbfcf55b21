"""A process of a cluster a chaos run attached to (``--attach``): paused, killed and
restarted by the run, never started by it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from waltz_chaos.errors import ChaosError


class ExternalProcess:
    """A process of a cluster the run attached to (``--attach``): it did not start it.
    Paused and killed by its pid; restarted with the command line, directory and
    environment it had (read from /proc when the run attached), in a session of its
    own, its output in the run's log; never stopped at the end (the cluster is the
    user's)."""

    def __init__(self, pid: int, log_path: Path) -> None:
        self.original_pid = pid
        self.log_path = log_path
        try:
            self.argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            self.cwd = os.readlink(f"/proc/{pid}/cwd")
            raw = Path(f"/proc/{pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError as exc:
            raise ChaosError(f"cannot read process {pid} (/proc/{pid}): {exc}") from None
        if not self.argv or self.argv == [b""]:
            raise ChaosError(f"process {pid} has no command line to restart it with")
        self.env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)
        self.process: subprocess.Popen[bytes] | None = None
        self.log_offset = 0

    @property
    def pid(self) -> int:
        return self.original_pid if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        try:
            state = Path(f"/proc/{self.original_pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return False
        return state[0] != "Z"

    def start(self) -> None:
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                [a.decode(errors="replace") for a in self.argv],
                cwd=self.cwd,
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def output(self) -> str:
        with contextlib.suppress(OSError), self.log_path.open("rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")
        return ""

    def kill(self) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            if self.process is not None:
                self.process.wait(timeout=30)
            else:
                for _ in range(300):  # not our child: wait until it is gone
                    if not self.running:
                        break
                    time.sleep(0.01)


__all__ = ["ExternalProcess"]
