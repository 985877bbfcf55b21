"""Mutation testing of the safety core with cosmic-ray: the score and the survivors.

cosmic-ray mutates a module's file in place, one mutation at a time, and runs a test
command; the editable installs of this monorepo import the mutated file, so the unit
tests and ``waltz simulate`` both see the mutant. A mutant is *killed* when the
command fails (or times out), *survives* when it passes. Per mutant the command runs
the module's fast unit tests in one pytest process with ``-x`` and ``--ff`` (the tests
that target the module first, and before them those that killed earlier mutants, so
a killed mutant stops early), then the simulation seeds that run the module's code:
20 of the ``points`` fault profile and 20 of ``standard`` for the server's and the
storage node's modules, 20 ``chaos`` and 20 ``standard`` on the real fs engine for
the fs engine's (``--stop-on-failure``, two seeds at a time).

    .venv/bin/python bench/mutation.py run [MODULE ...]    # init + exec + report
    .venv/bin/python bench/mutation.py run MODULE --sample 40 --sample-seed 1
    .venv/bin/python bench/mutation.py run MODULE --changed-since REV  # or --lines 120-180,300
    .venv/bin/python bench/mutation.py report [MODULE ...] # the score and survivors
    .venv/bin/python bench/mutation.py stages [MODULE ...] # which stage killed, its cost
    .venv/bin/python bench/mutation.py test MODULE          # the per-mutant command

MODULE is one of the keys of ``MODULES`` (default: all, in priority order). The
sessions live in ``.mutation/`` (ignored by git); ``run`` resumes a session that an
interrupted run left (``--fresh`` starts over; ``--retest`` tests the survivors again,
after new tests). ``--sample N`` runs the mutants one by one in an order shuffled by
``--sample-seed``, up to N: stopped at any point, the mutants run are a uniform random
sample, and ``report`` gives the score as such, with its 95% interval (a sample, not
a full run); a run without ``--sample`` then resumes the full run. ``--lines`` (or
``--changed-since REV``: the lines that ``git diff REV HEAD`` changed or added) runs
only the mutants that start on those lines, the others excluded like a sample's, and
``report`` says so (a run without either resumes the full run). The operators are
cosmic-ray's, less those ``EXCLUDED_OPERATORS`` names (docs/simulation.md, "Mutation
score", says why). Slow (hours for every module on a loaded machine): ``tox -e
mutate`` runs it, and no CI run does. It refuses to start when a target module
differs from git's HEAD (a mutant left behind by a killed run: ``git checkout --
FILE``).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = ROOT / ".mutation"
VENV_BIN = Path(sys.executable).parent
SERVER_TESTS = "packages/waltz-server/tests/server"
FS_TESTS = "packages/waltz-storage-fs/tests"
"""Per mutant of the fs engine's recovery, its test files but ``test_power_loss.py``:
its crash-state sweeps take over 5 min at a load average of 13 (every other file
together about 3.5 min, ``test_engine.py`` 2.2 of them); the fs seeds crash and tear
writes on every run instead."""
SEEDS = "0..19"
SIMULATION_TIMEOUT = 360.0
"""Seconds for one stage of 20 seeds (about 15 s on an idle machine, under 2 min at a
load average of 24): past it the mutant hangs a seed (an endless loop), killed."""


UNIT_TEST_TIMEOUT = 600.0
"""Seconds for the pytest stage (the server's unit tests take under 2 min at a load
average of 13): past it the mutant hangs the tests, killed. pytest-timeout's alarm
cannot stop a mutant that spins the event loop without yielding (``store_session.py``
707, ``not not inflight[0][1].done()``: its writers loop without an ``await``); that
one ran 11.5 min until it was stopped by hand."""


SIM_SEEDS = (("--faults", "points"), ("--faults", "standard"))
"""The simulation's runs for the modules of the server and the storage node: 20 seeds
of each fault profile, on the simulation's model of the disk."""
NODE_SEEDS = (("--faults", "storage"), *SIM_SEEDS)
"""For the storage node's partition handling: first 20 seeds of the ``storage`` fault
profile (damaged and wiped disks, repairs, replicas marked suspect then clean), whose
seed 5 kills a mutant swapping the suspect and clean marks that 20 ``points`` and 20
``standard`` seeds let through."""
FS_SEEDS = (
    ("--storage-engine", "fs", "--faults", "chaos"),
    ("--storage-engine", "fs", "--faults", "standard"),
)
"""For the fs engine's modules: 20 seeds of each profile on the real fs engine (its
files on the simulated disks, which crash, tear writes and lose unsynced data)."""
FS_JOURNAL_SEEDS = (
    ("--storage-engine", "fs", "--faults", "points", "--seeds", "7"),
    ("--storage-engine", "fs", "--faults", "standard", "--seeds", "19"),
    *FS_SEEDS,
)
"""For the node journal: first the two fs seeds that found bugs in its ring (a
checkpoint at the ring's end, a wrapped writer wrapping again:
``FS_REGRESSIONS`` in ``packages/waltz-sim/tests/seeds/test_regressions.py``; a small
journal, which wraps, is one disk in four), one seed each (a later ``--seeds`` wins
over :data:`SEEDS`), then the fs engine's 40."""


