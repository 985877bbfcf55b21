"""The ``--coordination`` option and reaching the coordination service, for every
command that reads or changes cluster metadata.

- ``--coordination URI`` (or ``$WALTZ_COORDINATION``, shown in ``--help``): a URI
  without a scheme (``127.0.0.1:2181``) is a usage error (exit 2) that suggests
  ``zk://127.0.0.1:2181/waltz``.
- ``--timeout SECONDS`` (5 by default; commands that reach storage nodes or
  servers share their own ``--timeout``): an unreachable coordination service
  ends the command with one line and exit code 1 after that long, instead of
  the plugin's own connect timeout, and without the client library's retry
  warnings (``-vv`` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from typing import Any

import click

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import WaltzError

DEFAULT_TIMEOUT = 5.0
COORDINATION_HELP = (
    "Coordination service URI, e.g. zk://127.0.0.1:2181/waltz (the scheme chooses the plugin)."
)
TIMEOUT_HELP = "Seconds to wait for the coordination service."
_TIMEOUT = "waltz.coordination_timeout"
_HOST_PORTS = re.compile(r"^[A-Za-z0-9.\-]+:\d+(,[A-Za-z0-9.\-]+:\d+)*(/.*)?$")
"""host:port[,host:port...][/root]: an ensemble's address without the URI's scheme."""


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


def remember_timeout(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """The callback of a ``--timeout`` that also bounds reaching the coordination service."""
    ctx.meta[_TIMEOUT] = value
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
        decorated = click.option(
            "--timeout",
            type=click.FloatRange(min=0.1),
            default=DEFAULT_TIMEOUT,
            show_default=True,
            expose_value=False,
            callback=remember_timeout,
            help=TIMEOUT_HELP,
        )(decorated)
    return decorated


def _timeout() -> float:
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return DEFAULT_TIMEOUT
    value = ctx.find_root().meta.get(_TIMEOUT, ctx.meta.get(_TIMEOUT, DEFAULT_TIMEOUT))
    return float(value)


async def start_coordination(uri: str, timeout: float | None = None) -> Coordination:
    """A started coordination client for ``uri``; WaltzError in one line when the service
    does not answer within ``timeout`` seconds (the command's ``--timeout``)."""
    wait = _timeout() if timeout is None else timeout
    coordination = coordination_from_uri(uri)
    # A plugin with its own connect timeout (zk, etcd) gives up by itself, and stops its
    # connecting thread (a wait cut short would leave kazoo's running for 15 s more).
    # Others (etcd, local) are cut at the wait itself.
    own = getattr(coordination, "connect_timeout", None)
    grace = 0.0
    if isinstance(own, int | float) and not isinstance(own, bool):
        grace = 5.0  # the plugin's own give-up comes first; this only guards a hang
        if own > wait:
            coordination.connect_timeout = wait  # type: ignore[attr-defined]
    try:
        await asyncio.wait_for(coordination.start(), wait + grace)
    except TimeoutError:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(coordination.close(), 5)
        raise WaltzError(
            f"the coordination service at {uri} did not answer within {wait:g}s; is it "
            "running and reachable? (--timeout waits longer)"
        ) from None
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(coordination.close(), 5)
        raise
    return coordination
