"""``waltz console``: the click command (contributed to the ``waltz`` command line by
:mod:`waltz_console.plugin`, imported when it is chosen)."""

from __future__ import annotations

import json
from typing import Any

import click


def _options(pairs: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"takes KEY=VALUE, got {pair!r}", param_hint="--transport-option"
            )
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


@click.command("console")
@click.option(
    "--coordination",
    "uri",
    required=True,
    envvar="WALTZ_COORDINATION",
    show_envvar=True,
    help="Coordination service URI of the cluster (zk://..., etcd://..., local://...).",
)
@click.option(
    "--listen",
    default="127.0.0.1:8090",
    show_default=True,
    help="HOST:PORT the console serves its page on (port 0 picks a free one).",
)
@click.option(
    "--http",
    "http_urls",
    multiple=True,
    metavar="URL",
    help="The HTTP endpoint (/status, /metrics) of a server or storage node, e.g. "
    "http://10.0.0.5:9500; repeat for each process.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="File holding the token that unlocks actions (made, mode 0600, when missing); "
    "WALTZ_CONSOLE_TOKEN overrides it. Without either a new token is printed at start.",
)
@click.option("--transport", default="zmq", show_default=True, help="Transport plugin.")
@click.option(
    "--transport-option",
    "transport_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="A transport option (JSON value or text); repeatable.",
)
@click.option(
    "--storage-endpoint",
    default="tcp://{}",
    show_default=True,
    help="A storage node's endpoint from its host:port ({}), as in the servers' config.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between two reads of the processes' endpoints.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds to wait for a server or storage node (transactions, actions).",
)
@click.option("--log-level", default="INFO", show_default=True, help="Log level.")
def console_command(
    *,
    uri: str,
    listen: str,
    http_urls: tuple[str, ...],
    token_file: str | None,
    transport: str,
    transport_options: tuple[str, ...],
    storage_endpoint: str,
    interval: float,
    timeout: float,
    log_level: str,
) -> None:
    """Serve the web console of the cluster at URI: live servers, storage nodes,
    partitions, clients, events and transactions; actions after logging in."""
    from waltz_console.main import ConsoleConfig, run

    run(
        ConsoleConfig(
            coordination=uri,
            listen=listen,
            http_urls=list(http_urls),
            token_file=token_file,
            transport=transport,
            transport_options=_options(transport_options),
            storage_endpoint=storage_endpoint,
            interval=interval,
            timeout=timeout,
        ),
        log_level=log_level.upper(),
    )
