"""``waltz client``: append to, tail, and ask the high-water mark of a partition.

A real Waltz client (``waltz_client.AsyncWaltzClient``) against a running
cluster, found through its coordination service (``--coordination`` or
``WALTZ_COORDINATION``)::

    waltz client append --coordination URI --partition 0 --data hello --data world
    printf 'a\\nb\\n' | waltz client append --coordination URI --partition 0
    waltz client tail --coordination URI --partition 0 [--from 10] [--follow]
    waltz client high-water-mark --coordination URI --partition 0

``--timeout`` (:mod:`waltz_cli.deadline`) bounds every wait for the cluster: reaching
the coordination service and the partition's server, each append's commit, and
``tail``'s catching up (from its last transaction on). Past it the command ends with
one line and exit code 4. The client library's own warnings (a server it cannot
reach, a refusal) are left to that line; ``-v`` shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import click

from waltz_api.errors import (
    ClientAheadError,
    ConfigError,
    ServerError,
    UnavailableError,
    WaltzError,
)
from waltz_cli.coordination import check_uri, start_coordination
from waltz_cli.deadline import late, timeout_option
from waltz_cli.devfile import DEFAULT_DEV_DIR, read_ready_file
from waltz_cli.output import emit, output_is_json, output_option
from waltz_cli.transport import parse_transport_options, transport_options

if TYPE_CHECKING:
    from waltz_client import (
        AsyncWaltzClient,
        Transaction,
        TransactionBuilder,
    )

T = TypeVar("T")

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
CLOSE_TIMEOUT = 5.0
"""Seconds the client has to close once the command is done (or out of time)."""

COORDINATION_HELP = "Coordination service URI of the cluster (e.g. from `waltz dev`)."


def _default_coordination(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """No --coordination: the ``waltz dev`` cluster running in ./.waltz-dev, if any."""
    if value:
        checked: str = check_uri(ctx, param, value) or value
        return checked
    info = read_ready_file(DEFAULT_DEV_DIR)
    if info is None:
        raise ConfigError(
            "give --coordination URI (or set WALTZ_COORDINATION), or start `waltz dev` in "
            "this directory",
            key="coordination",
        )
    uri: str = info["coordination"]
    return uri


def _coordination_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--coordination",
        "uri",
        default=None,
        envvar="WALTZ_COORDINATION",
        show_envvar=True,
        callback=_default_coordination,
        help=COORDINATION_HELP + " Default: the `waltz dev` running in ./.waltz-dev.",
    )(f)


def _partition_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--partition", type=click.IntRange(min=0), default=0, show_default=True)(f)


def _lock(spec: str, option: str) -> tuple[str, int]:
    """NAME:ID; a usage error (exit 2) otherwise."""
    name, sep, lock_id = spec.rpartition(":")
    try:
        if not sep or not name:
            raise ValueError(spec)
        return name, int(lock_id)
    except ValueError:
        raise click.BadParameter(
            f"takes NAME:ID (e.g. account:7), got {spec!r}", param_hint=option
        ) from None


@contextlib.contextmanager
def _quiet_client_library() -> Iterator[None]:
    """Without -v, the client library's warnings and errors stay quiet while the command
    runs: its one error line says what failed (a refusal would otherwise be printed
    twice). The levels are restored after (a command run in-process leaves none)."""
    if logging.getLogger().getEffectiveLevel() <= logging.INFO:
        yield
        return
    loggers = [logging.getLogger(name) for name in ("waltz_client", "waltz_transport_zmq")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _run(
    uri: str,
    transport: tuple[str, tuple[str, ...]],
    partition: int,
    *,
    timeout: float,
    start_hwm: int,
    work: Callable[[AsyncWaltzClient, Any, float], Awaitable[T]],
    on_transaction: Callable[[Transaction], Awaitable[None]] | None = None,
) -> T:
    """Start a client mounted on ``partition`` only (its feed from ``start_hwm``), run
    ``work(client, callbacks, deadline)`` (``deadline``: the loop time by which the
    cluster must have answered), close the client. Reaching the cluster is bounded by
    ``timeout``; so are the client's requests and appends (its config)."""
    try:
        from waltz_client import AsyncWaltzClient, ClientConfig, WaltzClientCallbacks
    except ImportError as exc:  # pragma: no cover - the workspace installs it
        raise WaltzError(f"`waltz client` needs the waltz-client package ({exc})") from exc

    class Callbacks(WaltzClientCallbacks):
        def __init__(self) -> None:
            self.hwm = start_hwm
            self.error: BaseException | None = None
            self.progress = asyncio.Event()

        async def client_high_water_mark(self, partition_id: int) -> int:
            return self.hwm

        async def apply_transaction(self, transaction: Transaction) -> None:
            if on_transaction is not None:
                await on_transaction(transaction)
            self.hwm = transaction.transaction_id
            self.progress.set()

        def uncaught_exception(
            self, partition_id: int, transaction_id: int, exception: BaseException
        ) -> None:
            self.error = exception
            self.progress.set()

    options = parse_transport_options(transport[1])

    async def main() -> T:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        callbacks = Callbacks()
        coordination = await start_coordination(uri, timeout)
        left = max(deadline - loop.time(), 0.1)
        config = ClientConfig(
            coordination,
            transport=transport[0],
            transport_options=options,
            partitions=[partition],
            # a connection that does not answer is given up within half the wait, so
            # what the command reports past it says why (no answer from ENDPOINT)
            connect_timeout=min(max(left / 2, 0.1), 10.0),
            request_timeout=left,
            transaction_timeout=left,
        )
        client = AsyncWaltzClient(callbacks, config)
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await client.start()
            except TimeoutError:
                raise late(f"the coordination service at {uri}", timeout) from None
            if partition >= client.num_partitions:
                raise ConfigError(
                    f"partition {partition} does not exist: the cluster has "
                    f"{client.num_partitions} (0 to {client.num_partitions - 1})",
                    key="partition",
                )
            return await work(client, callbacks, deadline)
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await client.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await coordination.close()

    with _quiet_client_library():
        return asyncio.run(main())


