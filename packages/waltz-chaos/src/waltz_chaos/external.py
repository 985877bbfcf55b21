"""A process of a cluster a chaos run attached to (``--attach``): paused, killed and
restarted by the run, never started by it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from waltz_api.supervised import SupervisedProcess
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
        self.child = SupervisedProcess(
            [a.decode(errors="replace") for a in self.argv],
            log_path,
            name=f"process {pid}",
            env=self.env,
            cwd=self.cwd,
            new_session=True,
        )

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The process this run restarted (None: still the original one)."""
        return self.child.process

    @property
    def pid(self) -> int:
        return self.original_pid if self.child.pid is None else self.child.pid

    @property
    def running(self) -> bool:
        if self.child.process is not None:
            return self.child.running
        try:
            state = Path(f"/proc/{self.original_pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return False
        return state[0] != "Z"

    def start(self) -> None:
        self.child.start()

    def output(self) -> str:
        return self.child.output()

    def pause(self) -> None:
        if self.child.process is not None:
            self.child.pause()
        elif self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.original_pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.child.process is not None:
            self.child.resume()
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.original_pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.child.process is not None:
            self.child.kill()
            return
        if self.running:  # not our child: killed by its pid, then waited for until gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.original_pid, signal.SIGKILL)
            for _ in range(300):
                if not self.running:
                    break
                time.sleep(0.01)


__all__ = ["ExternalProcess"]
