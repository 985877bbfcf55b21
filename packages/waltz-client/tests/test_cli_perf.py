"""``waltz perf producers|consumers`` as a user runs them, against a real ``waltz dev``
cluster (child processes: 3 fs storage nodes, a server, ZeroMQ, local coordination)."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from waltz_api.supervised import SupervisedProcess
from waltz_cli import main
from waltz_cli.devfile import read_ready_file
from waltz_client.cli.perf.engine import cancel_until_done, latency_summary, percentile

pytestmark = [pytest.mark.system, pytest.mark.timeout(180)]


def waltz_process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real entry point in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "waltz_cli", *args],
        env={k: v for k, v in os.environ.items() if k != "WALTZ_COORDINATION"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def waltz(*args: str) -> Ran:
    """The same command line in this process (saves an interpreter start per command)."""
    result = CliRunner().invoke(main, list(args), env={"WALTZ_COORDINATION": None})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `waltz dev` with 2 partitions; its coordination URI."""
    base = tmp_path_factory.mktemp("perf")
    data_dir, log = base / ".waltz-dev", base / "dev.log"  # the default `waltz dev` dir
    dev = SupervisedProcess(
        [sys.executable, "-m", "waltz_cli", "dev", "--data-dir", str(data_dir),
         "--partitions", "2"],
        log,
        name="waltz dev",
    )  # fmt: skip
    dev.start()
    ready: dict[str, Any] = {}

    def started() -> bool:
        info = read_ready_file(data_dir)
        if info is None or info["pid"] != dev.pid:
            return False
        ready.update(info)
        return True

    try:
        dev.wait_ready_sync(started, timeout=90, interval=0.1)
        yield str(ready["coordination"])
        assert dev.terminate(timeout=60, signum=signal.SIGINT) == 0, log.read_text()
    finally:
        dev.kill()
        for pid in ready.get("child_pids", []):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def high_water_marks(uri: str) -> dict[int, int]:
    """Read independently of `waltz perf`: `waltz client high-water-mark`."""
    marks = {}
    for p in (0, 1):
        done = waltz("client", "high-water-mark", "--coordination", uri, "--partition", str(p))
        assert done.returncode == 0, done.stderr
        marks[p] = int(done.stdout)
    return marks


def perf_json(*args: str) -> dict[str, Any]:
    done = waltz("perf", *args, "--json")
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def check_latency(latency: dict[str, float] | None, samples: int) -> None:
    assert latency is not None
    assert latency["samples"] == samples
    assert 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert latency["mean_ms"] <= latency["max_ms"]
    assert latency["max_ms"] < 120_000  # within the run


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0
    summary = latency_summary([0.002, 0.001, 0.003])
    assert summary == {
        "p50_ms": 2.0, "p99_ms": 3.0, "max_ms": 3.0, "mean_ms": 2.0, "samples": 3,
    }  # fmt: skip
    assert latency_summary([]) is None


def test_producers_commit_exactly_n_and_report_sane_figures(cluster: str) -> None:
    before = high_water_marks(cluster)
    n, size = 301, 100
    summary = perf_json(
        "producers", "--coordination", cluster, "-n", str(n), "--producers", "2",
        "--in-flight", "8", "--size", str(size),
    )  # fmt: skip
    after = high_water_marks(cluster)
    assert summary["command"] == "producers"
    assert summary["transactions"] == summary["requested"] == n
    assert summary["errors"] == 0 and summary["first_error"] is None
    # the log holds exactly what was committed, round-robin over the two partitions
    assert after[0] - before[0] == 151 and after[1] - before[1] == 150
    assert summary["high_water_marks"] == {
        "before": {str(p): v for p, v in before.items()},
        "after": {str(p): v for p, v in after.items()},
    }
    check_latency(summary["latency"], n)
    elapsed = summary["elapsed_s"]
    assert elapsed > 0
    assert summary["tx_per_s"] == pytest.approx(n / elapsed, rel=0.02)
    assert summary["mb_per_s"] == pytest.approx(n * size / 1e6 / elapsed, rel=0.02)
    assert summary["lock_failures"] == 0  # no --lock-pool: nothing to fail
    assert summary["retries_per_tx"] == pytest.approx(summary["retries"] / n, rel=1e-3)
    assert summary["producers"] == 2 and summary["partitions"] == [0, 1]

    # the human summary: a table on stdout, no progress bar without a terminal
    table = waltz_process(
        "perf", "producers", "--coordination", cluster, "-n", "20", "--partitions", "1"
    )
    assert table.returncode == 0, table.stderr
    for row in ("transactions committed", "20 of 20", "tx/s", "MB/s", "commit latency p99",
                "retries per transaction", "lock failures", "p1: "):  # fmt: skip
        assert row in table.stdout
    assert "p0: " not in table.stdout  # --partitions 1 only
    assert table.stderr == ""
    assert high_water_marks(cluster)[1] == after[1] + 20


