"""``--timeout SECONDS``: how long a command waits for the cluster, and what happens then.

Every command that talks to a cluster (its coordination service, a server, a storage
node) takes ``--timeout`` (:data:`DEFAULT_TIMEOUT` seconds unless given) and ends within
it when what it waits for does not answer: one ``error:`` line on stderr and exit code
:data:`UNAVAILABLE_EXIT_CODE` (4), the code of every
:class:`~waltz_api.errors.UnavailableError`. A connection refused at once (nothing
listens there) is reported at once, not after the timeout. Commands that run on
(``client tail``, ``perf``) count the timeout from their last progress instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import click

from waltz_api.errors import UnavailableError

T = TypeVar("T")

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
"""The default of every command's ``--timeout``, in seconds."""
UNAVAILABLE_EXIT_CODE = 4
"""The exit code of a command the cluster did not answer in time (or refused)."""
TIMEOUT_HELP = (
    "Seconds to wait for the cluster (coordination service, servers, storage nodes); "
    "past it the command ends with exit code 4."
)
GUARD_MARGIN = 1.0
"""Seconds :func:`run` waits past the timeout before it cuts the command short: the
command's own waits, bounded by the timeout, end first and say best what failed."""
CLOSE_GRACE = 2.0
"""Seconds a command that ran out of time has to close what it opened."""
REFUSAL_PROBE = 1.0
"""Seconds to tell a refused connection from a slow one (see :func:`refused`)."""
_TIMEOUT = "waltz.timeout"


def remember_timeout(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """The callback of a ``--timeout``: the value :func:`command_timeout` returns."""
    ctx.meta[_TIMEOUT] = value
    return value


def timeout_option(
    help: str = TIMEOUT_HELP, *, expose: bool = True
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--timeout SECONDS`` (passed as ``timeout`` when ``expose``)."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=0.1),
        default=DEFAULT_TIMEOUT,
        show_default=True,
        expose_value=expose,
        callback=remember_timeout,
        help=help,
    )


def command_timeout() -> float:
    """The running command's ``--timeout`` (:data:`DEFAULT_TIMEOUT` outside a command)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return DEFAULT_TIMEOUT
    return float(ctx.meta.get(_TIMEOUT, DEFAULT_TIMEOUT))


def late(what: str, timeout: float) -> UnavailableError:
    """The error of ``what`` not answering within ``timeout`` seconds."""
    return UnavailableError(
        f"{what} did not answer within {timeout:g}s; is it running and reachable? "
        "(--timeout waits longer)"
    )


def run(
    main: Callable[[], Awaitable[T]],
    *,
    waiting_for: str | Callable[[], str] = "the cluster",
    timeout: float | None = None,
) -> T:
    """``asyncio.run(main())``, ended after ``timeout`` seconds (the command's
    ``--timeout`` by default; and :data:`GUARD_MARGIN`) with :func:`late`'s error
    naming ``waiting_for`` (a callable says what is awaited at that moment). ``main``
    is cancelled then, and has :data:`CLOSE_GRACE` seconds to close what it opened."""
    wait = command_timeout() if timeout is None else timeout

    async def bounded() -> T:
        task = asyncio.ensure_future(main())
        done, _ = await asyncio.wait({task}, timeout=wait + GUARD_MARGIN)
        if task in done:
            return task.result()
        what = waiting_for() if callable(waiting_for) else waiting_for
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=CLOSE_GRACE)
        if task.done() and not task.cancelled() and task.exception() is not None:
            # it failed on its own as it was cancelled: its error says more
            error = task.exception()
            assert error is not None
            if not isinstance(error, asyncio.CancelledError):
                raise error
        raise late(what, wait)

    return asyncio.run(bounded())


async def refused(addresses: Iterable[tuple[str, int]], timeout: float = REFUSAL_PROBE) -> bool:
    """Whether every one of ``addresses`` (host, port) refuses a TCP connection now (a
    closed port: nothing listens there), as far as ``timeout`` seconds tell. False when
    one accepts, or does not answer in time (a slow or filtered address is left to the
    caller's own wait)."""
    targets = list(addresses)
    if not targets:
        return False

    async def probe(host: str, port: int) -> bool:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # unreachable, unknown host...: not a refusal
        writer.transport.abort()  # (a silent peer never closes its side: no wait)
        return False

    try:
        async with asyncio.timeout(timeout):
            answers = await asyncio.gather(*(probe(host, port) for host, port in targets))
    except TimeoutError:
        return False
    return all(answers)


def tcp_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` endpoint; None for another kind."""
    if not endpoint.startswith("tcp://"):
        return None
    host, colon, port = endpoint[len("tcp://") :].rpartition(":")
    if not colon or not host or not port.isdigit() or host == "*":
        return None
    return host.strip("[]"), int(port)
