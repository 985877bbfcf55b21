"""``waltz dev``: run a whole cluster on this machine (see ``waltz_dev.dev``)."""

from __future__ import annotations

import asyncio
import signal
import time

import click

from waltz_api.errors import WaltzError


@click.command("dev")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=".waltz-dev",
    show_default=True,
    help="Where the cluster keeps everything; a second start reuses it and its data.",
)
@click.option(
    "--servers", type=click.IntRange(min=1), default=1, show_default=True, help="Waltz servers."
)
@click.option(
    "--storage-nodes",
    type=click.IntRange(min=1),
    default=None,
    help="Storage nodes (3 for a new cluster; an existing one keeps its number).",
)
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    default=None,
    help="Partitions (1 for a new cluster; an existing one keeps its number).",
)
@click.option(
    "--metrics",
    is_flag=True,
    help="Every process serves /livez, /readyz and Prometheus /metrics on a free "
    "loopback port; the URLs are printed (and in DATA_DIR/waltz-dev.ready.json).",
)
@click.option(
    "--console/--no-console",
    default=True,
    show_default=True,
    help="Also run `waltz console` (when waltz-console is installed; implies --metrics): "
    "its URL is printed, the token for its actions is in DATA_DIR/console.token.",
)
@click.option(
    "--archive",
    default="",
    help="Archive old records to this fsspec URL (e.g. file:///tmp/waltz-archive): "
    "tiered storage with the default retention (docs/archive.md).",
)
def dev_command(
    *,
    archive: str,
    data_dir: str,
    servers: int,
    storage_nodes: int | None,
    partitions: int | None,
    metrics: bool,
    console: bool,
) -> None:
    """Run a development cluster until Ctrl-C: local coordination, ZeroMQ on loopback,
    fs storage in DATA_DIR, 3 storage nodes and 1+ servers as child processes."""
    import importlib.util

    from waltz_dev.dev import DevCluster

    if console and importlib.util.find_spec("waltz_console") is None:
        click.echo("waltz dev: no console (pip install waltz-console to get one)", err=True)
        console = False
    cluster = DevCluster(
        data_dir,
        servers=servers,
        storage_nodes=storage_nodes,
        partitions=partitions,
        metrics=metrics,
        console=console,
        archive=archive,
    )

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            started = time.monotonic()
            click.echo(f"waltz dev: starting in {cluster.data_dir} ...")
            start = asyncio.ensure_future(cluster.start())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                start.cancel()  # Ctrl-C while starting: start() stops what it started
                await asyncio.gather(start, return_exceptions=True)
                click.echo("waltz dev: interrupted while starting; stopped")
                return 130
            stopped.cancel()
            start.result()
            info = cluster.info()
            verb = "created" if cluster.created else "reused"
            click.echo(
                f"waltz dev: ready in {time.monotonic() - started:.1f}s ({verb} cluster "
                f"{info['cluster_key']}, {info['partitions']} partition(s))"
            )
            click.echo(f"  coordination:  {info['coordination']}")
            click.echo("  transport:     zmq")
            for endpoint in info["servers"]:
                click.echo(f"  server:        {endpoint}")
            for endpoint in info["storage_nodes"]:
                click.echo(f"  storage node:  {endpoint}")
            for name, url in info["metrics"].items():
                click.echo(f"  metrics:       {url}/metrics  ({name}; /livez, /readyz)")
            if info["console"]:
                click.echo(
                    f"  console:       {info['console']}  (actions: the token in "
                    f"{info['console_token_file']})"
                )
            click.echo(f"  logs:          {info['logs']}")
            click.echo(f"  child pids:    {' '.join(str(p) for p in info['child_pids'])}")
            click.echo(
                "try: waltz cluster show --coordination "
                f"'{info['coordination']}'   (Ctrl-C stops the cluster)"
            )
            failed = await cluster.wait(stop)
            if failed is not None:
                code = None if failed.process is None else failed.process.returncode
                click.echo(
                    f"waltz dev: {failed.name} exited (code {code}); stopping. "
                    f"See {failed.log_path}",
                    err=True,
                )
            click.echo("waltz dev: stopping ...")
            await cluster.stop()
            click.echo("waltz dev: stopped")
            return 0 if failed is None else 1
        finally:
            await cluster.stop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    try:
        code = asyncio.run(run())
    except OSError as exc:
        raise WaltzError(f"waltz dev failed: {exc}") from exc
    if code:
        raise SystemExit(code)