async def _high_water_mark(client: AsyncWaltzClient, partition: int, deadline: float) -> int:
    """The partition's high-water mark as its server tells it, by ``deadline``."""
    left = max(deadline - asyncio.get_running_loop().time(), 0.1)
    try:
        return await client.high_water_mark(partition, timeout=left)
    except ServerError as exc:
        if type(exc) is not ServerError:  # a refusal, a client ahead...: said as it is
            raise
        # no answer from the partition's server in time
        raise UnavailableError(f"{exc} (--timeout waits longer)") from None


def _timeout_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return timeout_option(
        "Seconds to wait for the cluster: its coordination service, the partition's "
        "server, each append's commit (tail: the next transaction while catching up); "
        "past it the command ends with exit code 4."
    )(f)


@click.group("client")
def client_group() -> None:
    """A client of a running cluster: append, tail, high-water-mark."""


@client_group.command("append")
@_coordination_option
@_partition_option
@transport_options
@click.option(
    "--data",
    "data",
    multiple=True,
    help="A transaction's data (UTF-8); repeat for several. Default: one per line of stdin.",
)
@click.option(
    "--header",
    type=click.IntRange(INT32_MIN, INT32_MAX),
    default=0,
    show_default=True,
    help="The transactions' header, a signed 32-bit integer.",
)
@click.option("--write-lock", multiple=True, metavar="NAME:ID", help="A WRITE lock; repeatable.")
@click.option("--read-lock", multiple=True, metavar="NAME:ID", help="A READ lock; repeatable.")
@click.option("--append-lock", multiple=True, metavar="NAME:ID", help="An APPEND lock.")
@_timeout_option
def append_command(  # noqa: PLR0917 - click passes options by name
    uri: str,
    partition: int,
    transport: str,
    transport_options: tuple[str, ...],
    data: tuple[str, ...],
    header: int,
    write_lock: tuple[str, ...],
    read_lock: tuple[str, ...],
    append_lock: tuple[str, ...],
    timeout: float,
) -> None:
    """Append transactions and print the id each was committed at (each committed
    within --timeout, or the command ends: exit code 4)."""
    from waltz_client import (
        TransactionContext,
        TransactionExpiredError,
        TransactionOutcomeUnknownError,
    )

    locks = (
        [("write", *_lock(s, "--write-lock")) for s in write_lock]
        + [("read", *_lock(s, "--read-lock")) for s in read_lock]
        + [("append", *_lock(s, "--append-lock")) for s in append_lock]
    )
    items = list(data) if data else [line.rstrip("\n") for line in sys.stdin]
    if not items:
        raise ConfigError("nothing to append: give --data TEXT or lines on stdin", key="data")

    class Append(TransactionContext):
        def __init__(self, payload: bytes) -> None:
            super().__init__()
            self.payload = payload
            self.transaction_id = -1

        def partition_id(self, num_partitions: int) -> int:
            return partition

        async def execute(self, builder: TransactionBuilder) -> bool:
            builder.set_header(header).set_data(self.payload)
            for mode, name, lock_id in locks:
                getattr(builder, f"{mode}_lock")(name, lock_id)
            return True

        def on_application(self, transaction_id: int) -> None:
            self.transaction_id = transaction_id

    async def work(client: AsyncWaltzClient, callbacks: Any, deadline: float) -> list[int]:
        ids = []
        for item in items:
            context = Append(item.encode())
            try:
                committed = await client.submit(context)
            except TransactionExpiredError as exc:
                raise UnavailableError(
                    f"partition {partition}: {exc} (--timeout waits longer)"
                ) from None
            except TransactionOutcomeUnknownError as exc:
                raise UnavailableError(
                    f"partition {partition}: {exc}; it may be committed (see `waltz client tail`)"
                ) from None
            if not committed:
                raise WaltzError(f"the append of {item!r} was not committed")
            ids.append(context.transaction_id)
            click.echo(f"appended transaction {context.transaction_id} to partition {partition}")
        return ids

    _run(
        uri,
        (transport, transport_options),
        partition,
        timeout=timeout,
        start_hwm=-1,
        work=work,
    )


