"""``waltz simulate``: run seeds of the deterministic simulation and report each verdict.

::

    waltz simulate --seed 17                       # one seed (replays it exactly)
    waltz simulate --seeds 0..199                  # a range (what CI runs)
    waltz simulate --seeds 0.. --budget 3600       # seeds until the wall-time budget ends
    waltz simulate --seed 17 --trace               # the whole trace of the run

Per seed it prints the faults injected, the ops and their outcomes, the commits
and the verdict; a failing seed prints the command that replays it, the
violations, and the trace of the events that led to the first one. The exit code
is 1 when a seed failed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Iterator

import click

from waltz_sim.faults import PROFILES
from waltz_sim.known_issues import KnownIssue, explained_by
from waltz_sim.points import coverage_table
from waltz_sim.runner import (
    ACL_SHARE,
    ARCHIVE_SHARE,
    EXACT_SHARE,
    FIVE_NODES_SHARE,
    PLAIN_SHARE,
    REPLACE_SHARE,
    SeedResult,
    mixed,
    run_seed,
    variant,
)
from waltz_sim.workloads import WORKLOADS
from waltz_sim.world import SimConfig

DEFAULT_BUDGET = 3600.0


def parse_seeds(seed: int | None, seeds: str | None) -> tuple[int, int | None]:
    """(first, last) seeds, last None for an open range."""
    if seed is not None and seeds is not None:
        raise click.UsageError("give --seed or --seeds, not both")
    if seeds is None:
        return (seed if seed is not None else 0), (seed if seed is not None else 0)
    first_text, sep, last_text = seeds.partition("..")
    try:
        first = int(first_text)
        last = int(last_text) if last_text else None
    except ValueError:
        raise click.UsageError(f"--seeds takes A..B or A.. (integers), got {seeds!r}") from None
    if not sep:
        last = first
    if last is not None and last < first:
        raise click.UsageError(f"--seeds {seeds}: the last seed is below the first")
    return first, last


def _known(result: SeedResult) -> KnownIssue | None:
    if result.ok or result.error:
        return None
    return explained_by(result.violations)


def _summary(result: SeedResult) -> str:
    outcomes = result.outcomes
    ops = sum(outcomes.values())
    detail = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
    commits = sum(result.committed.values())
    known = _known(result)
    verdict = "ok" if result.ok else f"known issue {known.id}" if known else "FAILED"
    kind = variant(result.config)
    seed = f"seed {result.seed} ({kind})" if kind else f"seed {result.seed}"
    return (
        f"{seed}: {verdict}: {result.faults} faults, {ops} ops ({detail}), "
        f"{commits} commits; {result.sim_seconds:.0f} s simulated in {result.wall_seconds:.2f} s "
        f"({result.speed:.0f}x)"
    )


def _report(result: SeedResult, *, verbose: bool, show_trace: bool) -> None:
    click.echo(_summary(result))
    if verbose or not result.ok:
        for line in result.fault_log:
            click.echo(f"    fault at {line}")
    if result.loop_errors:
        for error in result.loop_errors[:5]:
            click.echo(f"    event loop error: {error}")
    known = _known(result)
    if known is not None:
        click.echo(f"  {known.summary} ({known.where}); replay: {result.replay_command()}")
        for violation in result.violations[:3]:
            click.echo(f"  {violation}")
    elif not result.ok:
        click.echo(f"  replay: {result.replay_command()}")
        if result.error:
            click.echo(f"  simulation error: {result.error}")
        for violation in result.violations[:20]:
            click.echo(f"  {violation}")
        if len(result.violations) > 20:
            click.echo(f"  ... and {len(result.violations) - 20} more violations")
        if not show_trace and result.excerpt:
            click.echo("  trace around the first violation (seconds since the start):")
            for line in result.excerpt.splitlines():
                click.echo(f"    {line}")
    if show_trace:
        click.echo(result.trace_text)
    if verbose:
        hit = ", ".join(f"{name} {count}" for name, count in sorted(result.point_hits.items()))
        click.echo(f"    protocol points hit: {hit or 'none'}")
        if result.throughput is not None:
            click.echo(
                f"    fault-free throughput: {result.throughput:.2f} of the offered rate "
                f"(floor {result.config.liveness.throughput_floor:.2f})"
            )
    click.echo(f"    trace digest {result.digest}" if verbose else "", nl=verbose)


def _failed(result: SeedResult, allow_known: bool) -> bool:
    return not result.ok and not (allow_known and _known(result) is not None)


def _run(config: SimConfig, keep_trace: bool) -> SeedResult:
    return run_seed(config, keep_trace=keep_trace)


def _configs(
    base: SimConfig, first: int, last: int | None, pinned: set[str]
) -> Iterator[SimConfig]:
    seeds = itertools.count(first) if last is None else iter(range(first, last + 1))
    for seed in seeds:
        yield mixed(dataclasses.replace(base, seed=seed), pinned)


@click.command("simulate")
@click.option("--seed", type=int, default=None, help="Run this seed (default 0).")
@click.option(
    "--seeds", default=None, help="Run the seeds A..B (inclusive), or A.. until --budget."
)
@click.option(
    "--duration",
    type=float,
    default=SimConfig.duration,
    show_default=True,
    help="Simulated seconds per seed (faults, then a quiet phase that checks liveness).",
)
@click.option(
    "--faults",
    type=click.Choice(sorted(PROFILES)),
    default=SimConfig.faults,
    show_default=True,
    help="Fault profile (docs/simulation.md lists what each injects).",
)
@click.option(
    "--workload",
    type=click.Choice(sorted(WORKLOADS)),
    default=SimConfig.workload,
    show_default=True,
    help="What the clients do.",
)
@click.option("--clients", type=click.IntRange(1, 64), default=SimConfig.clients, show_default=True)
@click.option("--servers", type=click.IntRange(1, 16), default=SimConfig.servers, show_default=True)
@click.option(
    "--storage-nodes",
    type=click.IntRange(1, 15),
    default=None,
    help=f"Storage nodes (and replicas of each partition). Default: chosen by the seed, "
    f"{FIVE_NODES_SHARE:.0%} of the seeds 5, the others 3.",
)
@click.option(
    "--partitions", type=click.IntRange(1, 64), default=SimConfig.partitions, show_default=True
)
@click.option(
    "--storage-engine",
    default=SimConfig.storage_engine,
    show_default=True,
    help="The storage nodes' engine: sim (a model of the disk) or fs (the real fs engine, "
    "its files on simulated disks).",
)
@click.option(
    "--lock-table",
    default=None,
    help=f"The servers' lock table. Default: chosen by the seed, {EXACT_SHARE:.0%} of the "
    "seeds exact (lock failures then checked for an exact reason), the others hwm-array.",
)
@click.option(
    "--callbacks",
    type=click.Choice(["async", "plain"]),
    default=None,
    help=f"The clients' callbacks: async (async def) or plain (synchronous, on the "
    f"client's callback thread). Default: chosen by the seed, {PLAIN_SHARE:.0%} plain.",
)
@click.option(
    "--membership",
    type=click.Choice(["none", "replace"]),
    default=None,
    help=f"replace: a spare storage node replaces a replica during the run (added, then "
    f"another removed, maybe put back). Default: chosen by the seed, {REPLACE_SHARE:.0%} "
    "replace.",
)
@click.option(
    "--archive",
    type=click.Choice(["none", "on"]),
    default=None,
    help=f"on: the servers archive to a simulated object store (ranges, the mark, reads "
    f"below it, pruning with --storage-engine fs). Default: chosen by the seed, "
    f"{ARCHIVE_SHARE:.0%} on.",
)
@click.option(
    "--acl",
    type=click.Choice(["none", "on"]),
    default=None,
    help=f"on: the ACL is enforced and one client may write only partition 0. Default: "
    f"chosen by the seed, {ACL_SHARE:.0%} on.",
)
@click.option(
    "--budget",
    type=float,
    default=None,
    help=f"Wall-clock seconds to keep running seeds (default {DEFAULT_BUDGET:.0f} for A..).",
)
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Seeds run in parallel, one process each.",
)
@click.option("--trace", "show_trace", is_flag=True, help="Print the whole trace of each seed.")
@click.option(
    "--trace-level",
    type=click.Choice(["debug", "info", "warning"]),
    default="info",
    show_default=True,
    help="Which component logs go into the trace.",
)
@click.option(
    "--allow-known",
    is_flag=True,
    help="Count a seed whose only violations are those of a known open issue "
    "(waltz_sim.known_issues) as passed; it is still reported.",
)
@click.option("--stop-on-failure", is_flag=True, help="Stop at the first failing seed.")
@click.option(
    "-v", "--verbose", is_flag=True, help="Print the faults and trace digest of every seed."
)
def simulate(  # noqa: PLR0917 - click passes options by name
    seed: int | None,
    seeds: str | None,
    duration: float,
    faults: str,
    workload: str,
    clients: int,
    servers: int,
    storage_nodes: int | None,
    partitions: int,
    storage_engine: str,
    lock_table: str | None,
    callbacks: str | None,
    membership: str | None,
    archive: str | None,
    acl: str | None,
    budget: float | None,
    jobs: int,
    show_trace: bool,
    trace_level: str,
    allow_known: bool,
    stop_on_failure: bool,
    verbose: bool,
) -> None:
    """Deterministic simulation of the whole cluster on virtual time.

    The real server, storage node and client run in one event loop; the network,
    the disks and the coordination service are simulated, with faults chosen by
    the seed. Each seed's history is checked against the safety and liveness
    invariants; the same seed replays the same run, event for event.
    """
    first, last = parse_seeds(seed, seeds)
    if duration < 20:
        raise click.UsageError("--duration must be at least 20 simulated seconds")
    if last is None and budget is None:
        budget = DEFAULT_BUDGET
    given = {
        "lock_table": lock_table,
        "storage_nodes": storage_nodes,
        "callbacks": callbacks,
        "membership": membership,
        "archive": archive,
        "acl": acl,
    }
    base = SimConfig(
        duration=duration,
        faults=faults,
        workload=workload,
        clients=clients,
        servers=servers,
        partitions=partitions,
        storage_engine=storage_engine,
        storage_nodes=storage_nodes or SimConfig.storage_nodes,
        lock_table=lock_table or SimConfig.lock_table,
        callbacks=callbacks or SimConfig.callbacks,
        membership=membership or SimConfig.membership,
        archive=archive or SimConfig.archive,
        acl=acl or SimConfig.acl,
        trace_level=getattr(logging, trace_level.upper()),
    )
    started = time.perf_counter()
    results: list[SeedResult] = []
    failed: list[SeedResult] = []
    configs = _configs(base, first, last, {k for k, v in given.items() if v is not None})

    def out_of_time() -> bool:
        return budget is not None and time.perf_counter() - started >= budget

    if jobs == 1:
        for config in configs:
            if results and out_of_time():
                break
            result = _run(config, show_trace)
            results.append(result)
            _report(result, verbose=verbose, show_trace=show_trace)
            if _failed(result, allow_known):
                failed.append(result)
                if stop_on_failure:
                    break
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            pending: dict[concurrent.futures.Future[SeedResult], int] = {}
            stop = False
            while True:
                while (
                    not stop
                    and len(pending) < jobs * 2
                    and not (out_of_time() and (results or pending))
                ):
                    upcoming = next(configs, None)
                    if upcoming is None:
                        break
                    pending[pool.submit(_run, upcoming, show_trace)] = upcoming.seed
                if not pending:
                    break
                done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                for future in sorted(done, key=lambda f: pending[f]):
                    del pending[future]
                    result = future.result()
                    results.append(result)
                    _report(result, verbose=verbose, show_trace=show_trace)
                    if _failed(result, allow_known):
                        failed.append(result)
                        stop = stop or stop_on_failure
                if out_of_time():
                    stop = True
    wall = time.perf_counter() - started
    simulated = sum(r.sim_seconds for r in results)
    cpu = sum(r.cpu_seconds for r in results)
    injected = sum(r.faults for r in results)
    known: dict[str, list[int]] = {}
    for result in results:
        issue = _known(result)
        if issue is not None:
            known.setdefault(issue.id, []).append(result.seed)
    passed = sum(1 for r in results if r.ok)
    known_text = "".join(
        f", {len(seeds)} with known issue {issue} ({' '.join(map(str, sorted(seeds)))})"
        for issue, seeds in sorted(known.items())
    )
    click.echo(
        f"{len(results)} seeds, {passed} passed{known_text}, {len(failed)} failed; "
        f"{injected} faults injected ({injected / max(len(results), 1):.1f} per seed); "
        f"{simulated:.0f} s simulated in {wall:.1f} s wall "
        f"({simulated / wall if wall else 0:.0f}x, {jobs} job{'s' if jobs > 1 else ''}) and "
        f"{cpu:.1f} CPU s ({simulated / cpu if cpu else 0:.0f}x)"
    )
    if verbose and len(results) > 1:
        for line in coverage_table([r.point_hits for r in results]):
            click.echo(line)
    if failed:
        click.echo(
            "failed seeds: " + " ".join(str(r.seed) for r in sorted(failed, key=lambda r: r.seed))
        )
        sys.exit(1)


def main() -> None:  # pragma: no cover - ``python -m waltz_sim``
    simulate(prog_name="python -m waltz_sim")


__all__ = ["main", "parse_seeds", "simulate"]
