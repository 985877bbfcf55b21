"""The `dist` tox environment's smoke test, on real processes, of the Waltz installed
from wheels with plain pip (docs/operators.md, "Install"):

- the server venv (`waltz-server[default]`): `waltz plugins list`, every command a
  server host needs (the client's commands come from their package), no storage node
  in it, `waltz cluster create` and one `waltz server` (/readyz 200);
- the storage venv (`waltz-storage-node[default]`): its plugins and commands (the fs
  engine's storage tools come from their package), no server in it, three
  `waltz storage` nodes (each /readyz 200);
- the client venv (`waltz-client[default]`): a client appends and reads back
  (.ci/distcheck/client.py), and `waltz client high-water-mark` answers;
- every process stopped with SIGTERM exits 0.

Standard library only: it runs on any Python 3.11+.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(*args: str | Path, timeout: float = 120) -> str:
    print("$", " ".join(str(a) for a in args), flush=True)
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False
    )
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {done.stderr}")
    return done.stdout


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise SystemExit(f"{log.name} exited ({process.returncode}): {log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}/readyz not 200 after {timeout}s: {log.read_text()}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server-venv", type=Path, required=True)
    parser.add_argument("--storage-venv", type=Path, required=True)
    parser.add_argument("--client-venv", type=Path, required=True)
    args = parser.parse_args()
    waltz = args.server_venv / "bin" / "waltz"
    storage_waltz = args.storage_venv / "bin" / "waltz"
    check_role(
        args.server_venv,
        plugins=("zk", "local", "zmq", "hwm-array", "exact"),
        commands=("cluster", "server", "acl", "client", "perf", "keys"),
        has="waltz_server",
        lacks="waltz_storage_node",
    )
    check_role(
        args.storage_venv,
        plugins=("zmq", "fs"),
        commands=("storage", "keys", "verify", "snapshot"),
        has="waltz_storage_node",
        lacks="waltz_server",
    )

    work = Path(tempfile.mkdtemp(prefix="waltz-dist-"))
    uri = f"local://{work / 'coordination'}?root=/waltz"
    key = str(uuid.uuid4())
    storage_ports = [free_port() for _ in range(3)]
    run(
        waltz, "cluster", "create", "--coordination", uri, "--partitions", "2",
        "--replicas", "3", "--cluster-key", key,
        *[a for p in storage_ports for a in ("--storage", f"127.0.0.1:{p}")],
    )  # fmt: skip
    processes: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for i, port in enumerate(storage_ports):
            http = free_port()
            config = work / f"storage-{i}.toml"
            config.write_text(
                f'[storage]\ndata_dir = "{work / f"storage-{i}"}"\ncluster_key = "{key}"\n'
                "num_partitions = 2\npartitions = [0, 1]\n"
                f'[transport]\nendpoint = "tcp://127.0.0.1:{port}"\n'
                f"[http]\nenabled = true\nport = {http}\n"
            )
            command = [storage_waltz, "storage", "--config", config]
            processes.append(start(f"storage-{i}", command, work))
            wait_ready(f"http://127.0.0.1:{http}", processes[-1][1], processes[-1][2])
        http = free_port()
        config = work / "server.toml"
        config.write_text(
            f'[coordination]\nuri = "{uri}"\n[transport]\n'
            f'endpoint = "tcp://127.0.0.1:{free_port()}"\nstorage_endpoint = "tcp://{{}}"\n'
            f"[http]\nenabled = true\nport = {http}\n"
        )
        processes.append(start("server", [waltz, "server", "--config", config], work))
        wait_ready(f"http://127.0.0.1:{http}", processes[-1][1], processes[-1][2])
        run(args.client_venv / "bin" / "python", HERE / "client.py", uri, timeout=180)
        mark = run(
            args.client_venv / "bin" / "waltz", "client", "high-water-mark",
            "--coordination", uri, "--partition", "0", timeout=120,
        )  # fmt: skip
        if mark.strip() != "19":
            raise SystemExit(f"`waltz client high-water-mark` in the client venv said {mark!r}")
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        if 'waltz_server_appended_transactions_total{partition="0"} 20.0' not in metrics:
            raise SystemExit("the server's /metrics does not count the 20 appends")
    finally:
        failed = stop(processes)
    if failed:
        raise SystemExit(f"not a clean exit on SIGTERM: {failed}")
    shutil.rmtree(work, ignore_errors=True)
    print("dist smoke test: 1 passed, 0 failed", flush=True)


def check_role(
    venv: Path, *, plugins: tuple[str, ...], commands: tuple[str, ...], has: str, lacks: str
) -> None:
    """The venv of one role: its plugins and commands, its product installed from the
    venv's wheels, and not the other product."""
    waltz = venv / "bin" / "waltz"
    listed = run(waltz, "plugins", "list")
    for plugin in plugins:
        if f"  {plugin} " not in listed:
            raise SystemExit(f"`waltz plugins list` in {venv} does not show {plugin}")
    text = run(waltz, "--help")
    if "storage" in commands:
        text += run(waltz, "storage", "--help")
    for command in commands:
        if f"  {command} " not in text:
            raise SystemExit(f"the `waltz` of {venv} has no command {command!r}")
    where = run(venv / "bin" / "python", "-c", f"import {has}; print({has}.__file__)")
    if not where.startswith(str(venv.resolve())):
        raise SystemExit(f"{has} comes from {where}, not from the wheels in {venv}")
    other = run(
        venv / "bin" / "python",
        "-c",
        f"import importlib.util; print(importlib.util.find_spec({lacks!r}) is None)",
    )
    if other.strip() != "True":
        raise SystemExit(f"{lacks} is installed in {venv}: a role's install must not need it")


def start(
    name: str, args: list[str | Path], work: Path, env: dict[str, str] | None = None
) -> tuple[str, subprocess.Popen[bytes], Path]:
    log = work / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(a) for a in args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    print(f"started {name} (pid {process.pid})", flush=True)
    return name, process, log


def stop(processes: list[tuple[str, subprocess.Popen[bytes], Path]]) -> list[str]:
    """SIGTERM (servers first), by pid; the names that did not exit 0 in 30 s."""
    failed = []
    for name, process, log in reversed(processes):
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait(timeout=30)
        if code != 0:
            failed.append(f"{name} exited {code}: {log.read_text()[-2000:]}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
