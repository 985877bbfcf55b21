"""`make test`'s runner (.ci/toxpar.py): every environment runs, two at a time, the
longest first; at the end each log is printed whole, the failing ones' last, then a
summary naming the failures, and the exit status says whether any failed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("toxpar", ROOT / ".ci" / "toxpar.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["toxpar"] = module  # its dataclasses resolve their annotations here
    spec.loader.exec_module(module)
    return module


toxpar = _load()

# Each "environment" prints its name; "b" fails. "a" ends only once "b" has started
# (a file "b" writes), with a deadline: run one after another, "a" fails.
SCRIPT = """
import sys, time
from pathlib import Path
env, marks = sys.argv[1], Path(sys.argv[2])
(marks / f"{env}.started").touch()
print(f"output of {env}")
if env == "a":
    deadline = time.monotonic() + 60
    while not (marks / "b.started").exists():
        if time.monotonic() > deadline:
            print("b never started beside a")
            sys.exit(3)
        time.sleep(0.02)
sys.exit(1 if env == "b" else 0)
"""


def test_environments_run_two_at_a_time_and_the_failures_are_printed_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "env.py"
    script.write_text(SCRIPT)

    def command(env: str) -> list[str]:
        return [sys.executable, str(script), env, str(marks)]

    envs = ["c", "a", "b"]  # none of them in EXPECTED_SECONDS: taken in this order
    results = toxpar.run(envs, 2, command, tmp_path / "logs")
    assert sorted(r.env for r in results) == ["a", "b", "c"]
    assert {r.env: r.code for r in results} == {"a": 0, "b": 1, "c": 0}
    assert (tmp_path / "logs" / "b.log").read_text() == "output of b\n"

    status = toxpar.report(results, envs, 1.0)
    out = capsys.readouterr().out
    assert status == 1
    logs = out.split("summary")[0]
    # every log printed whole, the failing one after the passing ones
    assert logs.index("output of c") < logs.index("output of b")
    assert logs.index("output of a") < logs.index("output of b")
    tail = out.strip().splitlines()
    assert tail[-1].startswith("FAILED: b ")
    assert any(line.split()[:2] == ["b", "FAILED"] for line in tail[-6:])


def test_all_passing_exits_zero_and_the_longest_go_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def command(env: str) -> list[str]:
        return [sys.executable, "-c", f"print('{env} ran')"]

    results = toxpar.run(["lint", "unit"], 1, command, tmp_path)
    assert [r.env for r in results] == ["unit", "lint"]  # the expected longest first
    assert toxpar.report(results, ["lint", "unit"], 1.0) == 0
    assert capsys.readouterr().out.strip().endswith("every environment passed")


def test_too_little_free_disk_is_warned_and_a_full_disk_named_in_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(toxpar, "NEEDED_GIB", 10**9)  # more than any disk has
    warnings = toxpar.check_disk(toxpar.distinct_filesystems([tmp_path, tmp_path]))
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    monkeypatch.setattr(toxpar, "NEEDED_GIB", 0)
    assert toxpar.check_disk([tmp_path]) == []

    def command(env: str) -> list[str]:
        text = "OSError: [Errno 28] No space left on device" if env == "full" else "fine"
        return [sys.executable, "-c", f"print({text!r}); raise SystemExit({env != 'ok'})"]

    envs = ["ok", "full", "other"]
    results = toxpar.run(envs, 1, command, tmp_path / "logs")
    assert toxpar.report(results, envs, 1.0) == 1
    summary = capsys.readouterr().out.split("=" * 30 + " summary")[1]
    assert "the disk filled up during full (" in summary
    assert "other" not in summary.split("the disk filled up")[1].split("\n")[0]