@dataclass(frozen=True)
class Module:
    path: str
    first: tuple[str, ...]
    """The test files that target the module, run first."""
    then: tuple[str, ...]
    """The rest of the unit tests that cover it (directories or files)."""
    simulations: tuple[tuple[str, ...], ...]
    """The ``waltz simulate`` runs (their options) that run this module's code, in
    the order they run (each stops at its first failing seed)."""
    tunables: tuple[str, ...] = ()
    """Tunable defaults (sizes, counts), not mutated: a class name stands for its body,
    ``Class.method`` for the default values of the method's parameters, a module-level
    name for the value assigned to it."""


MODULES: dict[str, Module] = {
    "voting": Module(
        "packages/waltz-server/src/waltz_server/server/voting.py",
        (f"{SERVER_TESTS}/test_voting.py", f"{SERVER_TESTS}/test_recovery_cases.py"),
        (SERVER_TESTS,),
        simulations=SIM_SEEDS,
    ),
    "replication": Module(
        "packages/waltz-server/src/waltz_server/server/replication.py",
        (f"{SERVER_TESTS}/test_replication.py", f"{SERVER_TESTS}/test_store.py"),
        (SERVER_TESTS,),
        simulations=SIM_SEEDS,
        tunables=("ReplicationLimits",),
    ),
    "recovery": Module(
        "packages/waltz-server/src/waltz_server/server/recovery.py",
        (f"{SERVER_TESTS}/test_recovery_cases.py", f"{SERVER_TESTS}/test_store.py"),
        (SERVER_TESTS,),
        simulations=SIM_SEEDS,
        tunables=("RecoveryManager.__init__",),
    ),
    "store_session": Module(
        "packages/waltz-server/src/waltz_server/server/store_session.py",
        # every file that drives a StoreSession, test_store.py (9 s of the 13 s of the
        # server's unit tests) first, the others under 0.6 s each: the rejoin, repair,
        # archive, read and drain paths test_store.py does not reach, and the replies
        # counted in callbacks (run to completion)
        (
            f"{SERVER_TESTS}/test_store.py",
            f"{SERVER_TESTS}/test_store_session_paths.py",
            f"{SERVER_TESTS}/test_store_session_callbacks.py",
            f"{SERVER_TESTS}/test_partition.py",
            f"{SERVER_TESTS}/test_repair.py",
            f"{SERVER_TESTS}/test_archive_store.py",
            f"{SERVER_TESTS}/test_range_read.py",
            f"{SERVER_TESTS}/test_store_storage_nodes.py",
        ),
        (SERVER_TESTS,),
        simulations=SIM_SEEDS,
    ),
    "partition": Module(
        "packages/waltz-storage-node/src/waltz_storage_node/partition.py",
        (
            "packages/waltz-storage-node/tests/test_partition_worker.py",
            "packages/waltz-storage-node/tests/test_run_to_completion.py",
            "packages/waltz-storage-node/tests/test_storage_node.py",
        ),
        (
            "packages/waltz-storage-node/tests/test_storage_scrub.py",
            f"{SERVER_TESTS}/test_store_storage_nodes.py",
            f"{SERVER_TESTS}/test_archive_store.py",
        ),
        simulations=NODE_SEEDS,
        tunables=("PartitionWorker.__init__",),
    ),
    "fs_recovery": Module(
        "packages/waltz-storage-fs/src/waltz_storage_fs/recovery.py",
        tuple(
            f"{FS_TESTS}/{name}.py"
            for name in (
                "test_recovery_edges",
                "test_recovery",
                "test_acked_end",
                "test_format_log_start",
                "test_scrub",
            )
        ),
        tuple(
            f"{FS_TESTS}/{name}.py"
            for name in (
                "test_journaled",
                "test_journal",
                "test_format_compat",
                "test_feature_levels",
                "test_format_v3",
                "test_pipeline",
                "test_runner",
                "test_tools",
                "test_engine",
            )
        ),
        simulations=FS_SEEDS,
    ),
    "fs_journal": Module(
        "packages/waltz-storage-fs/src/waltz_storage_fs/journal.py",
        # the files that drive the journal (about 15 s together; each killed mutant of
        # the first sample fell in 1 to 6 s), then the journal cases of the crash-state
        # sweeps (2.5 s: not the whole of test_power_loss.py)
        (
            *(
                f"{FS_TESTS}/{name}.py"
                for name in (
                    "test_journal_edges",
                    "test_journal",
                    "test_journaled",
                    "test_journal_bypass",
                    "test_committer_handover",
                )
            ),
            f"{FS_TESTS}/test_power_loss.py::test_power_loss_at_every_step_of_a_workload[journal]",
            f"{FS_TESTS}/test_acked_end.py::test_a_crash_after_a_truncation_is_no_lost_tail[journal]",
        ),
        tuple(
            f"{FS_TESTS}/{name}.py"
            for name in (
                "test_acked_end",
                "test_feature_levels",
                "test_recovery",
                "test_recovery_edges",
                "test_format_compat",
                "test_format_v3",
                "test_format_log_start",
                "test_pipeline",
                "test_runner",
                "test_tools",
                "test_scrub",
                "test_engine",
            )
        ),
        simulations=FS_JOURNAL_SEEDS,
        tunables=("_ZERO_CHUNK",),
    ),
}

