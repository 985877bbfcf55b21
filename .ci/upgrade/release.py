"""The previous release, built from its commit into a venv of its own (`tox -e upgrade`).

- :func:`latest_release`: the newest released version in CHANGELOG.md and the commit its
  section names (the release process of CONTRIBUTING.md records it there);
- :func:`release_venv`: that commit's tree (``git archive``: the checkout needs the
  history, not a work tree), every wheel built from it (``uv build``), and the ones a
  cluster and its clients run installed into a fresh venv. The venv is cached under
  ``cache_dir`` keyed by the commit: a rerun reuses it.

``python .ci/upgrade/release.py --cache DIR`` prints the venv's path (building it when
missing). Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = re.compile(r"^## \[(?P<version>\d+\.\d+\.\d+[^\]]*)\]", re.MULTILINE)
COMMIT = re.compile(r"`(?P<commit>[0-9a-f]{40})`")
SKIPPED_WHEELS = ("waltz_spark-", "waltz_console-", "waltz_example_")
"""Wheels a cluster and its clients do not run (Spark, a browser UI, the examples)."""
COMPLETE = ".waltz-release"
"""Written into the venv last: its content is the commit (a half-built venv has none)."""


class ReleaseError(RuntimeError):
    """The previous release cannot be found or built; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Release:
    version: str
    commit: str

    @property
    def label(self) -> str:
        return f"{self.version} ({self.commit[:12]})"


def latest_release(changelog: str) -> Release:
    """The first released section of the CHANGELOG (newest first) and the 40-hex commit it
    names in backticks."""
    for found in SECTION.finditer(changelog):
        start = found.end()
        following = SECTION.search(changelog, start)
        body = changelog[start : following.start() if following else len(changelog)]
        commit = COMMIT.search(body)
        if commit is None:
            raise ReleaseError(
                f"CHANGELOG.md section [{found['version']}] names no commit: record the "
                "release's commit id in it as CONTRIBUTING.md's release process says "
                "(`abc...` with all 40 hex digits)"
            )
        return Release(found["version"], commit["commit"])
    raise ReleaseError(
        "CHANGELOG.md has no released section (## [X.Y.Z]): there is no previous release to "
        "upgrade from"
    )


def _git(*args: str, repo: Path = REPO) -> bytes:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    if done.returncode != 0:
        raise ReleaseError(f"git {' '.join(args)} failed: {done.stderr.decode(errors='replace')}")
    return done.stdout


def export_tree(commit: str, dest: Path, repo: Path = REPO) -> None:
    """The commit's files into ``dest`` (``git archive``)."""
    check = subprocess.run(
        ["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    if check.returncode != 0:
        raise ReleaseError(
            f"commit {commit} is not in the checkout at {repo}: a shallow clone lacks the "
            "history (git fetch --unshallow, or clone with fetch-depth 0)"
        )
    archive = _git("archive", "--format=tar", commit, repo=repo)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def _uv() -> list[str]:
    """uv: this Python's module (the tox env installs it), else the one on PATH."""
    done = subprocess.run(
        [sys.executable, "-m", "uv", "--version"], capture_output=True, check=False
    )
    if done.returncode == 0:
        return [sys.executable, "-m", "uv"]
    found = shutil.which("uv")
    if found is None:
        raise ReleaseError("uv is not installed: pip install uv (the tox env installs it)")
    return [found]


def _run(args: list[str], cwd: Path | None = None) -> None:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ReleaseError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def cached_venv(release: Release, cache_dir: Path) -> Path:
    return cache_dir / f"waltz-{release.version}-{release.commit[:12]}"


def is_complete(venv: Path, release: Release) -> bool:
    marker = venv / COMPLETE
    return marker.is_file() and marker.read_text().strip() == release.commit


def release_venv(release: Release, cache_dir: Path, repo: Path = REPO) -> tuple[Path, bool]:
    """The release's venv (built when the cache has none); True when it was built now.

    It is built where it stays (a venv's scripts name its path); the marker written last
    tells a complete one from what a killed build left (removed and built again)."""
    venv = cached_venv(release, cache_dir)
    if is_complete(venv, release):
        return venv, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    if venv.exists():
        shutil.rmtree(venv)
    uv = _uv()
    with tempfile.TemporaryDirectory(prefix="waltz-release-", dir=cache_dir) as tmp:
        tree, wheels = Path(tmp) / "tree", Path(tmp) / "wheels"
        tree.mkdir()
        export_tree(release.commit, tree, repo)
        _run([*uv, "build", "--all-packages", "--wheel", "--out-dir", str(wheels)], cwd=tree)
        chosen = sorted(
            str(w) for w in wheels.glob("*.whl") if not w.name.startswith(SKIPPED_WHEELS)
        )
        server = next((w for w in chosen if Path(w).name.startswith("waltz_server-")), None)
        if server is None:
            raise ReleaseError(f"commit {release.commit} built no waltz-server wheel")
        # every Waltz wheel given as a file (never a same-named one from an index);
        # the server's [default] extra: the plugins a cluster runs
        chosen[chosen.index(server)] = f"{server}[default]"
        _run([*uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
        python = venv / "bin" / "python"
        install = [*uv, "pip", "install", "--quiet", "--python", str(python)]
        _run([*install, "--find-links", str(wheels), *chosen])
    done = subprocess.run(
        [str(venv / "bin" / "waltz"), "--version"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise ReleaseError(
            f"the {release.label} venv at {venv} does not run `waltz --version`: {done.stderr}"
        )
    (venv / COMPLETE).write_text(release.commit + "\n")
    return venv, True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="where venvs are kept")
    args = parser.parse_args()
    release = latest_release((REPO / "CHANGELOG.md").read_text())
    started = time.monotonic()
    venv, built = release_venv(release, args.cache)
    what = "built" if built else "cached"
    print(f"{release.label}: {venv} ({what}, {time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