def test_a_tiny_lock_pool_makes_concurrent_producers_fail_and_retry(cluster: str) -> None:
    before = high_water_marks(cluster)
    n = 120
    summary = perf_json(
        "producers", "--coordination", cluster, "-n", str(n), "--producers", "3",
        "--in-flight", "4", "--lock-pool", "1", "--partitions", "0", "--size", "16",
    )  # fmt: skip
    after = high_water_marks(cluster)
    assert summary["transactions"] == n and summary["errors"] == 0
    assert after[0] - before[0] == n and after[1] == before[1]
    # 12 concurrent submissions on one WRITE lock: most attempts fail the check
    assert summary["lock_failures"] > 0
    assert summary["retries"] >= summary["lock_failures"]
    assert summary["retries_per_tx"] == pytest.approx(summary["retries"] / n, rel=1e-3)
    assert summary["retries_per_tx"] > 0
    check_latency(summary["latency"], n)


def run_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run `waltz` with stderr on a pseudo-terminal: (exit code, stdout, terminal output)."""
    controller, terminal = pty.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "waltz_cli", *args],
            stdout=subprocess.PIPE, stderr=terminal, stdin=subprocess.DEVNULL,
            env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
        )  # fmt: skip
        os.close(terminal)
        terminal = -1
        seen = bytearray()
        try:
            while True:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            out = child.stdout.read().decode() if child.stdout else ""
            return child.wait(timeout=60), out, seen.decode(errors="replace")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            if child.stdout:
                child.stdout.close()
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)


def test_the_progress_bar_shows_on_a_terminal_only(cluster: str) -> None:
    args = ("perf", "producers", "--coordination", cluster, "-n", "60", "--lock-pool", "2")
    code, out, shown = run_on_a_terminal(*args)
    assert code == 0, shown
    assert "produced" in shown and "60/60" in shown and "lock failures" in shown
    assert "tx/s" in shown
    assert "transactions committed" in out  # the summary stays on stdout
    code, out, shown = run_on_a_terminal(*args, "--no-progress")
    assert code == 0, shown
    assert "produced" not in shown and "transactions committed" in out


def test_without_coordination_the_dev_cluster_in_this_directory_is_used(
    cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev_dir = Path(cluster.removeprefix("local://").split("?")[0]).parent
    monkeypatch.chdir(dev_dir.parent)
    before = high_water_marks(cluster)
    summary = perf_json("producers", "-n", "10", "--partitions", "0")
    assert summary["transactions"] == 10
    assert high_water_marks(cluster)[0] == before[0] + 10
    monkeypatch.chdir(dev_dir)  # no ./.waltz-dev here: one clear line
    lost = waltz("perf", "consumers", "-n", "10")
    assert lost.returncode == 1 and "give --coordination URI" in lost.stderr


def test_ctrl_c_says_how_far_the_run_got(cluster: str) -> None:
    before = high_water_marks(cluster)[0]
    child = subprocess.Popen(
        [sys.executable, "-m", "waltz_cli", "perf", "producers", "--coordination",
         cluster, "-n", "10000000", "--partitions", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while high_water_marks(cluster)[0] < before + 50:  # producing
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == 130, err
    assert err.startswith("interrupted: ") and "transactions committed in" in err
    assert err.count("\n") == 1 and out == ""


async def test_tasks_that_lose_a_cancellation_are_cancelled_again() -> None:
    """A Ctrl-C cancels the producers once; one that loses the cancellation (as
    Python 3.11's asyncio.wait_for can) is cancelled again until it ends."""
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed >= 3:
                    raise

    task = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(30):
        await cancel_until_done({task})
    assert task.cancelled() and swallowed == 3


def test_rate_limits_the_producers(cluster: str) -> None:
    n, rate = 30, 40.0
    summary = perf_json(
        "producers", "--coordination", cluster, "-n", str(n), "--rate", str(rate),
        "--producers", "2",
    )  # fmt: skip
    assert summary["transactions"] == n and summary["rate"] == rate
    # the last submission is scheduled (n - 1) / rate seconds after the start
    assert summary["elapsed_s"] >= (n - 1) / rate
    assert summary["tx_per_s"] <= rate * n / (n - 1)


def test_consumers_read_n_each_and_measure_delivery_when_producing(cluster: str) -> None:
    before = high_water_marks(cluster)
    n, size = 200, 64
    produced = perf_json(
        "consumers", "--coordination", cluster, "-n", str(n), "--consumers", "2", "--produce",
        "--size", str(size),
    )  # fmt: skip
    after = high_water_marks(cluster)
    assert sum(after.values()) - sum(before.values()) == n
    assert produced["per_consumer"] == [n, n] and produced["transactions"] == 2 * n
    assert produced["bytes"] == 2 * n * size
    assert produced["positions"] == {
        "after": {str(p): v for p, v in before.items()},
        "until": {str(p): v for p, v in after.items()},
    }
    check_latency(produced["delivery_latency"], 2 * n)  # every delivery, both consumers
    assert produced["produced"]["transactions"] == n and produced["produced"]["errors"] == 0
    assert produced["tx_per_s"] == pytest.approx(2 * n / produced["elapsed_s"], rel=0.02)
    assert produced["feed_errors"] == []

    # without --produce: the last n committed, each consumer reads them all
    read = perf_json("consumers", "--coordination", cluster, "-n", str(n), "--consumers", "3")
    assert read["per_consumer"] == [n, n, n]
    assert read["positions"]["until"] == {str(p): v for p, v in after.items()}
    assert read["positions"]["after"] == {str(p): v - n // 2 for p, v in after.items()}
    assert read["bytes"] == 3 * n * size  # the data of what --produce wrote
    assert read["delivery_latency"] is None  # old transactions: their age is no latency
    assert read["mb_per_s"] == pytest.approx(3 * n * size / 1e6 / read["elapsed_s"], rel=0.02)

    headers = waltz("perf", "consumers", "--coordination", cluster, "-n", "50", "--no-data")
    assert headers.returncode == 0, headers.stderr
    assert "50 (1 consumers x 50)" in headers.stdout
    assert "not fetched" in headers.stdout and "not measured" in headers.stdout
    assert "produced" not in headers.stdout

    too_many = waltz("perf", "consumers", "--coordination", cluster, "-n", "100000000")
    assert too_many.returncode == 1
    assert too_many.stderr.count("\n") == 1 and "needed" in too_many.stderr
    assert "--produce" in too_many.stderr


def test_errors_are_one_clear_line(tmp_path: Path) -> None:
    nowhere = f"local://{tmp_path / 'none'}?root=/waltz"
    missing = waltz_process("perf", "producers", "--coordination", nowhere, "-n", "5")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: no Waltz cluster") and missing.stderr.count("\n") == 1

    # a cluster whose server is not running: fails after --timeout, one line
    (tmp_path / "idle").mkdir()
    idle = f"local://{tmp_path / 'idle'}?root=/waltz"
    created = waltz(
        "cluster", "create", "--coordination", idle, "--partitions", "1", "--replicas", "1",
        "--storage", "127.0.0.1:1",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    started = time.monotonic()
    down = waltz("perf", "consumers", "--coordination", idle, "-n", "5", "--produce",
                 "--timeout", "2")  # fmt: skip
    assert down.returncode == 4  # the cluster did not answer within --timeout
    assert down.stderr.startswith("error: ") and down.stderr.count("\n") == 1
    assert "within 2 s (--timeout)" in down.stderr
    assert time.monotonic() - started < 30

    bad = waltz("perf", "producers", "--coordination", idle, "--partitions", "1-x")
    assert bad.returncode == 1 and "--partitions takes" in bad.stderr
    zero = waltz("perf", "producers", "--coordination", idle, "-n", "0")
    assert zero.returncode == 2 and "--transactions" in zero.stderr
    assert waltz("perf", "producers", "--help").returncode == 0


STUBBORN_RUN = """
import asyncio, sys
from waltz_client.cli import perf

perf.INTERRUPT_GRACE = 1.0

async def work(meter):
    print("running", flush=True)
    while True:  # a run that never gives up (every cancellation lost)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

perf._run_with_meter(work, False, [], "committed")
"""


def test_ctrl_c_ends_even_a_run_that_will_not_stop() -> None:
    """Ctrl-C stops `waltz perf` whatever the load: a run that loses every cancellation
    (or a close that hangs) is ended after INTERRUPT_GRACE with the same one line."""
    child = subprocess.Popen(
        [sys.executable, "-c", STUBBORN_RUN],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "running\n"
        child.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, err = child.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == 130, err
    assert err.startswith("interrupted: 0 transactions committed") and err.count("\n") == 1
    assert 0.9 < took < 60
