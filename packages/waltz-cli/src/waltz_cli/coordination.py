"""The ``--coordination`` option and reaching the coordination service, for every
command that reads or changes cluster metadata.

- ``--coordination URI`` (or ``$WALTZ_COORDINATION``, shown in ``--help``): a URI
  without a scheme (``127.0.0.1:2181``) is a usage error (exit 2) that suggests
  ``zk://127.0.0.1:2181/waltz``.
- ``--timeout SECONDS`` (:mod:`waltz_cli.deadline`; commands that reach storage nodes
  or servers share their own ``--timeout``): an unreachable coordination service ends
  the command with one line and exit code 4 after that long, instead of the plugin's
  own connect timeout, and without the client library's retry warnings (``-vv`` shows
  them); one that refuses the connection (nothing listens at its address) at once.
- A ``local`` location that does not exist is refused, naming the path (the plugin
  would make an empty one), except by ``waltz cluster create``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import click

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import CoordinationUnavailableError, PluginError
from waltz_cli.deadline import (
    DEFAULT_TIMEOUT,
    GUARD_MARGIN,
    REFUSAL_PROBE,
    TIMEOUT_HELP,
    command_timeout,
    refused,
    remember_timeout,
    timeout_option,
)

__all__ = [
    "COORDINATION_HELP",
    "DEFAULT_TIMEOUT",
    "TIMEOUT_HELP",
    "check_uri",
    "coordination_option",
    "remember_timeout",
    "start_coordination",
]

COORDINATION_HELP = (
    "Coordination service URI, e.g. zk://127.0.0.1:2181/waltz (the scheme chooses the plugin)."
)
_HOST_PORTS = re.compile(r"^[A-Za-z0-9.\-]+:\d+(,[A-Za-z0-9.\-]+:\d+)*(/.*)?$")
"""host:port[,host:port...][/root]: an ensemble's address without the URI's scheme."""
_JOIN_ONLY: dict[str, dict[str, Any]] = {"local": {"create": False}}
"""Per coordination plugin, the options of a client that joins an existing cluster:
the embedded one would create a missing directory (a server's first start does)."""


def check_uri(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A usage error, with the likely URI, when ``value`` is host:port without a scheme
    (anything else goes to the plugin registry, whose error lists the schemes)."""
    if value and _HOST_PORTS.match(value):
        guess = value.strip("/")
        raise click.BadParameter(
            f"{value!r} has no scheme: did you mean zk://{guess}/waltz? "
            "(zk://host:port/root, etcd://host:port/root or local:///dir)",
            ctx=ctx,
            param=param,
        )
    return value


def coordination_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--coordination URI`` (required), and ``--timeout`` unless the command has one
    (decorate below the command's other options: they are known then)."""
    params = getattr(func, "__click_params__", [])
    decorated = click.option(
        "--coordination",
        "uri",
        required=True,
        envvar="WALTZ_COORDINATION",
        show_envvar=True,
        callback=check_uri,
        help=COORDINATION_HELP,
    )(func)
    if not any(p.name == "timeout" for p in params):
        decorated = timeout_option(expose=False)(decorated)
    return decorated


def addresses(uri: str) -> list[tuple[str, int]]:
    """The (host, port) pairs of a network coordination URI
    (``zk://h1:2181,h2:2181/root``); none for one without (``local:///dir``)."""
    try:
        netloc = urlsplit(uri).netloc
    except ValueError:
        return []
    found = []
    for part in netloc.rpartition("@")[2].split(","):
        host, colon, port = part.strip().rpartition(":")
        if colon and host and port.isdigit():
            found.append((host.strip("[]"), int(port)))
    return found


async def start_coordination(
    uri: str, timeout: float | None = None, *, create: bool = False
) -> Coordination:
    """A started coordination client for ``uri``; WaltzError in one line when the service
    does not answer within ``timeout`` seconds (the command's ``--timeout``), at once
    when it refuses the connection. ``create``: a ``local`` location may be made (``waltz
    cluster create``); otherwise one that does not exist is refused."""
    wait = command_timeout() if timeout is None else timeout
    coordination = coordination_from_uri(uri, {} if create else _join_options(uri))
    network = addresses(uri)
    if network and await refused(network, min(REFUSAL_PROBE, wait)):
        listed = ", ".join(f"{host}:{port}" for host, port in network)
        raise CoordinationUnavailableError(
            f"the coordination service at {uri} refused the connection (nothing listens "
            f"at {listed}); is it running, and is the address right?"
        )
    # A plugin with its own connect timeout (zk) gives up by itself at the wait, and says
    # why if it can tell within the margin; its connecting thread stops in the background.
    # Others (etcd, local) are cut at the wait itself.
    own = getattr(coordination, "connect_timeout", None)
    grace = 0.0
    if isinstance(own, int | float) and not isinstance(own, bool):
        grace = GUARD_MARGIN
        if own > wait:
            coordination.connect_timeout = wait  # type: ignore[attr-defined]
    try:
        await asyncio.wait_for(coordination.start(), wait + grace)
    except TimeoutError:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(coordination.close(), 5)
        raise CoordinationUnavailableError(
            f"the coordination service at {uri} did not answer within {wait:g}s; is it "
            "running and reachable? (--timeout waits longer)"
        ) from None
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(coordination.close(), 5)
        raise
    return coordination


def _join_options(uri: str) -> dict[str, Any]:
    from waltz_api.plugins import get_registry

    try:
        name = get_registry().resolve("coordination", uri).name
    except PluginError:
        return {}  # coordination_from_uri says why
    return dict(_JOIN_ONLY.get(name, {}))
