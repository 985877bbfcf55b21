"""Every distribution's metadata: license, authors, URLs, classifiers, README,
sibling pins to the same release and bounded third-party ranges.

Read from the pyproject.toml files (what the wheels are built from); the `dist`
tox environment checks the built wheels themselves.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROJECTS = sorted(
    [
        *ROOT.glob("packages/*/pyproject.toml"),
        ROOT / "conformance" / "pyproject.toml",
        *ROOT.glob("examples/*/pyproject.toml"),
    ]
)
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*(.*)$")


def _project(path: Path) -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
    return project


def _requirements(project: dict[str, Any]) -> list[str]:
    found = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        found.extend(extra)
    return found


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.parent.relative_to(ROOT)) for p in paths]


def test_every_distribution_is_found() -> None:
    names = {_project(p)["name"] for p in PROJECTS}
    assert {
        "waltz-api",
        "waltz-server",
        "waltz-storage-node",
        "waltz-dev",
        "waltz-client",
        "waltz-conformance",
    } <= names
    assert len(PROJECTS) >= 12


def test_the_license_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text


@pytest.mark.parametrize("path", PROJECTS, ids=_ids(PROJECTS))
def test_metadata(path: Path) -> None:
    project = _project(path)
    name = project["name"]
    assert project["license"] == "Apache-2.0", name
    # hatchling puts LICENSE* of the project directory into the wheel and sdist
    assert (path.parent / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes(), name
    assert project["authors"], name
    urls = project["urls"]
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= set(urls), name
    classifiers = project["classifiers"]
    assert any(c.startswith("Development Status ::") for c in classifiers), name
    assert "Programming Language :: Python :: 3.11" in classifiers, name
    # PEP 639: a license expression and a license classifier must not both be given
    assert not any(c.startswith("License ::") for c in classifiers), name
    build = tomllib.loads(path.read_text(encoding="utf-8"))["build-system"]["requires"]
    assert any(r.startswith("hatchling>=1.27") for r in build), (name, build)


@pytest.mark.parametrize("path", PROJECTS, ids=_ids(PROJECTS))
def test_readme_says_what_it_is_how_to_install_and_where_the_docs_are(path: Path) -> None:
    project = _project(path)
    assert project.get("readme") == "README.md", project["name"]
    readme = (path.parent / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# "), path
    assert len(readme) > 600, f"{path.parent}: a README of {len(readme)} characters"
    if path.parent.parent.name == "packages" or path.parent.name == "conformance":
        assert any(f"pip install {quote}{project['name']}" in readme for quote in ("", "'", '"')), (
            f"{path.parent}/README.md has no install line for {project['name']}"
        )
        assert "/docs" in readme, f"{path.parent}/README.md links no documentation"


def test_one_release_for_every_distribution() -> None:
    versions = {_project(p)["name"]: _project(p)["version"] for p in PROJECTS}
    assert len(set(versions.values())) == 1, versions
    import waltz_api

    assert waltz_api.__version__ == versions["waltz-api"]  # what the processes report
    plugin = ROOT / "examples" / "third-party-plugin" / "src" / "waltz_storage_sqlite"
    assert f'__version__ = "{versions["waltz-api"]}"' in (plugin / "__init__.py").read_text()


@pytest.mark.parametrize("path", PROJECTS, ids=_ids(PROJECTS))
def test_siblings_pinned_to_the_release_and_third_parties_bounded(path: Path) -> None:
    project = _project(path)
    major, minor, _ = project["version"].split(".", 2)
    sibling_pin = f"== {major}.{minor}.*"
    if ".dev" in project["version"]:  # main between releases: pip takes a dev release
        sibling_pin += f", >= {project['version']}"  # only when a pin names one
    for requirement in _requirements(project):
        match = REQUIREMENT.match(requirement)
        assert match is not None, requirement
        name, _extras, spec = match.groups()
        if name.startswith("waltz-"):
            assert spec.strip() == sibling_pin, (
                f"{project['name']}: sibling {requirement!r} must be pinned '{sibling_pin}' "
                f"(every Waltz distribution of a release is released together)"
            )
        else:
            assert ">=" in spec and "<" in spec.replace("<=", ""), (
                f"{project['name']}: {requirement!r} needs a lower and an upper bound "
                f"(the range the tests ran on)"
            )


@pytest.mark.parametrize(
    "path",
    [p for p in PROJECTS if "third-party" not in str(p)],
    ids=_ids([p for p in PROJECTS if "third-party" not in str(p)]),
)
def test_siblings_resolve_from_the_workspace(path: Path) -> None:
    """uv refuses to build a member whose sibling requirement has no `tool.uv.sources` entry
    (CI's fresh install failed that way when an extra named a new sibling)."""
    document = tomllib.loads(path.read_text(encoding="utf-8"))
    sources = set(document.get("tool", {}).get("uv", {}).get("sources", {}))
    for requirement in _requirements(document["project"]):
        match = REQUIREMENT.match(requirement)
        assert match is not None, requirement
        name = match.group(1)
        if name.startswith("waltz-"):
            assert name in sources, (
                f"{path.relative_to(ROOT)}: add `{name} = {{ workspace = true }}` to "
                f"[tool.uv.sources] (it is required by {requirement!r})"
            )


def _tox_dist_commands() -> list[str]:
    import configparser

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    raw = tox["testenv:dist"]["commands"].replace("\\\n", " ")
    return [" ".join(line.split()) for line in raw.splitlines() if line.strip()]


def _operators_install_blocks() -> list[str]:
    """docs/operators.md's blocks marked `<!-- docs: run-dist -->`, their lines joined."""
    guide = (ROOT / "docs" / "operators.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^<!-- docs: run-dist [^\n]*-->\n```\n(.*?)^```$", guide, re.M | re.S)
    return [" ".join(block.replace("\\\n", " ").split()) for block in blocks]


def test_tox_dist_runs_the_operators_install_blocks_and_checks_what_they_made() -> None:
    """The `dist` environment runs docs/operators.md's install blocks as written (the
    docs runner: `wheels` in its checkout, `/opt/waltz` under its root), then checks the
    wheels and runs the smoke test on the venvs those blocks made."""
    blocks = _operators_install_blocks()
    assert len(blocks) == 4, blocks
    # one venv per role: the server's, the storage node's, an application's client
    assert '/opt/waltz/bin/pip install --find-links wheels "waltz-server[default]"' in blocks[1]
    assert (
        '/opt/waltz-storage/bin/pip install --find-links wheels "waltz-storage-node[default]"'
        in blocks[2]
    )
    assert (
        '/opt/waltz-client/bin/pip install --find-links wheels "waltz-client[default]"'
        in (blocks[3])
    )
    commands = _tox_dist_commands()
    assert commands[0].endswith(".ci/docsrun/docsrun.py run run-dist --workdir {envtmpdir}/docs")
    assert "check_wheels.py {envtmpdir}/docs/checkout/wheels" in commands[1]
    assert (
        "--server-venv {envtmpdir}/docs/root/opt/waltz "
        "--storage-venv {envtmpdir}/docs/root/opt/waltz-storage "
        "--client-venv {envtmpdir}/docs/root/opt/waltz-client" in commands[2]
    )
    assert not [c for c in commands if " pip " in c or " venv " in c], commands


def test_the_documented_wheel_build_builds_every_distribution_from_paths() -> None:
    build = next(b for b in _operators_install_blocks() if " wheel " in b).split()
    for path in PROJECTS:
        if path.parent.parent.name == "examples":
            continue
        assert f"./{path.parent.relative_to(ROOT)}" in build, path
