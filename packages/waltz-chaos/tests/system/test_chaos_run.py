"""``waltz chaos`` on a real cluster, as CI runs it (tox -e chaos, as root).

- the fixed-seed run: ZooKeeper x ZeroMQ x fs, 90 s of workload, at least 30 faults
  with network partitions between namespaces; any violation fails it;
- Ctrl-C in the middle of a run: every process, namespace and mount it made is gone;
- without namespaces (``--network off``), on etcd: process faults only, and it says so;
- ``--attach`` to a running ``waltz dev`` cluster;
- the storage faults (``--faults storage``): every kind injected, every damaged node
  repaired by the cluster, no violation.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from waltz_chaos.netns import NAMESPACE_PREFIX, leftover_namespaces, namespaces_available
from waltz_chaos.run import clean_leftovers
from waltz_chaos.schedule import STORAGE_FAULTS, Fault, Roles, Schedule
from waltz_cli.devfile import read_ready_file

log = logging.getLogger(__name__)

WHY_NOT = namespaces_available()
if WHY_NOT is not None and os.environ.get("WALTZ_CHAOS_REQUIRE_NETNS") == "1":
    raise RuntimeError(f"WALTZ_CHAOS_REQUIRE_NETNS=1 but {WHY_NOT}")
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")

pytestmark = [pytest.mark.system, pytest.mark.slow]

CI_SEED = 1
CI_DURATION = 90
STORAGE_SEED = 36
"""Draws every storage fault in 70 s (test_schedule checks the generator's rules)."""
NETWORK_KINDS = {"partition", "one_way", "isolate", "storage_cut_off"}


def chaos(*args: str) -> list[str]:
    return [sys.executable, "-m", "waltz_chaos", *args]


def our_mounts(besides: set[str] | None = None) -> list[str]:
    """The chaos runs' mounts, less ``besides`` (another run's, made before the test)."""
    with open("/proc/mounts") as mounts:
        found = [line.split()[1] for line in mounts if line.startswith("waltz-chaos-")]
    return [m for m in found if m not in (besides or set())]


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, T, Z...), None when there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    # a zombie of ours would still answer a signal 0: read its state
    return process_state(pid) not in {None, "Z"}


@needs_root
def test_the_ci_run_finds_no_violation(tmp_path: Path) -> None:
    before = set(leftover_namespaces())
    mounts_before = set(our_mounts())
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
    assert our_mounts(mounts_before) == []
    sys.stdout.write(f"\nthe CI chaos run took {wall:.0f} s of wall time\n")


