"""Start-up cost: `waltz --help`, importing the client, and a client connecting.

Each case runs in a fresh Python process, several times; the figures are wall
times (min and median) and the CPU time (user + sys) of the child, beside the
reference measured in the same run: a Python process that does nothing
(`python -c pass`), the floor every case pays. The goals (issue 16) are
`waltz --help` <= 0.25 s and "import the client and connect" <= 0.3 s.

1. `waltz --help` (the console script of this environment).
2. `import waltz_client` alone.
3. Import the client, start an AsyncWaltzClient against a running `waltz dev`
   cluster (started once by this script on loopback, stopped by its pid at the
   end) and ask partition 0's high-water mark: one round trip to the server.
   Figures: the process's wall time, and inside it the time until the import
   and until the answer.
4. The modules behind each case: the largest cumulative entries of
   `python -X importtime` for `waltz --help` and for the client's import, so a
   change that pulls in a heavy plugin shows by name.

Figures only; never pass/fail.

    .venv/bin/python bench/startup.py [--runs 7] [--no-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from waltz_api.errors import ProcessStartError
from waltz_api.supervised import SupervisedProcess

PYTHON = sys.executable
WALTZ = str(Path(PYTHON).with_name("waltz"))

CONNECT_SCRIPT = """
import time
started = time.perf_counter()
import asyncio, sys
import waltz_client
imported = time.perf_counter()

class App(waltz_client.WaltzClientCallbacks):
    async def client_high_water_mark(self, partition_id):
        return -1
    async def apply_transaction(self, transaction):
        pass

async def main():
    config = waltz_client.ClientConfig(sys.argv[1], transport="zmq")
    async with waltz_client.AsyncWaltzClient(App(), config) as client:
        await client.high_water_mark(0, timeout=30)
        return time.perf_counter()

connected = asyncio.run(main())
print(f"{imported - started:.6f} {connected - started:.6f}")
"""


def run_child(args: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall seconds, child CPU seconds, stdout) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}): {done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def figures(name: str, samples: list[tuple[float, float]], goal: float | None) -> None:
    walls = [w for w, _ in samples]
    cpus = [c for _, c in samples]
    target = f"   goal <= {goal:.2f} s" if goal is not None else ""
    print(
        f"{name:<42} wall min {min(walls):6.3f} s  median {statistics.median(walls):6.3f} s"
        f"   cpu median {statistics.median(cpus):6.3f} s{target}"
    )


def measure(name: str, args: list[str], runs: int, goal: float | None = None) -> None:
    run_child(args)  # warm the file cache and the bytecode
    figures(name, [run_child(args)[:2] for _ in range(runs)], goal)


def import_profile(args: list[str], top: int) -> None:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, check=False)
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _self, cumulative_us, name = line.removeprefix("import time:").split("|", 2)
        rows.append((int(cumulative_us), len(name) - len(name.lstrip()), name.strip()))
    total = sum(c for c, depth, _ in rows if depth == 1)
    print(f"  {' '.join(Path(args[0]).name if i == 0 else a for i, a in enumerate(args))}")
    print(f"    all imports: {total / 1000:.1f} ms (cumulative, top-level modules)")
    for cumulative, _depth, module in sorted(rows, reverse=True)[:top]:
        print(f"    {cumulative / 1000:8.1f} ms  {module}")


def start_dev(data_dir: Path) -> tuple[SupervisedProcess, str]:
    dev = SupervisedProcess(
        [WALTZ, "dev", "--data-dir", str(data_dir / "cluster"), "--no-console"],
        data_dir / "dev.log",
        name="waltz dev",
        new_session=True,
    )
    dev.start()
    ready = data_dir / "cluster" / "waltz-dev.ready.json"
    found: list[str] = []

    def started() -> bool:
        try:
            found.append(str(json.loads(ready.read_text())["coordination"]))
        except (OSError, ValueError, KeyError):
            return False
        return True

    try:
        dev.wait_ready_sync(started, timeout=180, interval=0.2)
    except ProcessStartError as exc:
        stop_dev(dev)
        raise SystemExit(str(exc)) from None
    return dev, found[0]


def stop_dev(dev: SupervisedProcess) -> None:
    dev.terminate(timeout=60, signum=signal.SIGINT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--top", type=int, default=12, help="modules listed per profile")
    parser.add_argument("--no-cluster", action="store_true", help="skip the connect case")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    measure("reference: python -c pass", [PYTHON, "-c", "pass"], args.runs)
    measure("waltz --help", [WALTZ, "--help"], args.runs, 0.25)
    measure("python -c 'import waltz_client'", [PYTHON, "-c", "import waltz_client"], args.runs)
    if not args.no_cluster:
        work = Path(tempfile.mkdtemp(prefix="waltz-startup-"))
        dev, uri = start_dev(work)
        try:
            samples, inside = [], []
            run_child([PYTHON, "-c", CONNECT_SCRIPT, uri])
            for _ in range(args.runs):
                wall, cpu, out = run_child([PYTHON, "-c", CONNECT_SCRIPT, uri])
                samples.append((wall, cpu))
                inside.append(tuple(float(x) for x in out.split()))
            figures("import the client, connect, one round trip", samples, 0.30)
            print(
                f"{'  of which (inside the process)':<42} import median "
                f"{statistics.median(i for i, _ in inside):6.3f} s   until the answer median "
                f"{statistics.median(c for _, c in inside):6.3f} s"
            )
        finally:
            stop_dev(dev)
            shutil.rmtree(work, ignore_errors=True)
    print("largest imports (python -X importtime, cumulative):")
    import_profile([WALTZ, "--help"], args.top)
    import_profile([PYTHON, "-c", "import waltz_client"], args.top)


if __name__ == "__main__":
    main()