_ORDERINGS = ("Lt", "LtE", "Gt", "GtE")
_KEPT_COMPARISONS = {
    # per ordering: the boundary moved by one, and the negation
    ("Lt", "LtE"), ("Lt", "GtE"),
    ("LtE", "Lt"), ("LtE", "Gt"),
    ("Gt", "GtE"), ("Gt", "LtE"),
    ("GtE", "Gt"), ("GtE", "Lt"),
    ("Eq", "NotEq"), ("NotEq", "Eq"),
    ("Is", "IsNot"), ("IsNot", "Is"),
}  # fmt: skip
_COMPARISONS = (*_ORDERINGS, "Eq", "NotEq", "Is", "IsNot")
_KEPT_BINARY = {
    ("Add", "Sub"), ("Sub", "Add"), ("Mul", "FloorDiv"), ("FloorDiv", "Mul"),
    ("Div", "Mul"), ("Mod", "FloorDiv"), ("Pow", "Mul"), ("LShift", "RShift"),
    ("RShift", "LShift"), ("BitOr", "BitAnd"), ("BitAnd", "BitOr"), ("BitXor", "BitOr"),
}  # fmt: skip
_BINARY: tuple[str, ...] = ("Add", "Sub", "Mul", "Div", "FloorDiv", "Mod", "Pow")
_BINARY += ("RShift", "LShift", "BitOr", "BitAnd", "BitXor")
EXCLUDED_OPERATORS: tuple[str, ...] = tuple(
    [
        f"core/ReplaceComparisonOperator_{a}_{b}$"
        for a in _COMPARISONS
        for b in _COMPARISONS
        if a != b and (a, b) not in _KEPT_COMPARISONS
    ]
    + [
        f"core/ReplaceBinaryOperator_{a}_{b}$"
        for a in _BINARY
        for b in _BINARY
        if a != b and (a, b) not in _KEPT_BINARY
    ]
)
"""Mutations left out: a comparison becomes only its negation or its boundary moved
by one (``<`` into ``>=`` and ``<=``; ``==`` into ``!=``; ``is`` into ``is not``), an
arithmetic operator only its inverse. The others are redundant with those, or
equivalent (``==`` into ``is`` on small ints and enums), or trivially killed by a
``TypeError``; each costs a whole test run."""


