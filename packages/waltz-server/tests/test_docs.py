"""The docs match the code: generated tables and CLI reference are current, every
config key is documented with its default, every command, metric, link and
config example in the docs exists."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest

from waltz_api.config import config_from_mapping, describe
from waltz_api.errors import ConfigError
from waltz_cli import load_all
from waltz_cli import main as waltz
from waltz_server import docs_gen

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
main = load_all(waltz)
"""The whole `waltz` tree: every installed plugin's commands, loaded."""


def _section(text: str, name: str) -> str:
    begin = docs_gen.BEGIN.format(name=name)
    start = text.index(begin) + len(begin)
    return text[start : text.index(docs_gen.END, start)]


def test_generated_docs_are_current() -> None:
    stale = [
        str(path.relative_to(ROOT))
        for path, text in docs_gen.generated_files(ROOT).items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]
    assert not stale, f"run `python -m waltz_server.docs_gen` to update {stale}"


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    operators = (DOCS / "operators.md").read_text(encoding="utf-8")
    (tmp_path / "docs" / "operators.md").write_text(operators, encoding="utf-8")
    (tmp_path / "docs" / "cli.md").write_text("# outdated\n", encoding="utf-8")
    assert docs_gen.main(["--root", str(tmp_path), "--check"]) == 1
    assert (tmp_path / "docs" / "cli.md").read_text(encoding="utf-8") == "# outdated\n"
    assert docs_gen.main(["--root", str(tmp_path)]) == 0
    assert docs_gen.main(["--root", str(tmp_path), "--check"]) == 0
    assert (tmp_path / "docs" / "cli.md").read_text(encoding="utf-8") == docs_gen.cli_markdown()


@pytest.mark.parametrize(
    ("section", "schema_path"),
    [
        ("server-config", "waltz_server.server.config:ServerNodeConfig"),
        ("storage-config", "waltz_storage_node.config:StorageNodeConfig"),
        ("client-config", "waltz_client:ClientConfig"),
    ],
)
def test_every_config_key_is_in_operators_md_with_its_default(
    section: str, schema_path: str
) -> None:
    module, _, name = schema_path.partition(":")
    schema = getattr(__import__(module, fromlist=[name]), name)
    text = _section((DOCS / "operators.md").read_text(encoding="utf-8"), section)
    rows = {_cells(line)[0]: line for line in text.splitlines() if line.startswith("| `")}
    keys = describe(schema)
    assert len(keys) == len(rows), sorted(set(rows) - {f"`{k}`" for k, *_ in keys})
    for key, _type, default, _help in keys:
        line = rows.get(f"`{key}`")
        assert line is not None, f"config key {key} of {name} is missing from operators.md"
        field = _field(schema, key)
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        cell = _cells(line)[2]
        assert cell == docs_gen.format_default(default, required=required), (key, cell)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def _field(schema: Any, key: str) -> dataclasses.Field[Any]:
    import typing

    *sections, last = key.split(".")
    for part in sections:
        schema = typing.get_type_hints(schema)[part]
    return {f.name: f for f in dataclasses.fields(schema)}[last]


def _options(name: str) -> dict[str, Any]:
    from waltz_api.plugins import get_registry

    (schema,) = [s for s in get_registry().option_schemas() if s.name == name]
    return {spec.key: spec.default for spec in schema.load()}


def test_plugin_option_defaults_are_the_plugins_own() -> None:
    from waltz_coord_etcd.coordination import EtcdCoordination
    from waltz_server.locktables import HwmArrayLockTable
    from waltz_storage_fs.engine import FsOptions
    from waltz_transport_zmq.options import ZmqOptions

    etcd = _options("etcd-options")
    client = EtcdCoordination("etcd://127.0.0.1:2379/docs")  # not started: no connection
    assert client._gateway.connect_timeout == etcd["connect_timeout"]
    assert client._session_timeout == etcd["session_timeout"]
    assert dataclasses.asdict(FsOptions.from_mapping({})) == _options("fs-options")
    zmq = ZmqOptions.from_mapping({})
    for key, default in _options("zmq-options").items():
        if not key.startswith("curve_"):
            assert getattr(zmq, key) == default, key
    assert _options("hwm-array-options") == {"size": HwmArrayLockTable().size}
    assert _options("exact-options") == {}


def test_every_generated_region_is_a_plugins_option_table() -> None:
    """The tables come from the plugins (waltz_option_schemas): each region of the docs
    has its table, and a region no installed plugin fills is an error, not left stale."""
    text = (DOCS / "operators.md").read_text(encoding="utf-8")
    regions = re.findall(r"<!-- generated: (\S+) ", text)
    assert set(regions) == set(docs_gen.option_sections())
    assert {"server-config", "client-config", "zk-options", "fs-options"} <= set(regions)
    stale = text + f"\n{docs_gen.BEGIN.format(name='gone-options')}\nold\n{docs_gen.END}\n"
    with pytest.raises(ConfigError, match="'gone-options' that no installed plugin"):
        docs_gen.fill_sections(stale)


@dataclasses.dataclass
class _Section:
    documented: int = dataclasses.field(default=1, metadata={"help": "has help"})
    bare: int = 2


