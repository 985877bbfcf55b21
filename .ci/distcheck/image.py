"""The `dist` tox environment's replay of the container image (there is no container
engine in CI): deploy/container/install-waltz.sh, the script the Dockerfile runs,
builds its wheels from a fresh checkout and installs them into a fresh venv; then the
image's own configs (deploy/config/*.toml, as the Dockerfile copies them to
/etc/waltz) start what deploy/compose.yaml starts, on loopback and `local`
coordination instead of ZooKeeper: `waltz cluster create` with the compose file's
key and shape, three `waltz storage` nodes and a `waltz server` (each /readyz 200),
then `waltz client append` and `high-water-mark` from the same venv; every process
stopped with SIGTERM by its pid must exit 0.

Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from smoke import free_port, start, stop, wait_ready

HERE = Path(__file__).resolve().parent


def run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    print("$", " ".join(str(a) for a in args), flush=True)
    done = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=cwd,
        env=env,
    )
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkout", type=Path, required=True, help="a fresh checkout")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    checkout: Path = args.checkout.resolve()
    work: Path = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    script = checkout / "deploy" / "container" / "install-waltz.sh"
    dockerfile = (checkout / "deploy" / "container" / "Dockerfile").read_text(encoding="utf-8")
    for step in ("install-waltz.sh wheels /wheels", "install-waltz.sh install /wheels /opt/waltz"):
        if step not in dockerfile:
            raise SystemExit(f"the Dockerfile no longer runs `{step}`: replay what it runs")
    python = {"PYTHON": sys.executable}
    run("sh", script, "wheels", work / "wheels", cwd=checkout, env={**os.environ, **python})
    venv = work / "opt-waltz"
    run("sh", script, "install", work / "wheels", venv, env={**os.environ, **python})
    waltz = venv / "bin" / "waltz"

    storage_config = checkout / "deploy" / "config" / "storage.toml"
    server_config = checkout / "deploy" / "config" / "server.toml"
    storage = tomllib.loads(storage_config.read_text(encoding="utf-8"))["storage"]
    compose = (checkout / "deploy" / "compose.yaml").read_text(encoding="utf-8")
    create = re.search(r"cluster create .*?--partitions (\d+) --replicas (\d+)", compose, re.S)
    if create is None or f"--cluster-key {storage['cluster_key']}" not in compose:
        raise SystemExit("deploy/compose.yaml's cluster create no longer matches storage.toml")
    uri = f"local://{work / 'coordination'}?root=/waltz"
    ports = [free_port() for _ in range(3)]
    run(
        waltz, "cluster", "create", "--coordination", uri,
        "--partitions", create.group(1), "--replicas", create.group(2),
        "--cluster-key", storage["cluster_key"],
        *[a for p in ports for a in ("--storage", f"127.0.0.1:{p}")],
    )  # fmt: skip
    # what the compose file sets, and where a container's network differs: loopback
    base = {k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")}
    base["WALTZ_LOG_FORMAT"] = "json"
    processes: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for i, port in enumerate(ports):
            http = free_port()
            env = {
                **base,
                "WALTZ_STORAGE__DATA_DIR": str(work / f"storage{i + 1}"),
                "WALTZ_TRANSPORT__ENDPOINT": f"tcp://127.0.0.1:{port}",
                "WALTZ_HTTP__HOST": "127.0.0.1",
                "WALTZ_HTTP__PORT": str(http),
            }
            command = [waltz, "storage", "--config", storage_config]
            processes.append(start(f"storage{i + 1}", command, work, env))
            wait_ready(f"http://127.0.0.1:{http}", processes[-1][1], processes[-1][2])
        http = free_port()
        env = {
            **base,
            "WALTZ_COORDINATION__URI": uri,
            "WALTZ_TRANSPORT__ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
            "WALTZ_HTTP__HOST": "127.0.0.1",
            "WALTZ_HTTP__PORT": str(http),
        }
        command = [waltz, "server", "--config", server_config]
        processes.append(start("server1", command, work, env))
        wait_ready(f"http://127.0.0.1:{http}", processes[-1][1], processes[-1][2])
        run(waltz, "client", "append", "--coordination", uri, "--partition", "3", "--data", "hi")
        mark = run(waltz, "client", "high-water-mark", "--coordination", uri, "--partition", "3")
        if mark.strip() != "0":
            raise SystemExit(f"`waltz client high-water-mark` said {mark!r}, not 0")
    finally:
        failed = stop(processes)
    if failed:
        raise SystemExit(f"not a clean exit on SIGTERM: {failed}")
    shutil.rmtree(work, ignore_errors=True)
    print("image replay: 1 passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()
