"""The package boundaries of docs/architecture.md, checked on the source: which Waltz
package may import which (every import, lazy and TYPE_CHECKING ones included), that
the table in the docs is this one, that no two modules import each other through a
circle, that a long module says why it is one, and that the client's metadata API only
reads."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

MAY_IMPORT: dict[str, set[str]] = {
    "waltz_api": set(),
    "waltz_cli": {"waltz_api"},
    "waltz_client": {"waltz_api"},
    "waltz_server": {"waltz_api", "waltz_cli"},
    "waltz_storage_node": {"waltz_api", "waltz_cli"},
    "waltz_dev": {"waltz_api", "waltz_cli", "waltz_server", "waltz_storage_node"},
    "waltz_storage_fs": {"waltz_api"},
    "waltz_archive": {"waltz_api"},
    "waltz_coord_zk": {"waltz_api"},
    "waltz_coord_etcd": {"waltz_api"},
    "waltz_coord_local": {"waltz_api"},
    "waltz_transport_zmq": {"waltz_api"},
    "waltz_conformance": {"waltz_api"},
    "waltz_spark": {"waltz_api", "waltz_client", "waltz_archive"},
    "waltz_console": {"waltz_api", "waltz_server"},
    "waltz_sim": {"waltz_api", "waltz_server", "waltz_storage_node", "waltz_client"},
    "waltz_chaos": {"waltz_api", "waltz_server", "waltz_storage_node", "waltz_client", "waltz_sim"},
    "waltz_bank": {"waltz_api", "waltz_client", "waltz_cli"},
}
"""Package -> the Waltz packages any of its modules may import."""

ALSO_IN: dict[str, set[str]] = {
    "waltz_client.cli": {"waltz_cli"},
    "waltz_bank.spark_jobs": {"waltz_spark"},
    "waltz_conformance.suites.system": {"waltz_server", "waltz_storage_node"},
    "waltz_conformance.suites.system_failover": {"waltz_server"},
    "waltz_spark.testing": {"waltz_server", "waltz_storage_node", "waltz_dev"},
    "waltz_chaos.cluster": {"waltz_conformance"},
    "waltz_chaos.damage": {"waltz_storage_fs"},
    "waltz_sim.fsdisk": {"waltz_storage_fs"},
    "waltz_sim.archive": {"waltz_archive"},
    "waltz_server.locktables.conformance": {"waltz_conformance"},
    "waltz_server.server.archiving": {"waltz_archive"},
    "waltz_server.cli.archive": {"waltz_archive"},
    "waltz_storage_fs.conformance": {"waltz_conformance"},
    "waltz_coord_zk.conformance": {"waltz_conformance"},
    "waltz_coord_etcd.conformance": {"waltz_conformance"},
    "waltz_coord_local.conformance": {"waltz_conformance"},
    "waltz_transport_zmq.conformance": {"waltz_conformance"},
}
"""Module (or subpackage) -> what it may import besides its package's rule: a
command line module its CLI package, a plugin's ``conformance`` module the suite."""


def _sources() -> dict[str, Path]:
    found = {p.name: p for p in ROOT.glob("packages/*/src/waltz_*")}
    found["waltz_conformance"] = ROOT / "conformance" / "src" / "waltz_conformance"
    found["waltz_bank"] = ROOT / "examples" / "bank" / "src" / "waltz_bank"
    return found


def _imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _allowed(module: str, package: str) -> set[str]:
    allowed = {package, *MAY_IMPORT[package]}
    for prefix, extra in ALSO_IN.items():
        if module == prefix or module.startswith(prefix + "."):
            allowed |= extra
    return allowed