def _config(name: str, module: Module, timeout: float) -> str:
    command = f"{sys.executable} {Path(__file__).resolve()} test {name}"
    excluded = ", ".join(json.dumps(pattern) for pattern in EXCLUDED_OPERATORS)
    return (
        "[cosmic-ray]\n"
        f'module-path = "{module.path}"\n'
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
        f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [{excluded}]\n"
    )


def _exclude_static(session: Path, module: Module) -> None:
    """Mark as excluded (cosmic-ray's *skipped*) the mutants in annotations, of tunable
    defaults (any positive size is correct) and of ``@dataclass(frozen=..., slots=...)``
    flags, which strict mypy checks (an assignment to a frozen field, an attribute
    outside the slots) and which no running code can observe. Overwrites a result
    already there, so that a resumed session counts as a fresh one."""
    source = (ROOT / module.path).read_text()
    lines = source.splitlines()
    annotations = _annotation_spans(source)
    defaults = _default_spans(source, module.tunables)
    flags = ("core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue")
    with closing(sqlite3.connect(session)) as db, db:
        rows = db.execute(
            "SELECT job_id, operator_name, start_pos_row, start_pos_col, definition_name"
            " FROM mutation_specs WHERE job_id NOT IN (SELECT job_id FROM work_results"
            " WHERE worker_outcome = 'SKIPPED' AND output = 'Filtered operator')"
        ).fetchall()
        for job_id, operator, row, col, definition in rows:
            if any(start <= (row, col) < end for start, end in annotations):
                reason = "Excluded: an annotation (never evaluated)"
            elif definition in module.tunables or any(
                start <= (row, col) < end for start, end in defaults
            ):
                reason = "Excluded: a tunable default"
            elif operator in flags and lines[row - 1].lstrip().startswith("@dataclass("):
                reason = "Excluded: a dataclass flag (checked by mypy)"
            else:
                continue
            db.execute(
                "INSERT OR REPLACE INTO work_results (worker_outcome, output, test_outcome,"
                " diff, job_id) VALUES ('SKIPPED', ?, NULL, NULL, ?)",
                (reason, job_id),
            )


SAMPLE_REASON = "Excluded: not in the sample"


def _sample(session: Path, size: int | None, seed: int) -> None:
    """Leave only the first ``size`` mutants of a seeded order to run, the others marked
    excluded (``SAMPLE_REASON``) until a run without ``--sample``, which makes them
    pending again (the full run resumes). The order: every mutant of the session in
    source order (the job ids are random per init), shuffled by ``seed``, less those
    excluded otherwise (operators, annotations, tunables); so a larger ``size`` with
    the same seed extends a smaller one, and a change in the static exclusions keeps
    the order of the others."""
    with closing(sqlite3.connect(session)) as db, db:
        db.execute(
            "DELETE FROM work_results WHERE worker_outcome = 'SKIPPED' AND output LIKE ?",
            (SAMPLE_REASON + "%",),
        )
        if size is None:
            return
        rows = db.execute(
            "SELECT s.job_id, r.worker_outcome FROM mutation_specs s LEFT JOIN work_results r"
            " ON r.job_id = s.job_id"
            " ORDER BY s.start_pos_row, s.start_pos_col, s.operator_name, s.occurrence"
        ).fetchall()
        random.Random(seed).shuffle(rows)
        order = [job_id for job_id, outcome in rows if outcome != "SKIPPED"]
        pending = {job_id for job_id, outcome in rows if outcome is None}
        reason = f"{SAMPLE_REASON} (seed {seed}, of {len(order)} mutants)"
        # a mutant already run keeps its result (a resumed or a retested sample)
        for job_id in (job_id for job_id in order[size:] if job_id in pending):
            db.execute(
                "INSERT OR REPLACE INTO work_results (worker_outcome, output, test_outcome,"
                " diff, job_id) VALUES ('SKIPPED', ?, NULL, NULL, ?)",
                (reason, job_id),
            )