@client_group.command("tail")
@_coordination_option
@_partition_option
@transport_options
@click.option("--from", "start", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Print at most N.")
@click.option("--follow", is_flag=True, help="Keep printing new transactions until Ctrl-C.")
@click.option("--no-data", is_flag=True, help="Print ids and headers only (no data fetch).")
@_timeout_option
@output_option
def tail_command(  # noqa: PLR0917 - click passes options by name
    uri: str,
    partition: int,
    transport: str,
    transport_options: tuple[str, ...],
    start: int,
    limit: int | None,
    follow: bool,
    no_data: bool,
    timeout: float,
    output: str,
) -> None:
    """Print the partition's transactions (id, header, data) from --from on: tab-separated
    lines (text), aligned columns (table) or one JSON object per line (json)."""
    printed = [0]
    done = asyncio.Event()
    as_json = output_is_json(output)
    if output == "table":
        click.echo("TRANSACTION_ID  HEADER      " + ("" if no_data else "DATA"))

    async def show(transaction: Transaction) -> None:
        if done.is_set():
            return
        data = None
        if not no_data:
            raw = await transaction.fetch_data()
            data = raw.decode("utf-8", errors="backslashreplace")
        if as_json:
            row = {"transaction_id": transaction.transaction_id, "header": transaction.header}
            line = json.dumps(row if data is None else {**row, "data": data})
        elif output == "table":
            line = f"{transaction.transaction_id:<14}  {transaction.header:<10}  {data or ''}"
        else:
            line = f"{transaction.transaction_id}\t{transaction.header}"
            if data is not None:
                line += "\t" + data
        click.echo(line.rstrip())
        printed[0] += 1
        if limit is not None and printed[0] >= limit:
            done.set()

    async def work(client: AsyncWaltzClient, callbacks: Any, deadline: float) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if follow:  # first: the feed may print before the high-water mark is answered
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
        try:
            # the server answers (--follow too: a dead server is reported, not waited on)
            top = await _high_water_mark(client, partition, deadline)
            if start > top + 1:
                raise WaltzError(
                    f"--from {start} is beyond the end of partition {partition} (its "
                    f"high-water mark is {top}; see `waltz client high-water-mark`)"
                )
            seen, last_progress = callbacks.hwm, loop.time()
            while not done.is_set() and not stop.is_set():
                if callbacks.error is not None:
                    if isinstance(callbacks.error, ClientAheadError):
                        raise WaltzError(
                            f"--from {start} is beyond the end of partition {partition}"
                        )
                    raise WaltzError(f"the feed failed: {callbacks.error}")
                if not follow and callbacks.hwm >= top:
                    return
                if callbacks.hwm != seen:
                    seen, last_progress = callbacks.hwm, loop.time()
                elif not follow and loop.time() - last_progress > timeout:
                    raise UnavailableError(
                        f"partition {partition}: no transaction arrived for {timeout:g}s "
                        f"(at {callbacks.hwm}, catching up to {top}); is its server up? "
                        "(--timeout waits longer)"
                    )
                callbacks.progress.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(callbacks.progress.wait(), 0.2)
        finally:
            if follow:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(signum)

    try:
        _run(
            uri,
            (transport, transport_options),
            partition,
            timeout=timeout,
            start_hwm=start - 1,
            work=work,
            on_transaction=show,
        )
    except ClientAheadError:
        raise WaltzError(
            f"--from {start} is beyond the end of partition {partition} (see "
            "`waltz client high-water-mark`)"
        ) from None
    except KeyboardInterrupt:
        if not follow:
            raise
        # Ctrl-C while the client was still connecting (before `work` took the signal
        # over): --follow ends the same way (exit 0), not "Aborted!"


@client_group.command("high-water-mark")
@_coordination_option
@_partition_option
@transport_options
@_timeout_option
@output_option
def high_water_mark_command(  # noqa: PLR0917 - click passes options by name
    uri: str,
    partition: int,
    transport: str,
    transport_options: tuple[str, ...],
    timeout: float,
    output: str,
) -> None:
    """Print the partition's high-water mark (the last committed id; -1 when empty)."""

    async def work(client: AsyncWaltzClient, callbacks: Any, deadline: float) -> int:
        return await _high_water_mark(client, partition, deadline)

    mark = _run(
        uri,
        (transport, transport_options),
        partition,
        timeout=timeout,
        start_hwm=-1,
        work=work,
    )
    emit(output, {"partition": partition, "high_water_mark": mark}, lambda: click.echo(str(mark)))