@dataclasses.dataclass
class _Schema:
    section: _Section = dataclasses.field(default_factory=_Section)


def test_a_key_without_help_is_refused() -> None:
    Schema = _Schema
    with pytest.raises(ConfigError, match=r"'section\.bare'.*no help"):
        docs_gen.schema_rows(Schema)
    rows = docs_gen.schema_rows(Schema, {"section.bare": "explained here"})
    assert [(r.key, r.default, r.meaning) for r in rows] == [
        ("section.documented", 1, "has help"),
        ("section.bare", 2, "explained here"),
    ]


def test_a_missing_region_is_refused() -> None:
    with pytest.raises(ConfigError, match="server-config"):
        docs_gen.fill_sections("# no markers", {"server-config": lambda: "x\n"})
    text = f"a\n{docs_gen.BEGIN.format(name='t')}\nold\n{docs_gen.END}\nb"
    assert docs_gen.fill_sections(text, {"t": lambda: "new\n"}) == text.replace("old", "new")


def test_every_command_has_a_section_in_cli_md() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    headings = re.findall(r"^#+ `(waltz[^`]*)`$", text, re.MULTILINE)
    assert headings == docs_gen.command_names(main)
    assert {"waltz cluster create", "waltz storage list", "waltz client tail"} <= set(headings)