LINES_REASON = "Excluded: not on the lines run"


def _restrict(session: Path, lines: set[int] | None, described: str) -> None:
    """Leave only the mutants that start on ``lines`` to run, the others marked excluded
    (``LINES_REASON``) until a run without a restriction, which makes them pending again
    (a mutant already run keeps its result, and ``report`` counts it: in a session
    started with the restriction, such as a fresh one, it counts only those on the lines)."""
    with closing(sqlite3.connect(session)) as db, db:
        db.execute(
            "DELETE FROM work_results WHERE worker_outcome = 'SKIPPED' AND output LIKE ?",
            (LINES_REASON + "%",),
        )
        if lines is None:
            return
        rows = db.execute(
            "SELECT job_id, start_pos_row FROM mutation_specs WHERE job_id NOT IN"
            " (SELECT job_id FROM work_results)"
        ).fetchall()
        for job_id, row in rows:
            if row not in lines:
                db.execute(
                    "INSERT OR REPLACE INTO work_results (worker_outcome, output,"
                    " test_outcome, diff, job_id) VALUES ('SKIPPED', ?, NULL, NULL, ?)",
                    (f"{LINES_REASON} ({described})", job_id),
                )


def parse_lines(text: str) -> set[int]:
    """``120-180,300`` as the set of line numbers it names (ranges inclusive)."""
    lines: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        lines.update(range(int(first), int(last or first) + 1))
    return lines


