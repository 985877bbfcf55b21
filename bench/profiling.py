"""CPU accounting and py-spy sampling of the cluster's processes, for the benchmarks.

On a shared, loaded machine wall-clock throughput moves with the neighbours; the CPU
time a process spends per transaction, and where its samples fall, do not. So the
benches print, beside tx/s, each role's CPU microseconds per committed transaction
(:class:`CpuMeter`: ``/proc/PID/stat``, every thread of the process), and with
``--py-spy DIR`` they record each process during each run and print the functions with
the most samples (:class:`Spy`).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    if pid is None:
        return float("nan")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    # the command name may hold spaces: the fields start after its closing parenthesis
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class CpuMeter:
    """CPU seconds each named group of processes spends between :meth:`start` and
    :meth:`stop`."""

    def __init__(self, groups: Mapping[str, list[int | None]]) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items()}
        self._start: dict[str, float] = {}
        self.spent: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(p) for p in pids) for name, pids in self.groups.items()}

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        now = self._now()
        self.spent = {name: now[name] - self._start.get(name, 0.0) for name in now}
        return self.spent

    def per_transaction_us(self, committed: int) -> dict[str, float]:
        """Microseconds of CPU per committed transaction, per group."""
        if committed <= 0:
            return {name: float("nan") for name in self.spent}
        return {name: spent / committed * 1e6 for name, spent in self.spent.items()}


class Spy:
    """py-spy records of processes for one run (raw collapsed stacks, one file each)."""

    def __init__(
        self, directory: Path, run: str, pids: Mapping[str, int | None], *, gil: bool = False
    ) -> None:
        """``gil``: only samples of threads holding the GIL (Python CPU time, not the
        time a thread waits for the disk, a lock or the CPU)."""
        self.gil = gil
        self.directory = directory
        self.run = run
        self.pids = {name: pid for name, pid in pids.items() if pid is not None}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.files: dict[str, Path] = {}

    @staticmethod
    def available() -> bool:
        return shutil.which("py-spy") is not None

    def start(self, seconds: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "-" for c in self.run).strip("-")
        for name, pid in self.pids.items():
            out = self.directory / f"{slug}.{name}.txt"
            self.files[name] = out
            self._procs[name] = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(pid),
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                    "--duration",
                    str(max(1, int(seconds))),
                    "--rate",
                    "100",
                    "--nonblocking",
                    *(["--gil"] if self.gil else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def stop(self) -> None:
        for proc in self._procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def report(self, top: int = 8) -> str:
        lines = []
        for name, path in self.files.items():
            leaves, total = top_functions(path)
            if not total:
                continue
            shares = ", ".join(f"{fn} {n / total:.0%}" for fn, n in leaves.most_common(top))
            lines.append(f"    {name} ({total} samples): {shares}")
        return "\n".join(lines)


def top_functions(path: Path) -> tuple[collections.Counter[str], int]:
    """Samples per leaf function (its own time) in a py-spy raw file, and the total."""
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    if not path.exists():
        return leaves, 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        # "function (module.py:123)" -> "function (module.py)"
        leaf = leaf.split(":")[0] + ")" if "(" in leaf else leaf
        leaves[leaf] += int(count)
        total += int(count)
    return leaves, total