def test_every_package_has_a_rule() -> None:
    assert set(_sources()) == set(MAY_IMPORT)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_what_its_rule_allows(package: str) -> None:
    source = _sources()[package]
    first_party = set(MAY_IMPORT)
    checked = 0
    for path in sorted(source.rglob("*.py")):
        module = ".".join(path.relative_to(source.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        wrong = (_imports(path) & first_party) - _allowed(module, package)
        assert not wrong, f"{module} imports {sorted(wrong)} (docs/architecture.md)"
        checked += 1
    assert checked


def test_the_rules_catch_an_import_they_forbid(tmp_path: Path) -> None:
    """The walk sees lazy and TYPE_CHECKING imports too."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import waltz_server.server\n"
        "def f():\n    from waltz_storage_fs.engine import FsStorageEngine\n"
    )
    assert {"waltz_server", "waltz_storage_fs"} <= _imports(path)
    assert "waltz_server" not in _allowed("waltz_client.client", "waltz_client")
    assert "waltz_cli" in _allowed("waltz_client.cli.perf.engine", "waltz_client")


def test_the_docs_table_is_these_rules() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## What each package may import", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, set[str]] = {}
    also: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`waltz_"):
            continue
        package = cells[0].strip("`")
        documented[package] = set(re.findall(r"`(waltz_\w+)`", cells[1]))
        for module, names in re.findall(r"`(waltz_[\w.]+)`: ((?:`waltz_\w+`(?:, )?)+)", cells[2]):
            also[module] = set(re.findall(r"`(waltz_\w+)`", names))
    assert documented == MAY_IMPORT
    assert also == ALSO_IN


def test_the_client_reads_and_watches_the_cluster_metadata_only() -> None:
    """Every change of the cluster metadata is the server's (ClusterAdmin): the class a
    client uses has none of them."""
    from waltz_api.cluster import ClusterMetadata
    from waltz_server.cluster_admin import ClusterAdmin

    changes = set(vars(ClusterAdmin)) - set(vars(ClusterMetadata))
    assert {
        "create_cluster",
        "delete_cluster",
        "add_storage_node",
        "remove_storage_node",
        "add_replica",
        "remove_replica",
        "register_server",
        "assign_partition",
        "claim_leadership",
        "set_leader",
        "cas_store_metadata",
        "update_store_metadata",
        "new_store_session",
    } <= changes
    for name in changes:
        assert not hasattr(ClusterMetadata, name), name
    writes = {"set", "create", "delete", "increment"}
    client_writes = [
        name
        for name, member in vars(ClusterMetadata).items()
        if callable(member)
        and writes & set(re.findall(r"coordination\.(\w+)\(", _source_of(member)))
    ]
    assert client_writes == ["allocate_client_id"], client_writes


def _source_of(function: object) -> str:
    import inspect

    return inspect.getsource(function)  # type: ignore[arg-type]


LONG_MODULE_LINES = 800
"""The size above which a module must say why it is one module (docs/architecture.md)."""

LONG_MARKER = "Above 800 lines on purpose:"
"""What a long module's docstring says, in its first lines, before the reason."""


def _says_why(source: Path) -> bool:
    head = "\n".join(source.read_text(encoding="utf-8").splitlines()[:12])
    return LONG_MARKER in " ".join(head.split())


def test_long_modules_say_why() -> None:
    """No source module above 800 lines unless it says why at its top (the marker in the
    first lines of its docstring) and the docs' 'Long modules' table names it."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Long modules", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(waltz_[\w/]+\.py)`", section))
    for suite in re.findall(r"`waltz_conformance/suites/storage.py`, (.*?) \|", section):
        named |= {f"waltz_conformance/suites/{n}" for n in re.findall(r"`(\w+\.py)`", suite)}
    too_long = []
    for source in sorted(
        [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("conformance/src/**/*.py")]
    ):
        lines = source.read_text(encoding="utf-8").count("\n")
        relative = source.as_posix().split("/src/", 1)[1]
        if lines <= LONG_MODULE_LINES:
            continue
        missing = [
            what
            for what, ok in (
                (f"'{LONG_MARKER} ...' in its docstring's first lines", _says_why(source)),
                ("a row in docs/architecture.md's 'Long modules' table", relative in named),
            )
            if not ok
        ]
        if missing:
            too_long.append(f"{relative} ({lines} lines) lacks {' and '.join(missing)}")
    assert not too_long, f"split these along their seams, or say why each is one module: {too_long}"


def test_the_long_module_rule_reads_the_marker(tmp_path: Path) -> None:
    said = tmp_path / "said.py"
    said.write_text('"""A module.\n\n(Above 800 lines\non purpose: one procedure.)\n"""\n')
    silent = tmp_path / "silent.py"
    silent.write_text('"""A module."""\n' + "x = 1\n" * 20 + "# Above 800 lines on purpose: late\n")
    assert _says_why(said)
    assert not _says_why(silent)


def test_every_backoff_is_given_its_random_generator() -> None:
    """A back-off's jitter comes from an injected generator: one drawn from the global
    one made the simulation's replays differ (the ACL gate's retry loop did)."""
    unseeded = []
    for source in sorted(ROOT.glob("packages/*/src/**/*.py")):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Backoff"
                and len(node.args) < 3
                and not any(k.arg == "rng" for k in node.keywords)
            ):
                unseeded.append(f"{source.relative_to(ROOT)}:{node.lineno}")
    assert not unseeded, f"pass the component's rng to these Backoff(...): {unseeded}"


REPLICA_USERS = (
    "packages/waltz-server/src/waltz_server/server/store_session.py",
    "packages/waltz-server/src/waltz_server/server/recovery.py",
)
"""The modules that drive replicas (``server/replica.py``'s ReplicaConnection)."""


def _probes(source: str) -> list[int]:
    """The lines of every ``getattr``/``hasattr`` call in ``source``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
    ]


def test_replicas_are_driven_through_their_contract_not_probed() -> None:
    """Every call on a replica is in the ReplicaConnection Protocol (mypy checks it), an
    optional one behind a declared capability: a probed method (``getattr(connection,
    "prune", None)``) is one the type checker never sees, and a renamed or misspelt one
    silently turns a feature off."""
    found = {
        path: lines
        for path in REPLICA_USERS
        if (lines := sorted(_probes((ROOT / path).read_text(encoding="utf-8"))))
    }
    assert not found, (
        f"getattr/hasattr in the modules that drive replicas (lines {found}): declare the "
        "call in ReplicaConnection (server/replica.py), and an optional one's capability "
        "in its capabilities (waltz_api.capabilities)"
    )


def test_the_probe_check_sees_a_probe() -> None:
    assert _probes('prune = getattr(connection, "prune", None)\nhasattr(c, "x")\n') == [1, 2]


SPAWNS = {"Popen", "create_subprocess_exec", "create_subprocess_shell"}

SPAWN_ELSEWHERE: dict[str, str] = {
    "packages/waltz-api/src/waltz_api/supervised.py": "the supervised child process itself",
    "packages/waltz-coord-local/src/waltz_coord_local/writer.py": (
        "a worker driven over two pipes it inherits (pass_fds): no log, no ready line; it "
        "ends when its request pipe closes"
    ),
    "conformance/src/waltz_conformance/suites/storage.py": (
        "the crash test's writer streams its acknowledgements on a pipe, read as they come "
        "until it is killed mid-write"
    ),
    "conformance/src/waltz_conformance/suites/coordination.py": (
        "a worker that answers in JSON lines on its pipes (asyncio), killed mid-session"
    ),
    "bench/profiling.py": "py-spy, which ends by itself after its duration (no log, no readiness)",
    "bench/mutation.py": (
        "a mutant's test stages (pytest, waltz simulate): their output is the terminal's "
        "(no log, no readiness), and a hung one is stopped with its whole process group"
    ),
}
"""The modules that may start a child process other than through
``waltz_api.supervised.SupervisedProcess``, each with its reason."""


def _spawns(source: str) -> list[int]:
    """The lines of every ``Popen(...)`` / ``create_subprocess_*(...)`` call in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in SPAWNS:
            lines.append(node.lineno)
    return sorted(lines)


def test_child_processes_are_started_by_the_supervised_helper_only() -> None:
    """A child with a log file, a ready line, SIGTERM then SIGKILL: one implementation
    (waltz_api.supervised), not one per launcher (there were eight)."""
    sources = [
        *ROOT.glob("packages/*/src/**/*.py"),
        *ROOT.glob("conformance/src/**/*.py"),
        *ROOT.glob("examples/*/src/**/*.py"),
        *ROOT.glob("bench/**/*.py"),
    ]
    found: dict[str, list[int]] = {}
    for source in sorted(sources):
        relative = source.relative_to(ROOT).as_posix()
        if lines := _spawns(source.read_text(encoding="utf-8")):
            found[relative] = lines
    unlisted = {path: lines for path, lines in found.items() if path not in SPAWN_ELSEWHERE}
    assert not unlisted, (
        f"start these child processes with waltz_api.supervised.SupervisedProcess (or list "
        f"the module in SPAWN_ELSEWHERE with the reason it cannot): {unlisted}"
    )
    stale = sorted(set(SPAWN_ELSEWHERE) - set(found))
    assert not stale, f"these modules start no child process any more: unlist them: {stale}"


def test_the_spawn_check_sees_a_spawn() -> None:
    source = (
        "import subprocess, asyncio\nfrom subprocess import Popen\n"
        "subprocess.Popen(['x'])\nPopen(['y'])\nasyncio.create_subprocess_exec('z')\n"
        "subprocess.run(['ok'])\n"
    )
    assert _spawns(source) == [3, 4, 5]


# -- import circles between modules ---------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Every first-party module name -> its file (a package is its ``__init__``)."""
    modules = {}
    for source in _sources().values():
        for path in source.rglob("*.py"):
            name = ".".join(path.relative_to(source.parent).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(
    module: str, path: Path, modules: Mapping[str, Path], *, type_checking: bool = False
) -> set[str]:
    """The first-party modules ``module`` imports when it runs: at its top and inside
    its functions (a lazy import runs too), not under ``if TYPE_CHECKING:`` (unless
    ``type_checking``). ``from a import b`` names module ``a.b`` when there is one,
    else ``a``."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and not type_checking and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [known(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                targets.append(sub if sub in modules else known(origin))
        found.update(t for t in targets if t is not None)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(module)
    return found


def _circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import each other, as the path
    ``[a, b, ..., a]`` (the groups are the graph's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    circles = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}
        queue = [start]
        while queue:  # the shortest way back to start, inside the group
            node = queue.pop(0)
            for target in sorted(graph[node] & group):
                if target == start:
                    circles.append([*paths[node], start])
                    queue = []
                    break
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    queue.append(target)
    return sorted(circles)


def test_no_module_imports_itself_through_a_circle() -> None:
    """No circle of imports between modules, in any package: each module can be read,
    and imported, after the ones it uses. The graph holds every import a module makes
    (at its top, lazily inside a function, and under ``if TYPE_CHECKING:``: a circle
    only the type checker sees is still two modules that each need the other to be
    understood). A circle is broken by giving one direction: the lower module declares
    what it needs (a Protocol, a callable passed in) instead of importing the higher
    one."""
    modules = _modules()
    graph = {
        name: _runtime_imports(name, path, modules, type_checking=True)
        for name, path in modules.items()
    }
    found = [" -> ".join(circle) for circle in _circles(graph)]
    assert not found, f"import circles between modules (break each, docs/architecture.md): {found}"


def test_the_circle_rule_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text("import pkg.a\ndef g(): pass\n")
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
    )
    (package / "e.py").write_text("from pkg import d\n")
    (package / "f.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import pkg.e\n")
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.glob("*.py")
    }
    graph = {name: _runtime_imports(name, path, modules) for name, path in modules.items()}
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.d"] == set()
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    graph["pkg.d"] = {"pkg.e"}
    graph["pkg.e"] = {"pkg.d"}
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
    # with the TYPE_CHECKING imports (what the rule above uses): d -> a, f -> e -> d -> f
    graph = {
        name: _runtime_imports(name, path, modules, type_checking=True)
        for name, path in modules.items()
    }
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.f"] == {"pkg.e"}
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.f import x\n"
    )
    graph["pkg.d"] = _runtime_imports("pkg.d", package / "d.py", modules, type_checking=True)
    assert _circles(graph) == [
        ["pkg.a", "pkg.b", "pkg.c", "pkg.a"],
        ["pkg.d", "pkg.f", "pkg.e", "pkg.d"],
    ]


def test_the_client_core_has_one_direction_even_for_the_type_checker() -> None:
    """The client's core reads top down: the client makes partitions and channels and
    tells them what they need (``waltz_client.host``); a partition, its decisions and a
    channel never name the client, not even for the type checker (docs/architecture.md)."""
    modules = {n: p for n, p in _modules().items() if n.startswith("waltz_client.")}
    graph = {
        name: _runtime_imports(name, path, modules, type_checking=True)
        for name, path in modules.items()
    }
    assert _circles(graph) == []
    for lower in ("waltz_client.partition", "waltz_client.decisions", "waltz_client.channel"):
        assert "waltz_client.client" not in graph[lower], lower
