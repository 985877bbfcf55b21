"""The protocol points (``waltz_api.faultpoints``): every point the code marks is
registered, every registered point is marked somewhere, and nothing happens without a
handler."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from waltz_api import faultpoints

ROOT = Path(__file__).resolve().parents[3]
_CALL = re.compile(r"""\bpoint\(\s*["']([\w.]+)["']""")


def _marked() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for source in sorted(ROOT.glob("packages/*/src/**/*.py")):
        text = source.read_text(encoding="utf-8")
        if "faultpoints" not in text:
            continue
        for name in _CALL.findall(text):
            found.setdefault(name, []).append(source.relative_to(ROOT).as_posix())
    return found


def test_every_marked_point_is_registered_and_every_registered_one_is_marked() -> None:
    marked = _marked()
    assert not set(marked) - set(faultpoints.POINTS), {
        name: where for name, where in marked.items() if name not in faultpoints.POINTS
    }
    assert not set(faultpoints.POINTS) - set(marked), "registered but marked nowhere"


def test_a_point_without_a_handler_does_nothing_and_handlers_do_not_nest() -> None:
    faultpoints.point("leader.record_written", server=1)  # no handler: nothing happens
    seen: list[str] = []
    with faultpoints.installed(lambda name, detail: seen.append(name)):
        faultpoints.point("archive.mark_advanced", partition=0)
        with (
            pytest.raises(Exception, match="already installed"),
            faultpoints.installed(lambda name, detail: None),
        ):
            pass
    faultpoints.point("archive.mark_advanced", partition=0)
    assert seen == ["archive.mark_advanced"]
