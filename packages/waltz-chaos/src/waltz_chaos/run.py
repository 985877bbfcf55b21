"""One chaos run, from the empty machine back to the empty machine.

1. the network: namespaces and links (:mod:`waltz_chaos.netns`) when the machine
   allows them (root, iproute2), else loopback and process faults only (said so);
   this process moves into the ``admin`` namespace;
2. the schedule: drawn from the seed, or read from a schedule file; written to the
   run directory;
3. the cluster (:mod:`waltz_chaos.cluster`) and its clients start; the workload runs
   for ``duration`` seconds while the nemesis plays the schedule, then every fault
   is healed and the quiet end lets the liveness bounds run;
4. the clients stop submitting and drain, then catch up with the log and exit; the
   cluster is read back (:mod:`waltz_chaos.collect`); every process is stopped;
5. the checker judges each workload's history (:func:`waltz_sim.checker.check`);
   the reports are written (:mod:`waltz_chaos.report`).

Whatever happens (an error, Ctrl-C, SIGTERM), every process the run started is
stopped by its pid, every file system it mounted is unmounted and every namespace it
created is deleted, by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from waltz_chaos.cluster import Cluster, ClusterSettings
from waltz_chaos.collect import load_client, read_back
from waltz_chaos.errors import ChaosError
from waltz_chaos.nemesis import Nemesis
from waltz_chaos.netns import NetworkLab, leftover_namespaces, namespaces_available
from waltz_chaos.report import Summary, analyse, html_report, json_report, text_report
from waltz_chaos.schedule import STORAGE_FAULTS, Roles, Schedule, generate
from waltz_sim.checker import History, LivenessBounds, Violation, check
from waltz_sim.workloads import op_mix

log = logging.getLogger(__name__)

NETWORK_MODES = ("auto", "namespaces", "off")
STORAGE_FAULT_OPTIONS = {"segment_size": 4096, "verify_on_open": 1}
"""The storage nodes' ``fs`` options in a run with storage faults: small segments (so
that there are sealed ones to damage) and every record checked when a node starts (the
damage becomes a hole the cluster repairs, as an operator would after a CORRUPTION in
its log)."""


@dataclass
class ChaosConfig:
    """A run (``waltz chaos``'s options)."""

    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    duration: float = 120.0
    """Seconds of workload: the faults, then the quiet end."""
    quiet: float | None = None
    """Seconds at the end without faults (None: the decision deadline and 8 s)."""
    faults: str = "standard"
    schedule: Path | None = None
    network: str = "auto"
    out: Path | None = None
    bounds: LivenessBounds = field(
        default_factory=lambda: LivenessBounds(decision_deadline=20.0, commit_bound=10.0)
    )
    keep_data: bool = False
    attach: str | None = None
    """The coordination URI of a running cluster to use instead of starting one."""
    processes: dict[str, int] = field(default_factory=dict)
    """With ``attach``: its processes the nemesis may pause and kill (role -> pid)."""
    storage_endpoint: str = "tcp://{}"
    transport_options: dict[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return self.cluster.seed

    @property
    def quiet_seconds(self) -> float:
        return self.quiet if self.quiet is not None else self.bounds.decision_deadline + 8.0


@dataclass
class RunResult:
    summary: Summary
    run_dir: Path

    @property
    def ok(self) -> bool:
        return self.summary.ok


def _run_dir(config: ChaosConfig) -> Path:
    if config.out is not None:
        config.out.mkdir(parents=True, exist_ok=True)
        return config.out.resolve()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.mkdtemp(prefix=f"waltz-chaos-{stamp}-seed{config.seed}-"))


def _replay_command(config: ChaosConfig, run_dir: Path) -> str:
    c = config.cluster
    return (
        f"waltz chaos --seed {config.seed} --duration {config.duration:g} "
        f"--coordination {c.coordination} --storage-nodes {c.storage_nodes} "
        f"--servers {c.servers} --clients {c.clients} --schedule {run_dir / 'schedule.json'}"
    )


async def run_chaos(config: ChaosConfig, echo: Callable[[str], None] = print) -> RunResult:
    """The whole run (see the module docstring)."""
    started = time.monotonic()
    if config.attach is not None:
        return await _run_attached(config, echo, started)
    settings = config.cluster
    if config.network not in NETWORK_MODES:
        raise ChaosError(f"--network {config.network!r}: choose one of {', '.join(NETWORK_MODES)}")
    why_not = None if config.network != "off" else "--network off"
    if why_not is None:
        why_not = namespaces_available()
    if why_not is not None and config.network == "namespaces":
        raise ChaosError(f"network namespaces are not available: {why_not}")
    use_namespaces = why_not is None
    mount_disks = os.geteuid() == 0 and shutil.which("mount") is not None
    network_text = (
        "each role in its own network namespace (10.77.0.0/24, veth pairs)"
        if use_namespaces
        else f"loopback; no network faults ({why_not}): process faults only"
    )
    if not use_namespaces:
        echo(f"network faults are off: {why_not}; running process faults only")
    roles = Roles.of(settings.storage_nodes, settings.servers, settings.clients)
    run_dir = _run_dir(config)
    if config.schedule is not None:
        schedule = Schedule.load(config.schedule)
        schedule.check_fits(roles, network=use_namespaces, disk=mount_disks)
        config = replace(config, duration=schedule.duration, quiet=schedule.quiet)
        settings = replace(settings, seed=schedule.seed)
        config = replace(config, cluster=settings)
    else:
        schedule = generate(
            config.seed,
            roles,
            duration=config.duration,
            quiet=config.quiet_seconds,
            profile_spec=config.faults,
            network=use_namespaces,
            disk=mount_disks,
            session_timeout=settings.session_timeout,
        )
    schedule.save(run_dir / "schedule.json")
    if any(f.kind in STORAGE_FAULTS for f in schedule.faults):
        # sealed segments to damage, and damage found at a node's start
        settings = replace(settings, storage_options=dict(STORAGE_FAULT_OPTIONS))
        config = replace(config, cluster=settings)
    replay = _replay_command(config, run_dir)
    echo(
        f"waltz chaos: seed {config.seed}, {config.duration:g} s, {len(schedule.faults)} faults "
        f"scheduled ({config.faults}); run directory {run_dir}"
    )
    lab: NetworkLab | None = None
    cluster: Cluster | None = None
    try:
        if use_namespaces:
            lab = NetworkLab(
                uuid.uuid4().hex[:6],
                ["admin", *roles.all],
                [*roles.links(), *(("admin", r) for r in roles.all)],
            )
            lab.create()  # before any thread: the executor's threads are made in admin
            lab.enter("admin")
            if not lab.netem:
                network_text += (
                    "; no netem in this kernel: slow links are rate limits (tbf), lossy "
                    "links a random drop filter (htb + cBPF)"
                )
        cluster = Cluster(settings, run_dir, lab, mount_disks=mount_disks)
        echo("starting the cluster ...")
        await cluster.start()
        echo(
            f"cluster up in {time.monotonic() - started:.0f} s: {settings.coordination}, "
            f"{settings.storage_nodes} storage nodes, {settings.servers} servers, "
            f"{settings.clients} clients ({', '.join(settings.workloads)})"
        )
        return await _play(
            config, schedule, cluster, lab, run_dir, replay, network_text, echo, started
        )
    finally:
        if cluster is not None:
            cluster.stop_all()
            with contextlib.suppress(Exception):
                cluster.unmount()
        if lab is not None:
            lab.destroy()


async def _run_attached(
    config: ChaosConfig, echo: Callable[[str], None], started: float
) -> RunResult:
    """A run on a cluster that is already running (``--attach``): no namespaces, no
    mounts, no coordination faults; process faults only on the processes named."""
    assert config.attach is not None
    settings = config.cluster
    run_dir = _run_dir(config)
    named = ", ".join(sorted(config.processes)) or "none"
    network_text = (
        f"attached to {config.attach}: no network, disk or coordination faults; process "
        f"faults on the processes named ({named})"
    )
    echo(f"attaching to {config.attach}; faults only on: {named}")
    cluster = Cluster(settings, run_dir, None, extra_transport_options=config.transport_options)
    try:
        await cluster.attach(config.attach, config.processes, config.storage_endpoint)
        roles = Roles(
            tuple(cluster.storage_endpoints),
            tuple(
                f"server-{i}"
                for i in range(
                    max(
                        cluster.attached_servers,
                        *(
                            int(r.rpartition("-")[2]) + 1
                            for r in config.processes
                            if r.startswith("server-")
                        ),
                        0,
                    )
                )
            ),
            tuple(m.name for m in cluster.of_kind("client")),
        )
        eligible = set(config.processes) | set(roles.clients)
        if config.schedule is not None:
            schedule = Schedule.load(config.schedule)
            schedule.check_fits(
                roles, network=False, disk=False, coordination=False, eligible=eligible, data=False
            )
            config = replace(config, duration=schedule.duration, quiet=schedule.quiet)
        else:
            schedule = generate(
                config.seed,
                roles,
                duration=config.duration,
                quiet=config.quiet_seconds,
                profile_spec=config.faults,
                network=False,
                disk=False,
                coordination=False,
                eligible=eligible,
                data=False,
                session_timeout=settings.session_timeout,
            )
        schedule.save(run_dir / "schedule.json")
        replay = (
            f"waltz chaos --attach {config.attach} "
            + "".join(f"--process {r}=PID " for r in sorted(config.processes))
            + f"--schedule {run_dir / 'schedule.json'}"
        )
        echo(f"{len(schedule.faults)} faults scheduled; run directory {run_dir}")
        return await _play(
            config, schedule, cluster, None, run_dir, replay, network_text, echo, started
        )
    finally:
        cluster.stop_all()


async def _play(  # noqa: PLR0917 - the run's parts, once
    config: ChaosConfig,
    schedule: Schedule,
    cluster: Cluster,
    lab: NetworkLab | None,
    run_dir: Path,
    replay: str,
    network_text: str,
    echo: Callable[[str], None],
    started: float,
) -> RunResult:
    settings = config.cluster
    start = time.monotonic()
    nemesis = Nemesis(cluster, lab, schedule, start, report=echo)
    try:
        await nemesis.run()
    finally:
        await nemesis.heal_all()
        await nemesis.close()
    healed = [r.healed_at for r in nemesis.records if r.healed_at is not None]
    final_heal = max(healed, default=start)
    echo(f"{time.monotonic() - start:7.1f}s  every fault healed; quiet until {config.duration:g} s")
    await asyncio.sleep(max(0.0, start + config.duration - time.monotonic()))
    drain = settings.transaction_timeout + settings.request_timeout + 15.0
    submissions_end = await cluster.stop_clients(timeout=drain)
    await cluster.finish_clients(timeout=90.0)
    end_time = time.monotonic()
    echo(f"{end_time - start:7.1f}s  clients stopped; reading the cluster back")
    assert cluster.transport is not None
    back = await read_back(
        coordination=cluster.coordination_uri,
        coordination_options=cluster.coordination_options,
        transport_options=cluster.transport_options,
        transport=cluster.transport,
        partitions=list(range(settings.num_partitions)),
        storage=cluster.storage_endpoints,
        cluster_key=cluster.cluster_key,
        num_partitions=settings.num_partitions,
    )
    cluster.stop_all()
    records = {
        m.name: load_client(m.name, Path(cluster.client_spec(m.name).database), cluster.events)
        for m in cluster.of_kind("client")
    }
    quiet = _quiet_periods(nemesis, start, final_heal)
    violations: list[tuple[str, Violation]] = []
    committed: dict[int, int] = {}
    partitions: dict[int, str] = {}
    for workload in settings.workloads:
        mine = settings.partitions_of(workload)
        for partition in mine:
            partitions[partition] = workload
        clients = [
            r for name, r in records.items() if cluster.client_spec(name).workload == workload
        ]
        history = History(
            ops=[op for r in clients for op in r.ops],
            feed=[e for r in clients for e in r.feed],
            clients=[c for r in clients for c in r.snapshots],
            start_time=start,
            end_time=end_time,
            healed_at=final_heal,
            quiet=quiet,
            submissions_end=submissions_end,
        )
        snapshot = replace(
            back.snapshot,
            partitions={
                p: back.snapshot.partitions[p] for p in mine if p in back.snapshot.partitions
            },
        )
        result = check(history, snapshot, op_mix(workload).semantics, config.bounds)
        committed.update(result.committed)
        violations += [
            (workload, replace(v, time=None if v.time is None else v.time - start))
            for v in result.violations
        ]
    keep = None
    if violations or config.keep_data:
        keep = run_dir / "storage-data"
        keep.mkdir(exist_ok=True)
    cluster.unmount(keep)
    summary = analyse(
        title=f"waltz chaos seed {config.seed}",
        settings=_settings_table(config, schedule),
        network=network_text,
        records=nemesis.records,
        ops=[op for r in records.values() for op in r.ops],
        committed=committed,
        violations=violations,
        events=cluster.events,
        partitions=partitions,
        start=start,
        duration=config.duration,
        final_heal=final_heal,
        submissions_end=submissions_end,
        replay=replay,
        notes=back.notes,
    )
    summary.wall_seconds = time.monotonic() - started
    (run_dir / "report.txt").write_text(text_report(summary))
    (run_dir / "report.html").write_text(html_report(summary))
    (run_dir / "summary.json").write_text(json_report(summary))
    return RunResult(summary, run_dir)


def _quiet_periods(nemesis: Nemesis, start: float, final_heal: float) -> list[tuple[float, float]]:
    """The stretches before the final heal with no fault active."""
    spans = sorted(
        (r.injected_at, r.healed_at)
        for r in nemesis.records
        if r.injected_at is not None and r.healed_at is not None
    )
    periods: list[tuple[float, float]] = []
    cursor = start
    for begin, end in spans:
        if begin > cursor:
            periods.append((cursor, begin))
        cursor = max(cursor, end)
    return [(a, b) for a, b in periods if b <= final_heal]


def _settings_table(config: ChaosConfig, schedule: Schedule) -> dict[str, Any]:
    c = config.cluster
    return {
        "seed": config.seed,
        "duration (s)": config.duration,
        "quiet end (s)": schedule.quiet,
        "faults": schedule.profile,
        "coordination": c.coordination,
        "storage nodes": c.storage_nodes,
        "servers": c.servers,
        "clients": c.clients,
        "workloads": ", ".join(c.workloads),
        "partitions": c.num_partitions,
        "session timeout (s)": c.session_timeout,
        "transaction timeout (s)": c.transaction_timeout,
        "ops per second per client": c.ops_per_second,
        "decision deadline (s)": config.bounds.decision_deadline,
        "commit bound (s)": config.bounds.commit_bound,
        **({"storage engine options": c.storage_options} if c.storage_options else {}),
    }


def clean_leftovers(echo: Callable[[str], None] = print, spare: Collection[str] = ()) -> int:
    """Remove what runs that were killed -9 left: their namespaces (and the processes in
    them, by pid) and their storage file systems (by mount source name); not the
    namespaces and mount points named in ``spare`` (another run's, still going)."""
    removed = 0
    for namespace in leftover_namespaces():
        if namespace in spare:
            continue
        pids = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "delete", namespace], check=False)
        echo(f"deleted namespace {namespace} ({len(pids)} processes killed)")
        removed += 1
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            source, target = line.split()[:2]
            if source.startswith("waltz-chaos-storage-") and target not in spare:
                subprocess.run(["umount", "-l", target], check=False)
                echo(f"unmounted {target}")
                removed += 1
    return removed


__all__ = ["NETWORK_MODES", "ChaosConfig", "RunResult", "clean_leftovers", "run_chaos"]
