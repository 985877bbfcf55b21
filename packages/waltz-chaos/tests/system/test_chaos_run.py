"""``waltz chaos`` on a real cluster, as CI runs it (tox -e chaos, as root).

- the fixed-seed run: ZooKeeper x ZeroMQ x fs, 90 s of workload, at least 30 faults
  with network partitions between namespaces; any violation fails it;
- Ctrl-C in the middle of a run: every process, namespace and mount it made is gone;
- without namespaces (``--network off``): process faults only, and it says so.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from waltz_chaos.netns import NAMESPACE_PREFIX, leftover_namespaces, namespaces_available

WHY_NOT = namespaces_available()
if WHY_NOT is not None and os.environ.get("WALTZ_CHAOS_REQUIRE_NETNS") == "1":
    raise RuntimeError(f"WALTZ_CHAOS_REQUIRE_NETNS=1 but {WHY_NOT}")
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")

pytestmark = [pytest.mark.system, pytest.mark.slow]

CI_SEED = 1
CI_DURATION = 90
NETWORK_KINDS = {"partition", "one_way", "isolate", "storage_cut_off"}


def chaos(*args: str) -> list[str]:
    return [sys.executable, "-m", "waltz_chaos", *args]


def our_mounts() -> list[str]:
    with open("/proc/mounts") as mounts:
        return [line.split()[1] for line in mounts if line.startswith("waltz-chaos-")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours would still answer: read its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@needs_root
def test_the_ci_run_finds_no_violation(tmp_path: Path) -> None:
    before = set(leftover_namespaces())
    out = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run(
        chaos(
            "--seed",
            str(CI_SEED),
            "--duration",
            str(CI_DURATION),
            "--network",
            "namespaces",
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    wall = time.monotonic() - started
    sys.stdout.write(result.stdout[-6000:])
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert result.returncode == 0, (result.stderr[-3000:], summary["violations"])
    assert summary["ok"] and summary["violations"] == []
    assert summary["faults"] >= 30, summary["faults_by_kind"]
    kinds = summary["faults_by_kind"]
    assert sum(kinds.get(k, 0) for k in NETWORK_KINDS) >= 5, kinds
    assert kinds.get("kill", 0) >= 3 and kinds.get("coordination_restart", 0) >= 1, kinds
    assert summary["acknowledgements"] > 500
    assert summary["first_commit_after_heal"] is not None
    assert summary["unexpected_exits"] == [], summary["unexpected_exits"]
    page = (out / "report.html").read_text()
    assert "<svg" in page and "OK: no violation" in page
    assert set(leftover_namespaces()) == before
    assert our_mounts() == []
    sys.stdout.write(f"\nthe CI chaos run took {wall:.0f} s of wall time\n")


@needs_root
def test_ctrl_c_removes_everything_the_run_made(tmp_path: Path) -> None:
    before = set(leftover_namespaces())
    process = subprocess.Popen(
        chaos(
            "--seed",
            "2",
            "--duration",
            "60",
            "--network",
            "namespaces",
            "--out",
            str(tmp_path / "run"),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    seen: list[str] = []
    injected = 0
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 180
    try:
        while injected < 3 and time.monotonic() < deadline:
            if not selector.select(timeout=1.0):
                continue
            line = process.stdout.readline()
            if not line:
                break
            seen.append(line)
            injected += " inject " in line
        assert injected >= 3, "".join(seen)
        ours = sorted(set(leftover_namespaces()) - before)
        assert ours and all(n.startswith(NAMESPACE_PREFIX) for n in ours)
        pids = [
            int(pid)
            for namespace in ours
            for pid in subprocess.run(
                ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True
            ).stdout.split()
        ]
        assert len(pids) >= 9, pids  # zk, 3 storage nodes, 2 servers, 4 clients (one may be down)
        assert our_mounts()
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    assert set(leftover_namespaces()) == before, output[-3000:]
    assert our_mounts() == []
    assert [pid for pid in pids if alive(pid)] == []


def test_without_namespaces_process_faults_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        chaos(
            "--seed",
            "3",
            "--duration",
            "45",
            "--network",
            "off",
            "--faults",
            "kill,pause",
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    sys.stdout.write(result.stdout[-3000:])
    assert "network faults are off: --network off; running process faults only" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert result.returncode == 0, (result.stderr[-3000:], summary["violations"])
    assert set(summary["faults_by_kind"]) <= {"kill", "pause"} and summary["faults"] >= 3
    assert "loopback" in summary["network"]
