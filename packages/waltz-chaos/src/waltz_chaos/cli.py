"""``waltz chaos``: a Jepsen-style fault run on a real cluster (docs/chaos.md).

::

    waltz chaos                                   # 2 minutes, seed 0, every fault
    waltz chaos --seed 7 --duration 15m           # a long run
    waltz chaos --schedule RUN/schedule.json      # replay a run's faults
    waltz chaos --faults kill,partition           # only those faults
    waltz chaos --clean                           # remove what a killed run left

It prints each fault as it is injected and healed, then the verdict, and writes
``report.txt``, ``report.html`` and ``summary.json`` in the run directory. The exit
code is 1 when the checker found a violation (or the run failed), 2 for a usage
error.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import sys
from pathlib import Path

import click

from waltz_chaos.cluster import ClusterSettings
from waltz_chaos.errors import ChaosError
from waltz_chaos.run import NETWORK_MODES, ChaosConfig, clean_leftovers, run_chaos
from waltz_chaos.schedule import FAULT_DESCRIPTIONS, PROFILES
from waltz_sim.checker import LivenessBounds
from waltz_sim.workloads import OP_MIXES

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``1h30m`` -> seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms]?)", text.strip().lower())
    if not parts or "".join(a + b for a, b in parts) != text.strip().lower():
        raise click.BadParameter(f"{text!r}: give seconds (90), or 15m, 1h, 1h30m")
    return sum(float(n) * _UNITS[u] for n, u in parts)


class _Duration(click.ParamType):  # type: ignore[type-arg]
    name = "duration"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except click.BadParameter as exc:
            self.fail(str(exc.message), param, ctx)


@click.command("chaos")
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Draws the fault schedule and the clients' ops.",
)
@click.option(
    "--duration",
    type=_Duration(),
    default="120",
    show_default=True,
    help="Workload time: 90, 15m, 1h.",
)
@click.option(
    "--faults",
    default="standard",
    show_default=True,
    help=f"A profile ({', '.join(PROFILES)}) or a comma-separated list of faults "
    f"({', '.join(FAULT_DESCRIPTIONS)}).",
)
@click.option(
    "--schedule",
    "schedule",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Replay this schedule file (a run's schedule.json).",
)
@click.option("--coordination", type=click.Choice(["zk", "etcd"]), default="zk", show_default=True)
@click.option("--storage-nodes", type=click.IntRange(3, 9), default=3, show_default=True)
@click.option("--servers", type=click.IntRange(1, 9), default=2, show_default=True)
@click.option(
    "--clients",
    type=click.IntRange(1, 20),
    default=4,
    show_default=True,
    help="Client processes (the workloads in turn).",
)
@click.option(
    "--workloads",
    default="bank,register",
    show_default=True,
    help=f"Comma-separated, of {', '.join(OP_MIXES)}.",
)
@click.option(
    "--partitions",
    type=click.IntRange(1, 16),
    default=2,
    show_default=True,
    help="Partitions per workload.",
)
@click.option(
    "--rate", type=float, default=4.0, show_default=True, help="Ops per second per client."
)
@click.option(
    "--session-timeout",
    type=float,
    default=4.0,
    show_default=True,
    help="Coordination session timeout (s) of servers and clients.",
)
@click.option(
    "--network",
    type=click.Choice(NETWORK_MODES),
    default="auto",
    show_default=True,
    help="namespaces: require them; off: loopback, process faults only.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Run directory (default: a new one in the temp dir).",
)
@click.option(
    "--keep-data",
    is_flag=True,
    help="Copy the storage nodes' data into the run directory (done anyway on a violation).",
)
@click.option(
    "--decision-deadline",
    type=float,
    default=20.0,
    show_default=True,
    help="Liveness: seconds for a submission to be decided after a heal.",
)
@click.option(
    "--commit-bound",
    type=float,
    default=10.0,
    show_default=True,
    help="Liveness: seconds for commits to resume after a heal.",
)
@click.option(
    "--attach",
    metavar="URI",
    help="Use the running cluster at this coordination URI (its workload partitions empty) "
    "instead of starting one.",
)
@click.option(
    "--process",
    "processes",
    multiple=True,
    metavar="ROLE=PID",
    help="With --attach: a process of it the faults may pause and kill (storage-N or "
    "server-N); repeat it.",
)
@click.option(
    "--storage-endpoint",
    default="tcp://{}",
    show_default=True,
    help="With --attach: a storage node's endpoint, {} being its name in the metadata.",
)
@click.option(
    "--transport-option",
    "transport_option",
    multiple=True,
    metavar="KEY=VALUE",
    help="With --attach: a transport option of the clients (e.g. security=plaintext).",
)
@click.option(
    "--clean",
    is_flag=True,
    help="Only remove what killed runs left (namespaces, their processes, mounts).",
)
@click.option("-v", "--verbose", count=True, help="Log the run's own steps (-v info, -vv debug).")
def chaos(  # noqa: PLR0917 - click passes options by name
    seed: int,
    duration: float,
    faults: str,
    schedule: Path | None,
    coordination: str,
    storage_nodes: int,
    servers: int,
    clients: int,
    workloads: str,
    partitions: int,
    rate: float,
    session_timeout: float,
    network: str,
    out: Path | None,
    keep_data: bool,
    decision_deadline: float,
    commit_bound: float,
    attach: str | None,
    processes: tuple[str, ...],
    storage_endpoint: str,
    transport_option: tuple[str, ...],
    clean: bool,
    verbose: int,
) -> None:
    """A Jepsen-style fault run on a real cluster, checked by the simulation's checker."""
    logging.basicConfig(
        level=logging.WARNING - 10 * min(verbose, 2),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("kazoo", "waltz_coord_zk", "waltz_coord_etcd", "waltz_client"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    if clean:
        removed = clean_leftovers(click.echo)
        click.echo(f"removed {removed} leftovers")
        return
    names = tuple(w.strip() for w in workloads.split(",") if w.strip())
    unknown = [w for w in names if w not in OP_MIXES]
    if not names or unknown:
        raise click.BadParameter(
            f"unknown workloads {unknown}; choose of {', '.join(OP_MIXES)}",
            param_hint="--workloads",
        )
    pids: dict[str, int] = {}
    for item in processes:
        role, _, pid = item.partition("=")
        if not pid.isdigit() or role.rpartition("-")[0] not in ("storage", "server"):
            raise click.BadParameter(
                f"{item!r}: give ROLE=PID, ROLE storage-N or server-N", param_hint="--process"
            )
        pids[role] = int(pid)
    if pids and attach is None:
        raise click.BadParameter("only with --attach", param_hint="--process")
    options: dict[str, object] = {}
    for item in transport_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: give KEY=VALUE", param_hint="--transport-option")
        options[key] = value
    if duration < 30:
        raise click.BadParameter("at least 30 seconds", param_hint="--duration")
    config = ChaosConfig(
        cluster=ClusterSettings(
            coordination=coordination,
            storage_nodes=storage_nodes,
            servers=servers,
            clients=clients,
            workloads=names,
            partitions_per_workload=partitions,
            session_timeout=session_timeout,
            ops_per_second=rate,
            seed=seed,
        ),
        duration=duration,
        faults=faults,
        schedule=schedule,
        network=network,
        out=out,
        bounds=LivenessBounds(decision_deadline=decision_deadline, commit_bound=commit_bound),
        keep_data=keep_data,
        attach=attach,
        processes=pids,
        storage_endpoint=storage_endpoint,
        transport_options=options,
    )
    try:
        result = asyncio.run(_main(config))
    except ChaosError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("")
    click.echo((result.run_dir / "report.txt").read_text().split("\ntimeline")[0].rstrip())
    click.echo("")
    click.echo(f"report: {result.run_dir / 'report.html'}")
    if not result.ok:
        sys.exit(1)


async def _main(config: ChaosConfig):  # type: ignore[no-untyped-def]
    """The run as the main task: Ctrl-C (SIGINT) and SIGTERM cancel it (its clean-up
    runs). SIGINT has a handler of its own: asyncio's Ctrl-C handling is not installed
    when the process started with SIGINT ignored (a background job of a script), and the
    run then played on after the signal."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    return await run_chaos(config, click.echo)


__all__ = ["chaos", "parse_duration"]