def changed_lines(path: str, since: str) -> set[int]:
    """The lines of ``path`` at HEAD that ``git diff since HEAD`` changed or added (a
    hunk that only deletes has no line at HEAD, no mutant)."""
    diff = subprocess.run(
        ["git", "diff", "-U0", since, "HEAD", "--", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return hunk_lines(diff)


def hunk_lines(diff: str) -> set[int]:
    """The new side's lines of the hunks of a ``-U0`` diff."""
    lines: set[int] = set()
    for header in (line for line in diff.splitlines() if line.startswith("@@")):
        start, _, count = header.split()[2].lstrip("+").partition(",")
        lines.update(range(int(start), int(start) + int(count or 1)))
    return lines


def _pending(session: Path) -> int:
    with closing(sqlite3.connect(session)) as db:
        (count,) = db.execute(
            "SELECT COUNT(*) FROM mutation_specs WHERE job_id NOT IN"
            " (SELECT job_id FROM work_results)"
        ).fetchone()
    return int(count)


def _wilson(killed: int, counted: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a sampled kill ratio."""
    p = killed / counted
    centre = (p + z * z / (2 * counted)) / (1 + z * z / counted)
    half = z * math.sqrt(p * (1 - p) / counted + z * z / (4 * counted * counted))
    half /= 1 + z * z / counted
    return max(0.0, centre - half), min(1.0, centre + half)


def _default_spans(
    source: str, tunables: tuple[str, ...]
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the default values of the ``Class.method`` parameters named in
    ``tunables`` are, and the values of the module-level names in it, as ((row, col),
    (end row, end col))."""
    found: list[ast.expr] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in tunables for t in targets):
                found.append(node.value)
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            named = f"{node.name}.{getattr(item, 'name', '')}"
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and named in tunables:
                found += item.args.defaults
                found += [d for d in item.args.kw_defaults if d is not None]
    return [
        ((a.lineno, a.col_offset), (a.end_lineno or a.lineno, a.end_col_offset or 0)) for a in found
    ]


def _annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the type annotations are, as ((row, col), (end row, end col)): with
    ``from __future__ import annotations`` (every target module has it) Python never
    evaluates them, so a mutant there (``int | None`` into ``int & None``) is
    equivalent; mypy checks them."""
    tree = ast.parse(source)
    if not any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    ):
        return []
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            found.append(node.returns)
    return [
        ((a.lineno, a.col_offset), (a.end_lineno or a.lineno, a.end_col_offset or 0)) for a in found
    ]


def _check_clean(paths: list[str]) -> None:
    changed = subprocess.run(
        ["git", "diff", "--name-only", "HEAD", "--", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if changed:
        sys.exit(
            f"these modules differ from git's HEAD: {', '.join(changed)}; a mutant left by "
            "an interrupted run? restore them (git checkout -- FILE) or commit, then rerun"
        )


def _tool(name: str, *args: str) -> None:
    subprocess.run([str(VENV_BIN / name), *args], cwd=ROOT, check=True)


def _forget_survivors(session: Path) -> int:
    """Make the surviving mutants pending again (to test them against new tests)."""
    with closing(sqlite3.connect(session)) as db, db:
        return db.execute(
            "DELETE FROM work_results WHERE worker_outcome = 'NORMAL' AND test_outcome = 'SURVIVED'"
        ).rowcount


def run(
    names: list[str],
    fresh: bool,
    timeout: float,
    retest: bool,
    *,
    sample: int | None = None,
    sample_seed: int = 0,
    lines: str | None = None,
    changed_since: str | None = None,
) -> None:
    _check_clean([MODULES[name].path for name in names])
    SESSIONS.mkdir(exist_ok=True)
    for name in names:
        config, session = SESSIONS / f"{name}.toml", SESSIONS / f"{name}.sqlite"
        config.write_text(_config(name, MODULES[name], timeout))
        if fresh or not session.exists():
            session.unlink(missing_ok=True)
            _tool("cosmic-ray", "init", str(config), str(session))
            _tool("cr-filter-operators", str(session), str(config))
        _exclude_static(session, MODULES[name])
        if changed_since is not None:
            only = changed_lines(MODULES[name].path, changed_since)
            _restrict(session, only, f"the lines changed since {changed_since}")
        elif lines is not None:
            _restrict(session, parse_lines(lines), f"lines {lines}")
        else:
            _restrict(session, None, "")
        _sample(session, sample, sample_seed)
        if retest:
            print(f"{name}: {_forget_survivors(session)} surviving mutants to test again")
        started = time.monotonic()
        load = os.getloadavg()[0]
        print(f"{name}: running (load average {load:.1f})", flush=True)
        if sample is None:
            _tool("cosmic-ray", "exec", str(config), str(session))
        else:
            # one mutant per exec, in the sample's order: a run stopped at any point
            # leaves a prefix of the seeded order, itself a uniform random sample
            for size in range(1, sample + 1):
                _sample(session, size, sample_seed)
                if _pending(session):
                    _tool("cosmic-ray", "exec", str(config), str(session))
        _check_clean([MODULES[name].path])
        minutes = (time.monotonic() - started) / 60
        print(f"{name}: ran in {minutes:.1f} min (load average {os.getloadavg()[0]:.1f})")
    report(names)


def _test_files(module: Module) -> list[str]:
    """The module's test files, the ones that target it first, each once (a directory
    in ``then`` stands for its ``test_*.py`` files)."""
    files = [str(ROOT / path) for path in module.first]
    for entry in module.then:
        path = ROOT / entry
        for file in sorted(path.glob("test_*.py")) if path.is_dir() else [path]:
            if str(file) not in files:
                files.append(str(file))
    return files


def test(name: str) -> int:
    """The per-mutant command: 0 when every check passes (the mutant survives).

    One pytest process runs every test file (one start-up, not one per group) with
    ``--ff``: the tests that killed the previous mutants run first (its cache is the
    module's own, in ``.mutation/``), since neighbouring mutants tend to be killed by
    the same test; then the simulation runs. Each stage that ran, with its time and
    whether it killed the mutant, goes to ``.mutation/MODULE.stages.jsonl``."""
    module = MODULES[name]
    stages: list[dict[str, object]] = []

    def stage(label: str, argv: list[str], timeout: float | None = None) -> bool:
        """Run one stage; killed when it fails, or hangs past ``timeout`` (its whole
        process group is stopped then: a mutant that loops forever in a seed)."""
        started = time.monotonic()
        process = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
        try:
            killed = process.wait(timeout=timeout) != 0
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            killed = True
            label += " (hung: timed out)"
        stages.append({"stage": label, "s": round(time.monotonic() - started, 1), "killed": killed})
        return killed

    # --timeout: a mutant that loops forever fails its test after 60 s (the slowest test
    # takes 3 s on a loaded machine), not after the configured 300 s
    pytest = [str(VENV_BIN / "pytest"), "-x", "-q", "--ff", "--timeout=60"]
    pytest += ["-o", f"cache_dir={SESSIONS / ('pytest-cache-' + name)}"]
    killed = stage("pytest", [*pytest, *_test_files(module)], timeout=UNIT_TEST_TIMEOUT)
    for options in module.simulations if not killed else ():
        simulate = [str(VENV_BIN / "waltz"), "simulate", "--seeds", SEEDS, "-j", "2"]
        argv = [*simulate, *options, "--stop-on-failure"]
        if stage(" ".join(options), argv, timeout=SIMULATION_TIMEOUT):
            killed = True
            break
    with (SESSIONS / f"{name}.stages.jsonl").open("a") as log:
        log.write(json.dumps({"lines": _changed_lines(module), "stages": stages}) + "\n")
    return 1 if killed else 0


def _changed_lines(module: Module) -> list[int]:
    diff = subprocess.run(
        ["git", "diff", "-U0", "--", module.path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(h.split()[2].lstrip("+").split(",")[0]) for h in diff.splitlines() if h[:2] == "@@"]


def stages(names: list[str]) -> None:
    """Which stage killed the mutants and what each cost: the data to order them by."""
    for name in names:
        path = SESSIONS / f"{name}.stages.jsonl"
        if not path.exists():
            print(f"{name}: no stage log")
            continue
        runs = [json.loads(line) for line in path.read_text().splitlines() if line]
        kills: Counter[str] = Counter()
        seconds: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        for run_ in runs:
            for item in run_["stages"]:
                counts[item["stage"]] += 1
                seconds[item["stage"]] += item["s"]
                kills[item["stage"]] += item["killed"]
        survived = sum(not any(i["killed"] for i in r["stages"]) for r in runs)
        print(f"{name}: {len(runs)} mutants tested, {survived} passed every stage")
        for label in counts:
            mean = seconds[label] / counts[label]
            print(f"  {label}: ran {counts[label]}, killed {kills[label]}, mean {mean:.1f} s")


def report(names: list[str]) -> None:
    killed_total = counted_total = 0
    for name in names:
        session = SESSIONS / f"{name}.sqlite"
        if not session.exists():
            print(f"{name}: not run")
            continue
        dump = subprocess.run(
            [str(VENV_BIN / "cosmic-ray"), "dump", str(session)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        outcomes: Counter[str] = Counter()
        sampled = restricted = ""
        survivors: list[tuple[int, str, str]] = []
        for line in dump.splitlines():
            item, result = json.loads(line)
            if result is None:
                outcomes["pending"] += 1
            elif result["worker_outcome"] == "skipped":
                reason = (result["output"] or "").removeprefix("Excluded: ")
                if (result["output"] or "").startswith(SAMPLE_REASON):
                    sampled = reason
                    reason = SAMPLE_REASON.removeprefix("Excluded: ")
                elif (result["output"] or "").startswith(LINES_REASON):
                    restricted = reason.removeprefix(LINES_REASON.removeprefix("Excluded: "))
                    reason = LINES_REASON.removeprefix("Excluded: ")
                outcomes["excluded: " + reason.lower()] += 1
            elif result["worker_outcome"] != "normal":
                outcomes[result["worker_outcome"]] += 1
            elif result["test_outcome"] == "survived":
                outcomes["survived"] += 1
                mutation = item["mutations"][0]
                operator = mutation["operator_name"].removeprefix("core/")
                survivors.append((mutation["start_pos"][0], operator, result["diff"] or ""))
            else:
                outcomes[result["test_outcome"]] += 1
        killed, survived = outcomes["killed"], outcomes["survived"]
        counted = killed + survived
        killed_total += killed
        counted_total += counted
        score = f"{killed / counted:.1%}" if counted else "-"
        extra = ", ".join(
            f"{outcomes[k]} {k}" for k in sorted(outcomes) if k not in ("killed", "survived")
        )
        print(f"{name}: {score} killed ({killed} of {counted}; {survived} survived; {extra})")
        if restricted:
            print(
                f"  ONLY THE MUTANTS ON SOME LINES {restricted.strip()}, not the whole module:"
                f" {outcomes['excluded: ' + LINES_REASON.removeprefix('Excluded: ')]}"
                " mutants elsewhere not run"
            )
        if sampled and counted:
            low, high = _wilson(killed, counted)
            print(
                f"  A SAMPLE, not a full run: the first {counted} mutants of a random order"
                f" {sampled.removeprefix(SAMPLE_REASON.removeprefix('Excluded: ')).strip()};"
                f" the module's score is between {low:.1%} and {high:.1%} (95% Wilson interval)"
            )
        for line_no, operator, diff in sorted(survivors):
            print(f"  survived: {MODULES[name].path}:{line_no} {operator}")
            body = [
                d for d in diff.splitlines() if d[:1] in ("+", "-") and d[:3] not in ("+++", "---")
            ]
            for d in body:
                print(f"      {d}")
    if counted_total:
        print(
            f"total: {killed_total / counted_total:.1%} killed ({killed_total} of {counted_total})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="init (or resume) and exec the sessions, then report")
    run_parser.add_argument("modules", nargs="*", metavar="MODULE")
    run_parser.add_argument("--fresh", action="store_true", help="start the sessions over")
    run_parser.add_argument("--timeout", type=float, default=900.0, help="per mutant, seconds")
    run_parser.add_argument(
        "--retest", action="store_true", help="test the surviving mutants again (new tests)"
    )
    run_parser.add_argument(
        "--sample",
        type=int,
        metavar="N",
        help="run only N mutants, chosen reproducibly, one by one (the score is a sample's)",
    )
    run_parser.add_argument("--sample-seed", type=int, default=0, metavar="S")
    only = run_parser.add_mutually_exclusive_group()
    only.add_argument(
        "--lines", metavar="A-B,C", help="run only the mutants that start on these lines"
    )
    only.add_argument(
        "--changed-since",
        metavar="REV",
        help="run only the mutants on the lines changed or added since git revision REV",
    )
    stages_parser = sub.add_parser("stages", help="which test stage killed the mutants")
    stages_parser.add_argument("modules", nargs="*", metavar="MODULE")
    report_parser = sub.add_parser("report", help="the score and the surviving mutants")
    report_parser.add_argument("modules", nargs="*", metavar="MODULE")
    test_parser = sub.add_parser("test", help="the per-mutant test command")
    test_parser.add_argument("module", choices=list(MODULES))
    args = parser.parse_args()
    if args.command == "test":
        sys.exit(test(args.module))
    names = args.modules or list(MODULES)
    unknown = [name for name in names if name not in MODULES]
    if unknown:
        parser.error(f"unknown modules {unknown}: choose among {list(MODULES)}")
    if args.command == "run":
        run(
            names,
            args.fresh,
            args.timeout,
            args.retest,
            sample=args.sample,
            sample_seed=args.sample_seed,
            lines=args.lines,
            changed_since=args.changed_since,
        )
    elif args.command == "stages":
        stages(names)
    else:
        report(names)


if __name__ == "__main__":
    main()
