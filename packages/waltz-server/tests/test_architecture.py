"""The package boundaries of docs/architecture.md, checked on the source: which Waltz
package may import which (every import, lazy and TYPE_CHECKING ones included), that
the table in the docs is this one, and that the client's metadata API only reads."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

MAY_IMPORT: dict[str, set[str]] = {
    "waltz_api": set(),
    "waltz_cli": {"waltz_api"},
    "waltz_client": {"waltz_api"},
    "waltz_server": {"waltz_api", "waltz_cli"},
    "waltz_storage_fs": {"waltz_api"},
    "waltz_archive": {"waltz_api"},
    "waltz_coord_zk": {"waltz_api"},
    "waltz_coord_etcd": {"waltz_api"},
    "waltz_coord_local": {"waltz_api"},
    "waltz_transport_zmq": {"waltz_api"},
    "waltz_conformance": {"waltz_api"},
    "waltz_spark": {"waltz_api", "waltz_client", "waltz_archive"},
    "waltz_console": {"waltz_api", "waltz_server"},
    "waltz_sim": {"waltz_api", "waltz_server", "waltz_client"},
    "waltz_chaos": {"waltz_api", "waltz_server", "waltz_client", "waltz_sim"},
    "waltz_bank": {"waltz_api", "waltz_client", "waltz_cli"},
}
"""Package -> the Waltz packages any of its modules may import."""

ALSO_IN: dict[str, set[str]] = {
    "waltz_client.cli": {"waltz_cli"},
    "waltz_bank.spark_jobs": {"waltz_spark"},
    "waltz_conformance.suites.system": {"waltz_server"},
    "waltz_conformance.suites.system_failover": {"waltz_server"},
    "waltz_spark.testing": {"waltz_server"},
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


def test_long_modules_say_why() -> None:
    """No source module above about 800 lines unless the docs' table says why it is one."""
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
        if lines > 850 and relative not in named:
            too_long.append(f"{relative} ({lines} lines)")
    assert not too_long, (
        f"split these along their seams, or say at their top and in docs/architecture.md's "
        f"'Long modules' table why each is one module: {too_long}"
    )


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