def _code_blocks(
    text: str, languages: tuple[str, ...] = ("", "sh", "bash", "console")
) -> list[str]:
    blocks = re.findall(r"^```([a-z]*)\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    return [body for language, body in blocks if language in languages]


def _resolve(words: list[str]) -> str | None:
    """The command path ``words`` names, or None when a word is no subcommand."""
    command: click.Command = main
    path = ["waltz"]
    for word in words:
        if word.startswith("-") or not isinstance(command, click.Group):
            break
        if word not in command.commands:
            return None
        command = command.commands[word]
        path.append(word)
    if isinstance(command, click.Group) and not command.invoke_without_command:
        return None
    return " ".join(path)


def test_every_waltz_command_in_the_docs_exists() -> None:
    seen = set()
    for path in MARKDOWN:
        if path.name == "cli.md":
            continue  # generated from the command tree itself
        for block in _code_blocks(path.read_text(encoding="utf-8")):
            for line in block.splitlines():
                match = re.match(r"^\s*(?:\$ )?(?:\S*/)?waltz((?: [a-z][a-z-|]*)+)", line)
                if match is None:
                    continue
                words = match.group(1).split()
                for choice in words[-1].split("|") if "|" in words[-1] else [words[-1]]:
                    named = _resolve([*words[:-1], choice])
                    assert named is not None, f"{path.name}: `{line.strip()}` is no waltz command"
                    seen.add(named)
    assert {"waltz cluster create", "waltz storage", "waltz server", "waltz dev"} <= seen


def _metric_families() -> set[str]:
    from waltz_server.observability import exported_families
    from waltz_storage_node.metrics import exported_families as storage_families

    return set(exported_families()) | set(storage_families())


def _is_python_name(name: str, text: str) -> bool:
    """A package (waltz_storage_fs), a module path or a hook (waltz_storage_engines)."""
    from waltz_api import hookspecs

    return (
        importlib.util.find_spec(name) is not None
        or hasattr(hookspecs.WaltzHookSpecs, name)
        or re.search(re.escape(name) + r"[./]", text) is not None
    )


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    families = _metric_families()
    assert "waltz_server_high_water_mark" in families
    observability = (DOCS / "observability.md").read_text(encoding="utf-8")
    assert not [f for f in families if f"`{f}`" not in observability]
    for path in MARKDOWN:
        text = path.read_text(encoding="utf-8")
        named = {
            name
            for name in re.findall(r"\bwaltz_(?:server|storage|cluster)_[a-z0-9_]+\b", text)
            if not _is_python_name(name, text)
        }
        assert named <= families, f"{path.name} names unknown metrics {sorted(named - families)}"


def test_every_relative_link_resolves() -> None:
    for path in MARKDOWN:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_the_readme_links_every_doc() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS.glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md does not link {missing}"


def test_full_config_examples_in_the_docs_are_valid() -> None:
    from waltz_server.server.config import ServerNodeConfig
    from waltz_storage_node.config import StorageNodeConfig

    checked = 0
    for path in MARKDOWN:
        for block in _code_blocks(path.read_text(encoding="utf-8"), ("toml",)):
            raw = tomllib.loads(block)
            if "transport" not in raw:
                continue
            schema = ServerNodeConfig if "coordination" in raw else StorageNodeConfig
            try:
                config_from_mapping(schema, raw)
            except ConfigError as exc:
                pytest.fail(f"{path.name}: a {schema.__name__} example is invalid: {exc}")
            checked += 1
    assert checked >= 4


def _command(path: str) -> click.Command:
    command: click.Command = main
    for word in path.split()[1:]:
        assert isinstance(command, click.Group)
        command = command.commands[word]
    return command


def _shell_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined."""
    return block.replace("\\\n", " ").splitlines()


def test_every_option_of_a_waltz_command_in_the_docs_exists() -> None:
    checked = 0
    for path in MARKDOWN:
        if path.name == "cli.md":
            continue
        for block in _code_blocks(path.read_text(encoding="utf-8")):
            for line in _shell_lines(block):
                match = re.match(r"^\s*(?:\$ )?(?:\S*/)?waltz((?: [a-z][a-z-|]*)+)(.*)$", line)
                if match is None:
                    continue
                words = match.group(1).split()
                code = line.split("#", 1)[0] if " #" in line else line
                options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", code))
                for choice in words[-1].split("|"):
                    named = _resolve([*words[:-1], choice])
                    assert named is not None
                    known = {
                        opt
                        for param in _command(named).params
                        for opt in [
                            *getattr(param, "opts", []),
                            *getattr(param, "secondary_opts", []),
                        ]
                    } | {"--help"}
                    unknown = options - known
                    assert not unknown, f"{path.name}: `{line.strip()}`: no option {unknown}"
                    checked += 1
    assert checked >= 20


def _python_blocks() -> list[tuple[Path, str]]:
    return [
        (path, block)
        for path in MARKDOWN
        for block in _code_blocks(path.read_text(encoding="utf-8"), ("python",))
    ]


def test_every_name_imported_and_every_keyword_passed_in_the_docs_exists() -> None:
    import ast
    import importlib
    import inspect

    checked = 0
    for path, block in _python_blocks():
        flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        tree = compile(block, str(path), "exec", flags=flags)
        imported: dict[str, Any] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                root = node.module.split(".")[0]
                if importlib.util.find_spec(root) is None:
                    continue  # the docs' imaginary plugin (waltz_storage_s3)
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), (
                        f"{path.name}: {node.module} has no {alias.name}"
                    )
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
                    checked += 1
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            target = imported.get(node.func.id)
            keywords = [k.arg for k in node.keywords if k.arg is not None]
            if target is None or not keywords or not callable(target):
                continue
            try:
                signature = inspect.signature(target)
            except (TypeError, ValueError):
                continue
            try:
                signature.bind_partial(**dict.fromkeys(keywords))
            except TypeError as exc:
                pytest.fail(f"{path.name}: {node.func.id}({', '.join(keywords)}=...): {exc}")
            checked += 1
    assert checked >= 20


OTHER_VARIABLES = {
    "WALTZ_COORDINATION",
    "WALTZ_DISABLE_PLUGIN_AUTOLOAD",
    "WALTZ_CONSOLE_TOKEN",
    "WALTZ_CONSOLE_SCREENSHOTS",
    "WALTZ_CONSOLE_DEV_DIR",
    "WALTZ_CHAOS_REQUIRE_NETNS",
}


def test_every_environment_variable_in_the_docs_is_a_config_key() -> None:
    from waltz_server.server.config import ServerNodeConfig
    from waltz_storage_node.config import StorageNodeConfig

    keys = {
        key: type_ for s in (ServerNodeConfig, StorageNodeConfig) for key, type_, *_ in describe(s)
    }
    named = set()
    for path in MARKDOWN:
        for variable in re.findall(r"\bWALTZ_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            if variable in OTHER_VARIABLES or variable == "WALTZ_SECTION__KEY":
                continue
            key = variable.removeprefix("WALTZ_").lower().replace("__", ".")
            section = key.rsplit(".", 1)[0]
            valid = key in keys or keys.get(section) == "dict"  # an options table entry
            assert valid, f"{path.name}: {variable} names no config key"
            named.add(variable)
    assert {"WALTZ_SERVER__LOCK_TABLE", "WALTZ_STORAGE__DATA_DIR"} <= named


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_anchor_of_a_link_names_a_heading() -> None:
    checked = 0
    for path in MARKDOWN:
        text = path.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            linked = (path.parent / target) if target else path
            if linked.suffix != ".md":
                continue
            headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.MULTILINE)
            slugs = {_slug(h) for h in headings}
            assert anchor in slugs, f"{path.name}: no heading {anchor!r} in {linked.name}"
            checked += 1
    assert checked >= 3


def test_the_readme_two_commands_match_the_makefile_and_tox() -> None:
    import configparser

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo:", makefile, re.MULTILINE) and "```\nmake demo\n```" in readme
    assert "```\nmake test\n```" in readme
    # make test installs what is missing, then runs tox's env_list two at a time
    # (.ci/toxpar.py); CI (.ci/run) is make test
    test_recipe = re.search(r"^test:\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert test_recipe is not None
    assert test_recipe.group(1).split("\n")[:2] == [
        "\tscripts/install-test-deps",
        "\tpython3 .ci/toxpar.py --jobs $(JOBS)",
    ]
    assert re.search(r"^JOBS \?= 2$", makefile, re.MULTILINE)
    assert "two at a time" in readme and "`make test JOBS=1`" in readme
    ci_run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ci_run.rstrip().endswith("make test")
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    envs = [e.strip() for e in tox["tox"]["env_list"].split(",")]
    assert "unit" in envs
    missing = [env for env in envs if f"`{env}`" not in readme]
    assert not missing, f"README.md does not describe the tox envs {missing}"
