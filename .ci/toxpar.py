"""Every tox environment of tox.ini's env_list, two at a time: what `make test` runs.

Most environments wait on real processes (servers, ZooKeeper, etcd, Chromium, the
chaos run's fixed-length phases) more than they compute, so two run side by side on a
2-core machine in about half the time of one after another. Each environment is its
own ``tox run -e ENV`` with its output in ``.tox/ci-logs/ENV.log``; a worker takes the
next environment, longest first (``EXPECTED_SECONDS``), when its last one ends.

While they run, one line per start and end. At the end every log is printed whole,
the passing environments' first and the failing ones' last, then a summary (each
environment's result, wall time and CPU time): a CI page that shows only the log's
tail shows which environment failed and how. The exit status is 1 when any failed.

``--jobs 1`` runs them one after another (the same as ``python3 -m tox``, with the
logs printed at the end); ``-e a,b`` runs only those.

Disk: a whole run writes several GiB (each environment's virtualenv, the test
clusters' preallocated journals and segments under pytest's temporary directory,
which pytest removes test by test as they pass). Before the first environment,
``uv cache prune`` drops what uv's cache holds and no install can use any more (each
download of a source-only package such as pyspark leaves a built copy of about 1 GiB
behind, so a machine that runs CI often fills up), and the free space is printed,
with a warning when it is below ``NEEDED_GIB``. A failing environment whose log says
the disk was full is named so in the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / ".tox" / "ci-logs"

EXPECTED_SECONDS = {
    "unit": 860,
    "conformance": 480,
    "sim": 380,
    "chaos": 280,
    "spark": 130,
    "dist": 95,
    "type": 60,
    "upgrade": 45,
    "console": 40,
    "example-plugin": 35,
    "lint": 1,
}
"""Each environment's time alone on 2 idle cores (a fresh clone's run): the order the
workers take them in. An environment not listed here is taken first."""


@dataclass
class Result:
    env: str
    code: int
    wall: float
    cpu: float
    log: Path


NEEDED_GIB = 12
"""Free space, at the temporary directory and at the checkout, below which a run is
warned that it may fill the disk: a fresh clone's run at 1ba76fc, two environments at
a time, used at most 5.2 GiB more than before it started (its checkout and
environments included), about twice that is asked."""

DISK_FULL = b"No space left on device"


def free_gib(path: Path) -> float:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize / 2**30


def distinct_filesystems(places: list[Path]) -> list[Path]:
    """The first of ``places`` on each file system."""
    seen: dict[int, Path] = {}
    for place in places:
        seen.setdefault(os.stat(place).st_dev, place)
    return list(seen.values())


def prune_uv_cache() -> None:
    """``uv cache prune`` (when uv is here), before any environment installs."""
    for uv in ([sys.executable, "-m", "uv"], ["uv"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            pruned = subprocess.run(
                [*uv, "cache", "prune"], check=False, capture_output=True, text=True, timeout=600
            )
            if pruned.returncode == 0:
                removed = [line for line in pruned.stderr.splitlines() if "Removed" in line]
                say(f"uv cache prune: {removed[-1].strip() if removed else 'nothing to remove'}")
                return


def check_disk(places: list[Path]) -> list[str]:
    """Prints the free space at each place; the warnings about too little."""
    warnings = []
    for place in places:
        free = free_gib(place)
        say(f"free disk at {place}: {free:.1f} GiB")
        if free < NEEDED_GIB:
            warnings.append(
                f"only {free:.1f} GiB free at {place}, and a whole run needs about"
                f" {NEEDED_GIB} GiB: free some (old /tmp/pytest-of-*/ directories, `uv"
                " cache clean`) or the environments may fail with 'No space left on device'"
            )
    for warning in warnings:
        say(f"WARNING: {warning}")
    return warnings


def default_envs() -> list[str]:
    listed = subprocess.run(
        [sys.executable, "-m", "tox", "list", "-d", "--no-desc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    # (a provisioning tox may print more than the names: only the lines that are one)
    return [line for line in listed.stdout.split() if re.fullmatch(r"[\w.-]+", line)]


def longest_first(envs: list[str]) -> list[str]:
    return sorted(envs, key=lambda env: -EXPECTED_SECONDS.get(env, 10**6))


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def tox_command(tox_args: list[str]) -> Callable[[str], list[str]]:
    """``tox run -e ENV`` with ``tox_args``, by this interpreter."""

    def command(env: str) -> list[str]:
        return [sys.executable, "-m", "tox", "run", "-e", env, *tox_args]

    return command


class Runner:
    def __init__(self, command: Callable[[str], list[str]], logs: Path) -> None:
        self._command = command
        self._logs = logs
        self._lock = threading.Lock()
        self._running: dict[str, subprocess.Popen[bytes]] = {}
        self._stopping = threading.Event()

    def run_one(self, env: str) -> Result:
        log = self._logs / f"{env}.log"
        started = time.monotonic()
        with log.open("wb") as out:
            with self._lock:
                if self._stopping.is_set():
                    return Result(env, -2, 0.0, 0.0, log)
                # its own session: a stop reaches the whole environment (pytest and the
                # servers it started), by the process group of this child
                proc = subprocess.Popen(
                    self._command(env),
                    cwd=ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                self._running[env] = proc
            say(f"{env}: started (log: {shown(log)})")
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            with self._lock:
                del self._running[env]
        cpu = usage.ru_utime + usage.ru_stime
        result = Result(env, proc.returncode, time.monotonic() - started, cpu, log)
        say(f"{env}: {'passed' if result.code == 0 else 'FAILED'} in {result.wall:.0f} s")
        return result

    def stop(self, signum: int) -> None:
        """Passes a stop on to every running environment's process group."""
        with self._lock:
            self._stopping.set()
            for proc in self._running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signum)


