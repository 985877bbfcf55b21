"""Docs that run: every shell block of README.md and docs/*.md is executed as
written, or marked with why it is not.

A shell block is a fenced block with no language or sh, bash, shell, console (output,
trees and config files are tagged: text, toml, json, ini, ...). The line right before
it (blank lines between are allowed) is one marker:

    <!-- docs: run -->
        executed, exactly as written, by packages/waltz-server/tests/test_docs_run.py
        (tox -e unit): bash -e, in a fresh copy of the checkout (the files git tracks),
        HOME a temp dir, the test venv's bin first on PATH and linked as .venv, a timeout
    <!-- docs: run-background until "TEXT" -->
        started like `run`; once its output holds TEXT (within the timeout) its process
        group is sent SIGTERM and must be gone within a minute (a long-running command)
    <!-- docs: run-dist (note) -->
        executed, in doc order, by `tox -e dist` (`python .ci/docsrun/docsrun.py run
        run-dist`): one checkout for all, its Python first on PATH
    <!-- docs: covered-by PATH::TEST (reason) -->
        an existing test runs the same thing (the runner checks that PATH defines TEST)
    <!-- docs: illustrative (reason) -->
        not runnable here, and why (another host, root, a placeholder)

Absolute paths under /opt/waltz (and /opt/waltz-*), /etc/waltz and /tmp in a block
(and in an `until` text) are rooted in the run's temp dir: `/opt/waltz` runs as
`$ROOT/opt/waltz`.

`python .ci/docsrun/docsrun.py check` lists unmarked blocks and bad markers (exit 1).
Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL = frozenset({"", "sh", "bash", "shell", "console"})
KINDS = ("run", "run-background", "run-dist", "covered-by", "illustrative")
MARKER = re.compile(r"^\s*<!--\s*docs:\s*(?P<kind>\S+)\s*(?P<rest>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\S*)\s*$")
REASON = re.compile(r"\((?P<reason>.+)\)$")
UNTIL = re.compile(r'^until "(?P<until>[^"]+)"')
COVERED = re.compile(r"^(?P<path>[\w./-]+)::(?P<test>\w+)")
ROOTED = re.compile(
    r"(?:(?<![^\s'\"=:])|(?<=://))(?P<path>/opt/waltz[\w-]*|/etc/waltz|/tmp)(?=[/\s'\"]|$)"
)
BACKGROUND_STOP_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    language: str
    body: str
    kind: str | None  # the marker's kind; None: no marker
    rest: str  # the marker after its kind

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.language in SHELL

    @property
    def reason(self) -> str | None:
        found = REASON.search(self.rest)
        return found.group("reason").strip() if found else None

    @property
    def until(self) -> str | None:
        found = UNTIL.match(self.rest)
        return found.group("until") if found else None


def markdown_files(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def blocks_of(text: str, path: str) -> list[Block]:
    lines = text.split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = opening.group("indent")
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != f"{indent}```":
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before]) if before >= 0 else None
        found.append(
            Block(
                path=path,
                line=i + 1,
                language=opening.group("lang"),
                body=body,
                kind=marker.group("kind") if marker else None,
                rest=marker.group("rest") if marker else "",
            )
        )
        i = end + 1
    return found


def all_blocks(repo: Path = REPO) -> list[Block]:
    return [
        block
        for path in markdown_files(repo)
        for block in blocks_of(path.read_text(encoding="utf-8"), str(path.relative_to(repo)))
    ]


def problems(blocks: list[Block], repo: Path = REPO) -> list[str]:
    """What is wrong with the blocks' marking: one line each, saying what to do."""
    found = []
    for block in blocks:
        if block.kind is None:
            if block.is_shell:
                found.append(
                    f"{block.where}: an unmarked shell block: put `<!-- docs: run -->` "
                    "before it (or run-background, run-dist, covered-by, illustrative: "
                    ".ci/docsrun/docsrun.py), or tag output with a language (text)"
                )
            continue
        if not block.is_shell:
            found.append(f"{block.where}: a docs marker before a {block.language} block")
        elif block.kind not in KINDS:
            found.append(f"{block.where}: unknown docs marker {block.kind!r}; one of {KINDS}")
        elif block.kind in ("covered-by", "illustrative") and not block.reason:
            found.append(f"{block.where}: `{block.kind}` needs its reason in parentheses")
        elif block.kind == "run-background" and not block.until:
            found.append(f'{block.where}: `run-background` needs `until "TEXT"`')
        elif block.kind == "covered-by":
            found.extend(covered_by_problems(block, repo))
    return found