def test_damaged_storage_is_repaired_and_loses_nothing(tmp_path: Path) -> None:
    """``--faults storage``: segments corrupted and cut, data directories rolled back and
    wiped while their nodes are stopped, bits flipped in sealed segments of running
    nodes, with kills and pauses; each damaged node is repaired by the cluster before
    another storage node is touched, and the checker finds no lost or duplicated
    transaction."""
    before = set(leftover_namespaces())
    mounts_before = set(our_mounts())
    out = tmp_path / "run"
    network = "namespaces" if WHY_NOT is None else "off"
    result = subprocess.run(
        chaos(
            "--faults",
            "storage",
            "--seed",
            str(STORAGE_SEED),
            "--duration",
            "70",
            "--decision-deadline",
            "8",
            "--network",
            network,
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    sys.stdout.write(result.stdout[-4000:])
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert result.returncode == 0, (result.stderr[-3000:], summary["violations"])
    assert summary["ok"] and summary["violations"] == []
    assert set(STORAGE_FAULTS) <= set(summary["faults_by_kind"]), summary["faults_by_kind"]
    damaged = summary["storage_faults"]
    assert len(damaged) >= len(STORAGE_FAULTS)
    for fault in damaged:
        assert fault["healed"] is not None, fault
        assert any(note.startswith("repaired ") for note in fault["notes"]), fault
    assert summary["settings"]["storage engine options"]["verify_on_open"] == 1
    assert summary["acknowledgements"] > 300
    assert summary["unexpected_exits"] == [], summary["unexpected_exits"]
    assert set(leftover_namespaces()) == before
    assert our_mounts(mounts_before) == []


def with_sigint_ignored(command: list[str]) -> list[str]:
    """``command`` started as a background job of a script starts it: SIGINT ignored on
    entry (``cmd &`` in a non-interactive shell; a CI script's run in the background)."""
    return [
        sys.executable,
        "-c",
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "os.execv(sys.argv[1], sys.argv[1:])",
        *command,
    ]


@needs_root
@pytest.mark.parametrize("sigint", ["default", "ignored on entry"])
def test_ctrl_c_removes_everything_the_run_made(tmp_path: Path, sigint: str) -> None:
    """Ctrl-C (SIGINT) ends a run and removes everything it made: its processes, network
    namespaces and mounts. Also when the run was started with SIGINT ignored (a background
    job of a script): asyncio's own Ctrl-C handling is then not installed, and a run
    relying on it played on for minutes after the signal (found by a CI run started in
    the background)."""
    before = set(leftover_namespaces())
    mounts_before = set(our_mounts())
    command = chaos(
        "--seed",
        "2",
        "--duration",
        "600",  # never over before the Ctrl-C, however slow the machine
        "--network",
        "namespaces",
        "--out",
        str(tmp_path / "run"),
    )
    process = subprocess.Popen(
        command if sigint == "default" else with_sigint_ignored(command),
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
        assert our_mounts(mounts_before)
        assert process.poll() is None, "the run ended before the Ctrl-C"
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
            clean_leftovers(log.warning, spare=before | mounts_before)  # killed -9: by pid
    assert process.returncode != 0
    assert set(leftover_namespaces()) == before, output[-3000:]
    assert our_mounts(mounts_before) == []
    assert [pid for pid in pids if alive(pid)] == []


def test_without_namespaces_process_faults_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        chaos(
            "--seed",
            "3",
            "--duration",
            "30",
            "--decision-deadline",
            "8",
            "--network",
            "off",
            "--coordination",
            "etcd",
            "--faults",
            "kill,pause,coordination_restart",
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
    kinds = summary["faults_by_kind"]
    assert set(kinds) <= {"kill", "pause", "coordination_restart"} and summary["faults"] >= 3
    assert kinds.get("coordination_restart", 0) >= 1, kinds  # seed 3 draws one: etcd's
    assert summary["settings"]["coordination"] == "etcd"
    assert "loopback" in summary["network"]


def _storage_pids(info: dict[str, Any]) -> dict[str, int]:
    """The dev cluster's storage nodes: metadata name (host:port) -> pid."""
    found: dict[str, int] = {}
    for pid in info["child_pids"]:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"storage" not in args:
            continue
        config = Path(args[args.index(b"--config") + 1].decode())
        endpoint = tomllib.loads(config.read_text())["transport"]["endpoint"]
        found[endpoint.removeprefix("tcp://")] = pid
    return found


def test_attach_to_a_running_cluster(tmp_path: Path) -> None:
    """waltz chaos --attach on a waltz dev cluster, replaying a schedule: its clients, a
    pause of the one storage node named and one of its own clients, the checker; the
    cluster stays up. (Pauses
    only: waltz dev stops the whole cluster when one of its children dies; a killed
    external process's restart is tested in test_external.py.)"""
    data = tmp_path / "dev"
    dev = subprocess.Popen(
        [sys.executable, "-m", "waltz_cli", "dev", "--data-dir", str(data), "--partitions", "4"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        info = None
        for _ in range(1200):
            info = read_ready_file(data)
            if info is not None or dev.poll() is not None:
                break
            time.sleep(0.1)
        assert info is not None, "waltz dev did not start"
        storage = _storage_pids(info)
        assert storage, info
        first = sorted(storage)[0]
        # a schedule of our own: a drawn one may leave the named node alone in 30 s
        schedule = Schedule(
            0,
            30.0,
            16.0,
            "pause",
            Roles.of(len(storage), 1, 4),
            [Fault(6.0, "pause", 3.0, ("storage-0",)), Fault(10.0, "pause", 2.0, ("client-1",))],
        )
        schedule.save(tmp_path / "schedule.json")
        out = tmp_path / "run"
        result = subprocess.run(
            chaos(
                "--attach",
                info["coordination"],
                "--process",
                f"storage-0={storage[first]}",
                "--schedule",
                str(tmp_path / "schedule.json"),
                "--decision-deadline",
                "8",
                "--out",
                str(out),
            ),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        sys.stdout.write(result.stdout[-3000:])
        summary = json.loads((out / "summary.json").read_text())
        assert result.returncode == 0, (result.stderr[-3000:], summary["violations"])
        assert "attached to" in summary["network"]
        assert summary["faults_by_kind"] == {"pause": 2}, summary["faults_by_kind"]
        timeline = (out / "report.txt").read_text().split("\ntimeline")[1]
        assert "pause: storage-0" in timeline and "pause: client-1" in timeline, timeline
        assert summary["acknowledgements"] > 100
        # the cluster is still up, the paused node running again (SIGCONT at the heal)
        assert read_ready_file(data) is not None
        assert all(alive(pid) for pid in storage.values())
        assert process_state(storage[first]) not in {"T", "t"}
    finally:
        dev.send_signal(signal.SIGINT)
        try:
            dev.wait(timeout=60)
        except subprocess.TimeoutExpired:
            dev.kill()
            dev.wait()


@needs_root
def test_clean_removes_what_a_killed_run_left_and_spares_what_it_is_told() -> None:
    """``waltz chaos --clean`` (``clean_leftovers``): a killed run's namespace goes, with
    the process in it (by pid); a namespace named in ``spare`` (a run still going) stays."""
    tag = f"{NAMESPACE_PREFIX}cleantest{os.getpid()}"
    left, going = f"{tag}-left", f"{tag}-going"
    for namespace in (left, going):
        subprocess.run(["ip", "netns", "add", namespace], check=True, timeout=30)
    sleeper = subprocess.Popen(["ip", "netns", "exec", left, "sleep", "300"])
    try:
        deadline = time.monotonic() + 30
        while not subprocess.run(
            ["ip", "netns", "pids", left], capture_output=True, text=True, check=True
        ).stdout.split():
            assert time.monotonic() < deadline, "the sleeper never ran in its namespace"
            time.sleep(0.05)
        others = set(leftover_namespaces()) - {left}
        said: list[str] = []
        assert clean_leftovers(said.append, spare=others) >= 1
        assert left not in leftover_namespaces() and going in leftover_namespaces()
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
        assert any(left in line and "1 processes killed" in line for line in said), said
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        for namespace in (left, going):
            subprocess.run(["ip", "netns", "delete", namespace], check=False, timeout=30)
