"""The parts of `tox -e upgrade` that need no cluster: the previous release found in the
CHANGELOG and exported from git, the commit-gap measure, the refusal's one line."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
from mixed import HarnessError, longest_gap
from release import REPO, Release, ReleaseError, export_tree, is_complete, latest_release
from test_upgrade import refusal

CHANGELOG = """# Changelog

## [Unreleased]

### Fixed
- something (`0123456789abcdef0123456789abcdef01234567` is not a release)

## [0.2.0] - 2027-01-02

The second release: commit `{second}` of `main`.

## [0.1.0] - 2026-11-29

The first release: commit `{first}`.
"""
FIRST = "a" * 40
SECOND = "b" * 40


def test_the_newest_released_section_and_its_commit() -> None:
    text = CHANGELOG.format(first=FIRST, second=SECOND)
    assert latest_release(text) == Release("0.2.0", SECOND)
    only_first = text.split("## [0.2.0]")[0] + "## [0.1.0]" + text.split("## [0.1.0]")[1]
    assert latest_release(only_first) == Release("0.1.0", FIRST)
    assert Release("0.1.0", FIRST).label == "0.1.0 (aaaaaaaaaaaa)"


def test_a_release_without_a_commit_or_no_release_is_refused() -> None:
    text = CHANGELOG.format(first=FIRST, second="not-a-commit")
    with pytest.raises(ReleaseError, match=r"section \[0.2.0\] names no commit"):
        latest_release(text)
    with pytest.raises(ReleaseError, match="no released section"):
        latest_release("# Changelog\n\n## [Unreleased]\n")


def test_this_changelog_names_a_commit_of_this_repository(tmp_path: Path) -> None:
    release = latest_release((REPO / "CHANGELOG.md").read_text())
    export_tree(release.commit, tmp_path)
    # the commit carries the version its section names
    project = tomllib.loads((tmp_path / "packages" / "waltz-server" / "pyproject.toml").read_text())
    assert project["project"]["version"] == release.version
    assert not is_complete(tmp_path, release)


def test_a_commit_missing_from_the_checkout_says_what_to_do(tmp_path: Path) -> None:
    missing = "f" * 40
    listed = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{missing}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    assert listed.returncode != 0
    with pytest.raises(ReleaseError, match="fetch --unshallow"):
        export_tree(missing, tmp_path)


def test_longest_gap_counts_the_window_edges() -> None:
    assert longest_gap([], 10.0, 12.5) == (2.5, 10.0)
    assert longest_gap([11.0, 11.2, 14.0, 30.0], 10.0, 15.0) == pytest.approx((2.8, 11.2))
    assert longest_gap([10.5, 11.0], 10.0, 14.0) == pytest.approx((3.0, 11.0))


def test_a_refusal_is_one_line_naming_a_version() -> None:
    output = (
        "2026-11-29 12:00:00,000 INFO waltz_server: starting\n"
        "error: /d/waltz-storage.ctl: control file format version 3 is not one this Waltz "
        "opens (1, 2); a newer Waltz wrote it\n"
    )
    assert refusal(output).startswith("error: /d/waltz-storage.ctl: control file format")
    with pytest.raises(HarnessError, match="traceback"):
        refusal("Traceback (most recent call last):\n  ...\nValueError: version 3\n")
    with pytest.raises(HarnessError, match="names no version"):
        refusal("error: cannot open the storage directory\n")
    with pytest.raises(HarnessError, match="without a word"):
        refusal("\n")