def run(
    envs: list[str], jobs: int, command: Callable[[str], list[str]], logs: Path = LOGS
) -> list[Result]:
    """Runs ``command(env)`` for every env, ``jobs`` at a time, longest first."""
    logs.mkdir(parents=True, exist_ok=True)
    todo: queue.Queue[str] = queue.Queue()
    for env in longest_first(envs):
        todo.put(env)
    runner = Runner(command, logs)
    results: list[Result] = []

    def worker() -> None:
        while True:
            try:
                env = todo.get_nowait()
            except queue.Empty:
                return
            results.append(runner.run_one(env))

    def on_signal(signum: int, _frame: object) -> None:
        say(f"signal {signum}: stopping the running environments")
        runner.stop(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=1.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return results


def shown(log: Path) -> str:
    return str(log.relative_to(ROOT)) if log.is_relative_to(ROOT) else str(log)


def report(results: list[Result], envs: list[str], wall: float) -> int:
    """Prints every log (the failing ones last) and the summary; the exit status."""
    by_env = {result.env: result for result in results}
    ordered = [by_env[env] for env in envs if env in by_env]
    failed = [result for result in ordered if result.code != 0]
    for result in [r for r in ordered if r.code == 0] + failed:
        mark = "passed" if result.code == 0 else "FAILED"
        print(f"\n{'=' * 30} {result.env} ({mark}): {shown(result.log)} {'=' * 30}")
        sys.stdout.flush()
        sys.stdout.buffer.write(result.log.read_bytes())
        sys.stdout.flush()
    print(f"\n{'=' * 30} summary {'=' * 30}")
    for result in ordered:
        mark = "passed" if result.code == 0 else f"FAILED (exit {result.code})"
        print(f"  {result.env:<15} {mark:<18} {result.wall:6.0f} s wall {result.cpu:7.0f} s CPU")
    for env in envs:
        if env not in by_env:
            print(f"  {env:<15} not run")
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"  total {wall:.0f} s wall; load average now {load}")
    full = [result.env for result in failed if DISK_FULL in result.log.read_bytes()]
    if full:
        print(
            f"  the disk filled up during {', '.join(full)} ('No space left on device' in"
            f" the log; {free_gib(LOGS if LOGS.exists() else ROOT):.1f} GiB free now):"
            " free some space and run again"
        )
    if failed or len(ordered) < len(envs):
        names = ", ".join(result.env for result in failed) or "none"
        print(f"FAILED: {names} (each one's log is printed whole above this summary)")
        return 1
    print("every environment passed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("WALTZ_TEST_JOBS", "2")),
        help="environments at a time (default 2, or $WALTZ_TEST_JOBS)",
    )
    parser.add_argument("-e", dest="envs", help="comma-separated environments (default: env_list)")
    parser.add_argument("tox_args", nargs="*", help="passed to each `tox run` (after --)")
    args = parser.parse_args(argv)
    # tox.ini's `requires` provisioned here, once, before two tox processes could race
    envs = args.envs.split(",") if args.envs else default_envs()
    started = time.monotonic()
    prune_uv_cache()
    check_disk(distinct_filesystems([Path(tempfile.gettempdir()), ROOT]))
    say(f"{len(envs)} environments, {args.jobs} at a time: {', '.join(longest_first(envs))}")
    results = run(envs, max(1, args.jobs), tox_command(args.tox_args))
    return report(results, envs, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
