"""`tox -e upgrade`: a live cluster upgraded from the previous release to this checkout,
one process at a time, under the bank workload, and checked by the simulation's checker
(issue 32; docs/operators.md, "Upgrading").

The previous release is the newest one CHANGELOG.md records, built from the commit it
names into a venv of its own (release.py; cached under .tox by commit). Then, on real
processes (mixed.py): a real ZooKeeper; the metadata written by the old release's
``waltz cluster create``; 3 ``fs`` storage nodes and 2 servers started by the old
release's ``waltz``; three bank clients (real ``waltz_client`` s in processes of their
own): two of the old release, one of this checkout. Then:

1. storage nodes, one at a time: stopped by pid (SIGTERM), data kept, started from the
   new venv; the next one only once this one has caught up (``/readyz`` 200 and it
   holds the committed high-water mark);
2. servers, one at a time (their partitions move to the other and back);
3. the old clients, one at a time (SIGTERM: each drains and catches up; the new
   incarnation goes on from the same database);
4. one server rolled back to the old release and forward again: it must work (a
   server holds nothing durable); one storage node rolled back: it works (it catches up
   and the cluster commits with it) or it is refused in one line naming the format
   versions, exits non-zero and leaves its data as it was; then it runs the new release
   again;
5. the feature level raised (``waltz cluster features --raise``) to the top level this
   release knows: every storage node migrates to its format (at level 3 the fs node
   journal), and the old release is then refused in one line;
6. the clients drain, the cluster is read back, the checker judges the history: nothing
   lost or duplicated, every op answered within its deadline. The longest gap in
   commits during the upgrade and the phases' times are printed.

Adjacent versions interoperate both ways: the new client commits against old servers
(before step 2) and the old clients against new servers (between steps 2 and 3), both
asserted from the history.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mixed import (
    HarnessError,
    Member,
    MixedCluster,
    Version,
    commit_times,
    digest,
    longest_gap,
    this_venv,
    until,
)
from release import REPO, latest_release, release_venv

from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_server.server.testing import READY_MARKER as SERVER_READY
from waltz_sim.checker import OK, LivenessBounds
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.journal import JOURNAL_FILE_NAME
from waltz_storage_node.testing import READY_MARKER as STORAGE_READY

CACHE = Path(os.environ.get("WALTZ_UPGRADE_CACHE", REPO / ".tox" / "upgrade-releases"))

GAP_GOAL = 2.0
"""Seconds: the goal for the longest wait for a commit during the upgrade (printed)."""
GAP_LIMIT = 10.0
"""Seconds: far over the goal; the run fails."""
BOUNDS = LivenessBounds(decision_deadline=20.0, commit_bound=10.0)
"""Each op is decided within its transaction timeout (15 s) and the wait for an answer."""


@pytest.fixture(scope="module")
def old_release() -> Version:
    release = latest_release((REPO / "CHANGELOG.md").read_text())
    started = time.monotonic()
    venv, built = release_venv(release, CACHE)
    print(
        f"\nprevious release {release.label}: venv {venv} "
        f"({'built' if built else 'cached'} in {time.monotonic() - started:.1f} s)"
    )
    return Version(release.label, venv / "bin")


@pytest.fixture
async def cluster(tmp_path: Path, old_release: Version) -> AsyncIterator[MixedCluster]:
    new = this_venv()
    cluster = MixedCluster(tmp_path, old_release, [old_release, old_release, new])
    try:
        yield cluster
    finally:
        await cluster.close()
        cluster.stop_all()


@dataclass
class Rollback:
    outcome: str
    """``works`` or ``refused``."""
    line: str = ""
    """The refusal (one line)."""


def refusal(output: str) -> str:
    """The one line a process that refused to start ended with (its last line), or a
    :class:`HarnessError` when it said more (a traceback) or named no version."""
    if "Traceback" in output:
        raise HarnessError(f"refused with a traceback, not one clear line:\n{output[-3000:]}")
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        raise HarnessError("the process exited without a word")
    line = lines[-1]
    if not re.search(r"version \d", line):
        raise HarnessError(f"the refusal names no version: {line!r}")
    return line


async def roll_back(cluster: MixedCluster, member: Member, old: Version, new: Version) -> Rollback:
    """``member`` rolled back to ``old``: it works (it serves; a storage node catches up;
    the cluster commits with it) or it exits non-zero with one line naming the versions,
    its data left as it was. Either way it runs ``new`` again at the end."""
    cluster.phase(f"{member.name}: rolled back to {old.label}")
    code = await cluster.stop_member(member)
    assert code == 0, f"{member.name} exited {code} on SIGTERM:\n{member.tail()}"
    before = {} if member.data_dir is None else digest(member.data_dir)
    member.version = old
    await cluster.start_member(member, wait=False)
    ready = STORAGE_READY if member.kind == "storage" else SERVER_READY

    async def decided() -> bool:
        return not member.running or ready in member.this_run()

    await until(decided, 60.0, lambda: f"{member.name} neither served nor exited")
    if not member.running:
        result = Rollback("refused", refusal(member.this_run()))
        assert member.child.returncode != 0, "refused, yet exited 0"
        if member.data_dir is not None:
            assert digest(member.data_dir) == before, "the refused release changed the data"
        member.version = new
        cluster.phase(f"{member.name}: back to {new.label}")
        await cluster.start_member(member)
    else:
        since = time.monotonic()
        await cluster.wait_serving(member)
        if member.kind == "storage":
            await cluster.caught_up(member)
        await cluster.commits(since)
        result = Rollback("works")
        await cluster.restart(member, new)
    if member.kind == "storage":
        await cluster.caught_up(member)
    await cluster.commits(time.monotonic())
    return result


async def raise_level_then_roll_back(
    cluster: MixedCluster, member: Member, old: Version, new: Version
) -> Rollback:
    """Step 5: every process runs the new release; the operator
    raises the feature level (``waltz cluster features --raise``); the storage node,
    restarted under the raised level, writes the new format, and the old release is then
    refused in one line."""
    cluster.phase("feature level raised")
    before = await cluster.waltz(new, "cluster", "features", "--coordination", cluster.uri)
    await cluster.waltz(new, "cluster", "features", "--raise", "--coordination", cluster.uri)
    after = await cluster.waltz(new, "cluster", "features", "--coordination", cluster.uri)
    print(f"feature level before:\n{before}after --raise:\n{after}")
    # raised to the top level this release knows (at 3: the fs node journal)
    assert f"cluster feature level: {MAX_FEATURE_LEVEL} " in after, after
    since = time.monotonic()
    await cluster.restart(member, new)
    await cluster.caught_up(member)
    await cluster.commits(since)
    for node in cluster.of_kind("storage"):
        assert node.data_dir is not None
        written = tools.read_control_file(node.data_dir).header.version
        assert written == fmt.FORMAT_OF_LEVEL[MAX_FEATURE_LEVEL], (node.name, written)
        if written >= fmt.JOURNAL_CONTROL_VERSION:  # the node journal in use
            assert (node.data_dir / JOURNAL_FILE_NAME).stat().st_size > 0, node.name
    return await roll_back(cluster, member, old, new)


@pytest.mark.system
@pytest.mark.timeout(900)
async def test_rolling_upgrade_under_load(cluster: MixedCluster, old_release: Version) -> None:
    old, new = old_release, this_venv()
    # main carries the next development version (CONTRIBUTING.md, "Releases")
    assert old.label.split()[0] != new.label.split()[0], (old.label, new.label)
    print(f"run directory (logs, configs, data, client databases): {cluster.run_dir}")
    cluster.phase(f"start: ZooKeeper, 3 storage nodes and 2 servers of {old.label}, 3 clients")
    await cluster.start()
    cluster.phase("warm-up")
    await cluster.commits(cluster.phases[-1].start, count=5)

    upgrade_start = time.monotonic()
    for member in cluster.of_kind("storage"):
        await cluster.restart(member, new)
        await cluster.caught_up(member)
        await cluster.commits(time.monotonic())
    servers_start = time.monotonic()
    for member in cluster.of_kind("server"):
        await cluster.restart(member, new)
        await cluster.commits(time.monotonic())
    servers_done = time.monotonic()
    cluster.phase(f"old clients on {new.label} servers")
    await cluster.commits(servers_done)
    client_steps: dict[str, float] = {}
    for member in cluster.of_kind("client"):
        if member.version != new:
            step = await cluster.restart(member, new)
            client_steps[member.name] = step.start
            await cluster.commits(time.monotonic())
    upgrade_end = time.monotonic()

    server_rollback = await roll_back(cluster, cluster.of_kind("server")[0], old, new)
    storage = cluster.of_kind("storage")[0]
    rollback = await roll_back(cluster, storage, old, new)
    raised = await raise_level_then_roll_back(cluster, storage, old, new)

    cluster.phase("drain, read back, check")
    result, records = await cluster.finish(BOUNDS)
    cluster.end_phase()

    times = commit_times(records)
    gap, gap_at = longest_gap(times, upgrade_start, upgrade_end)
    in_phase = next((p.name for p in cluster.phases if p.start <= gap_at < (p.end or 1e18)), "")
    print(f"\nrolling upgrade {old.label} -> {new.label}: phases")
    for phase in cluster.phases:
        gap_here, _ = longest_gap(times, phase.start, phase.end or phase.start)
        print(f"  {phase.seconds:6.1f} s  {phase.name} (longest commit gap {gap_here:.2f} s)")
    print(
        f"longest gap in commits during the upgrade: {gap:.2f} s, from "
        f"{gap_at - upgrade_start:.1f} s in ({in_phase}); goal {GAP_GOAL:g} s"
        + ("" if gap <= GAP_GOAL else " -- OVER THE GOAL")
    )
    print(f"ops: {result.outcomes}; committed per partition: {result.committed}")
    print(f"rollback of server-0 to {old.label}: {server_rollback.outcome}")
    print(f"rollback of {storage.name} to {old.label}: {rollback.outcome} {rollback.line}")
    print(f"after the feature level raise: {raised.outcome} {raised.line}")

    assert result.ok, "the checker found:\n" + "\n".join(str(v) for v in result.violations)
    assert sum(result.committed.values()) > 0
    # adjacent versions, both ways, as the history shows them
    newcomer = cluster.members["client-2"]
    assert newcomer.versions[0][1] == new.label
    early = [op for op in records["client-2"].ops if op.kind == OK and op.time < servers_start]
    assert early, f"the {new.label} client committed nothing against {old.label} servers"
    for name, upgraded_at in client_steps.items():
        late = [
            op for op in records[name].ops if op.kind == OK and servers_done < op.time < upgraded_at
        ]
        assert late, f"{name} ({old.label}) committed nothing against {new.label} servers"
    # a server holds nothing durable: before the raise it always goes back
    assert server_rollback.outcome == "works", server_rollback.line
    assert gap <= GAP_LIMIT, f"a {gap:.1f} s gap in commits during the upgrade ({in_phase})"
    # before the raise the cluster's level allows the old formats: the old release works;
    # after it, the old release is refused in one line naming the versions
    assert rollback.outcome == "works", rollback.line
    assert raised.outcome == "refused", "the old release opened storage of a raised level"
    assert re.search(r"version \d+ .*\(\d+(, \d+)*\)", raised.line), raised.line
