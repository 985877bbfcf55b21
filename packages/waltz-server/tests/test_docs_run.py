"""Docs that run (.ci/docsrun/docsrun.py): every shell block of README.md and
docs/*.md is run as written or marked with why not, every marker holds, and the
`run` and `run-background` blocks run, in doc order, in a fresh copy of the
checkout (the README's `make demo` first: it makes the `.venv` the later blocks use).
The `run-dist` blocks (docs/operators.md's install) run in `tox -e dist`."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
log = logging.getLogger(__name__)


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docsrun", ROOT / ".ci" / "docsrun" / "docsrun.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docsrun"] = module  # its dataclasses resolve their annotations here
    spec.loader.exec_module(module)
    return module


docsrun = _load()


def test_every_shell_block_is_marked_and_every_marker_holds() -> None:
    blocks = docsrun.all_blocks()
    assert len([b for b in blocks if b.is_shell]) >= 40
    assert docsrun.problems(blocks) == []


def test_an_unmarked_block_and_bad_markers_are_refused(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_there() -> None: ...\n")
    text = "\n".join(
        [
            "```",
            "waltz dev",
            "```",
            "<!-- docs: illustrative -->",
            "```sh",
            "rm -rf /",
            "```",
            "<!-- docs: covered-by tests/test_x.py::test_gone (a reason) -->",
            "```",
            "true",
            "```",
            "<!-- docs: covered-by tests/test_x.py::test_there (a reason) -->",
            "",
            "```bash",
            "true",
            "```",
            "<!-- docs: run-background (no until) -->",
            "```",
            "sleep 1",
            "```",
            "<!-- docs: runn -->",
            "```",
            "true",
            "```",
            "```text",
            "output is no shell block",
            "```",
        ]
    )
    found = docsrun.problems(docsrun.blocks_of(text, "x.md"), tmp_path)
    assert [line.split(": ", 1)[0] for line in found] == [
        "x.md:1",
        "x.md:5",
        "x.md:9",
        "x.md:18",
        "x.md:22",
    ], found
    assert "an unmarked shell block" in found[0]
    assert "needs its reason" in found[1]
    assert "the file has no test_gone" in found[2]
    assert 'needs `until "TEXT"`' in found[3]
    assert "unknown docs marker 'runn'" in found[4]


def test_paths_under_opt_etc_and_tmp_are_rooted() -> None:
    root = Path("/r")
    assert docsrun.rooted("python3 -m venv /opt/waltz\n", root) == "python3 -m venv /r/opt/waltz\n"
    assert docsrun.rooted("--out /etc/waltz/keys", root) == "--out /r/etc/waltz/keys"
    assert (
        docsrun.rooted("'local:///tmp/g/coordination?root=/waltz'", root)
        == "'local:///r/tmp/g/coordination?root=/waltz'"
    )
    assert docsrun.rooted("/opt/waltz-client/bin/pip", root) == "/r/opt/waltz-client/bin/pip"
    unchanged = "/etc/waltzer ./tmp/x a/tmp/b /tmpfs /etc/zookeeper/ca.pem /optional"
    assert docsrun.rooted(unchanged, root) == unchanged


def test_the_install_path_of_operators_md_runs_in_tox_dist() -> None:
    blocks = [b for b in docsrun.all_blocks() if b.kind == "run-dist"]
    assert {b.path for b in blocks} == {"docs/operators.md"}
    text = "".join(b.body for b in blocks)
    assert "pip wheel" in text and '"waltz-server[default]"' in text
    assert '"waltz-client[default]"' in text
    # every argument of the wheel line is a path, never a name pip would download
    wheel_block = blocks[0].body
    assert wheel_block.startswith("python3 -m pip wheel ")
    words = wheel_block.replace("\\\n", " ").split()[4:]
    assert words[:3] == ["--no-deps", "--wheel-dir", "wheels"], words
    assert len(words) > 10 and all(w.startswith("./") for w in words[3:]), words
    tox = (ROOT / "tox.ini").read_text(encoding="utf-8")
    dist = tox[tox.index("[testenv:dist]") : tox.index("[testenv:sim]")]
    assert re.search(r"docsrun\.py run run-dist --workdir", dist), dist


@pytest.mark.system
@pytest.mark.timeout(900)
def test_the_run_blocks_run_as_written(tmp_path: Path) -> None:
    blocks = [b for b in docsrun.all_blocks() if b.kind in ("run", "run-background")]
    assert blocks[0].body == "make demo\n"
    assert any(b.kind == "run-background" for b in blocks)
    checkout = docsrun.make_checkout(ROOT, tmp_path / "checkout")
    assert not (checkout / ".venv").exists() and (checkout / "Makefile").is_file()
    root = tmp_path / "root"
    env = docsrun.prepare_root(root)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    failed = []
    started = time.monotonic()
    for block in blocks:
        outcome = docsrun.run_block(block, checkout, root, env, timeout=300)
        log.info("%s (%s): %.1f s, ok=%s", block.where, block.kind, outcome.seconds, outcome.ok)
        if not outcome.ok:
            failed.append(f"{block.where}:\n{block.body}---\n{outcome.output[-3000:]}")
    log.info("%d blocks in %.1f s", len(blocks), time.monotonic() - started)
    assert not failed, "\n\n".join(failed)
