"""The Python blocks of docs/application-authors.md run, in order, as one program
against a fresh ``waltz dev`` cluster (child processes: local coordination, three
fs storage nodes, a server, ZeroMQ; two partitions), as a reader would run them."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from waltz_dev.dev import DevCluster

pytestmark = [pytest.mark.system, pytest.mark.timeout(240)]

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "application-authors.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        first_line = text.count("\n", 0, match.start(1)) + 1
        blocks.append((first_line, match.group(1)))
    return blocks


def as_program(text: str) -> str:
    """The blocks joined into one module whose line numbers are the doc's."""
    lines = [""] * (text.count("\n") + 1)
    for first_line, code in python_blocks(text):
        for offset, line in enumerate(code.splitlines()):
            lines[first_line - 1 + offset] = line
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def dev_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    cluster = DevCluster(tmp_path_factory.mktemp("guide") / "dev", partitions=2)
    try:
        asyncio.run(cluster.start())
        yield cluster
    finally:
        asyncio.run(cluster.stop())  # every child by its pid


def test_the_program_keeps_the_doc_line_numbers() -> None:
    text = "intro\n```python\na = 1\n```\nmore\n\n```python\nb = a + 1\n```\n"
    program = as_program(text).splitlines()
    assert program[2] == "a = 1" and program[7] == "b = a + 1"
    assert [line for line in program if line] == ["a = 1", "b = a + 1"]


def test_the_application_authors_guide_runs(
    dev_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert len(python_blocks(text)) >= 8
    monkeypatch.setenv("WALTZ_COORDINATION", dev_cluster.coordination_uri)
    namespace: dict[str, Any] = {"__name__": "application_authors_guide"}
    exec(compile(as_program(text), str(GUIDE), "exec"), namespace)
    # what the guide demonstrates, checked once more from its own variables
    assert namespace["committed"] == 10
    assert namespace["accounts"].balance(1) == 20
    assert namespace["again"].applied == 0
    assert "lock failures:" in capsys.readouterr().out