def covered_by_problems(block: Block, repo: Path) -> list[str]:
    named = COVERED.match(block.rest)
    if named is None:
        return [f"{block.where}: `covered-by` names no PATH::TEST"]
    test_file = repo / named.group("path")
    if not test_file.is_file():
        return [f"{block.where}: covered-by {named.group('path')}: no such file"]
    test = named.group("test")
    if not re.search(
        rf"^\s*(?:(?:async )?def {test}\(|class {test}\b)", test_file.read_text(), re.M
    ):
        return [f"{block.where}: covered-by {named.group(0)}: the file has no {test}"]
    return []


def rooted(text: str, root: Path) -> str:
    """``text`` with its /opt/waltz, /etc/waltz and /tmp paths under ``root``."""
    return ROOTED.sub(lambda m: f"{root}{m.group('path')}", text)


def make_checkout(repo: Path, dest: Path) -> Path:
    """A fresh checkout of ``repo``'s working tree: the files git tracks (and new ones
    it does not ignore), none of the build outputs, venvs or caches."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = repo / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


def prepare_root(root: Path) -> dict[str, str]:
    """The run's stand-ins for /opt, /etc, /tmp and HOME; the environment to run in."""
    for name in ("opt", "etc", "tmp", "home"):
        (root / name).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WALTZ_", "PYTHONPATH"))}
    # a fresh HOME, but the download caches of the real one (a fresh checkout, not a
    # fresh network): uv and pip find what they fetched before
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    env.setdefault("UV_CACHE_DIR", str(cache / "uv"))
    env.setdefault("PIP_CACHE_DIR", str(cache / "pip"))
    env.update(HOME=str(root / "home"), TMPDIR=str(root / "tmp"), LC_ALL="C.UTF-8")
    return env


@dataclasses.dataclass
class Outcome:
    ok: bool
    output: str
    seconds: float


def _stop_group(process: subprocess.Popen[bytes], deadline: float) -> bool:
    """SIGTERM to the process group ``process`` leads (it was started in its own
    session); True when the whole group is gone before ``deadline``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    while time.monotonic() < deadline:
        process.poll()
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    process.wait(timeout=30)
    return False


def run_block(
    block: Block, checkout: Path, root: Path, env: dict[str, str], timeout: float
) -> Outcome:
    """Runs ``block`` as written (its rooted paths aside) with bash -e in ``checkout``."""
    script = rooted(block.body, root)
    log = root / f"block-{Path(block.path).stem}-{block.line}.log"
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=checkout,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = started + timeout
    until = rooted(block.until, root) if block.kind == "run-background" and block.until else None
    ok = False
    while time.monotonic() < deadline:
        if until is not None and until in log.read_text(errors="replace"):
            stopped = _stop_group(process, time.monotonic() + BACKGROUND_STOP_SECONDS)
            text = log.read_text(errors="replace")
            note = "" if stopped else "\n(docs runner: still running a minute after SIGTERM)"
            return Outcome(stopped, text + note, time.monotonic() - started)
        if process.poll() is not None:
            ok = process.returncode == 0 and until is None
            break
        time.sleep(0.1)
    else:
        _stop_group(process, time.monotonic() + 10)
        text = log.read_text(errors="replace")
        return Outcome(False, f"{text}\n(docs runner: not done in {timeout:.0f} s)", timeout)
    text = log.read_text(errors="replace")
    if until is not None:
        text += f"\n(docs runner: it ended, {process.returncode}, before printing {until!r})"
    elif not ok:
        text += f"\n(docs runner: exit code {process.returncode})"
    return Outcome(ok, text, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", help="list unmarked shell blocks and bad markers")
    run = commands.add_parser("run", help="run every block of one marker kind, in doc order")
    run.add_argument("kind", choices=["run", "run-dist"])
    run.add_argument("--workdir", type=Path, required=True, help="holds checkout/ and root/")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds per block")
    args = parser.parse_args(argv)
    blocks = all_blocks()
    wrong = problems(blocks)
    for line in wrong:
        print(line, file=sys.stderr)
    if args.command == "check" or wrong:
        return 1 if wrong else 0
    shutil.rmtree(args.workdir, ignore_errors=True)
    checkout = make_checkout(REPO, args.workdir / "checkout")
    root = args.workdir / "root"
    env = prepare_root(root)
    chosen = [block for block in blocks if block.kind == args.kind]
    for block in chosen:
        print(f"--- {block.where} ({block.kind})\n{block.body}", end="", flush=True)
        outcome = run_block(block, checkout, root, env, args.timeout)
        print(outcome.output, end="", flush=True)
        print(f"--- {block.where}: {'ok' if outcome.ok else 'FAILED'} in {outcome.seconds:.1f} s")
        if not outcome.ok:
            return 1
    print(f"docs runner: {len(chosen)} {args.kind} block(s) ran as written", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
