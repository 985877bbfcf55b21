"""Test tools for the server: a ``waltz server --config`` child process, and a minimal
protocol client (handshake, send, collect) over any Transport."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Self, TypeVar

from waltz_api import wire
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import ConnectionClosedError, ProtocolError, WaltzError
from waltz_api.messages import Message
from waltz_api.supervised import WaltzCommandProcess

log = logging.getLogger(__name__)

READY_MARKER = "ready on"
M = TypeVar("M", bound=Message)


class ServerProcess(WaltzCommandProcess):
    """A ``waltz server --config`` child process (started, killed and restarted by pid;
    the options are :class:`~waltz_api.supervised.WaltzCommandProcess`'s)."""

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        log_path: Path,
        *,
        wrap: Sequence[str] = (),
        new_session: bool = False,
        command: Sequence[str] = (),
    ) -> None:
        super().__init__(
            "server",
            config_path,
            log_path,
            name="server",
            wrap=wrap,
            new_session=new_session,
            command=command,
        )

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait for the ready line of this start (a restart's log still holds the previous
        run's); raises ProcessStartError with its log if it died or is late."""
        await self.child.wait_ready(re.escape(READY_MARKER), timeout=timeout)


class RawClient:
    """Just enough of a Waltz client to drive a server in tests and benchmarks:
    the handshake, ``send``, and every received message kept in ``received``."""

    def __init__(self, conn: Connection, protocol: wire.ProtocolConnection) -> None:
        self.conn = conn
        self.protocol = protocol
        self.received: list[Message] = []
        self.counts: collections.Counter[type[Message]] = collections.Counter()
        """Messages received so far by type (also those a caller removed from ``received``)."""
        self.closed = False
        self._event = asyncio.Event()
        self._reader = asyncio.create_task(self._read(), name=f"raw-client-{conn.connection_id}")

    @classmethod
    async def connect(
        cls, transport: Transport, endpoint: str, name: str = "client", timeout: float = 10.0
    ) -> Self:
        conn = await transport.connect(endpoint, timeout=timeout)
        protocol = wire.ProtocolConnection(
            wire.Role.INITIATOR, sender=name, max_frame_size=transport.max_frame_size
        )
        try:
            await conn.send(protocol.start_handshake())
            protocol.receive_frame(await asyncio.wait_for(conn.recv(), timeout))
        except BaseException:
            await conn.close()
            raise
        return cls(conn, protocol)

    async def _read(self) -> None:
        try:
            while True:
                message = self.protocol.receive_frame(await self.conn.recv())
                self.received.append(message)
                self.counts[type(message)] += 1
                self._notify()
        except (ConnectionClosedError, ProtocolError, WaltzError) as exc:
            log.debug("raw client: connection ends: %s", exc)
        finally:
            self.closed = True
            self._notify()

    def _notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def send(self, message: Message) -> None:
        await self.conn.send(self.protocol.send(message))

    def of(self, kind: type[M]) -> list[M]:
        return [m for m in self.received if isinstance(m, kind)]

    async def wait(self, kind: type[M], count: int = 1, timeout: float = 30.0) -> list[M]:
        """Until ``count`` messages of ``kind`` arrived in all (raises TimeoutError, or
        ConnectionClosedError when the connection ended first); those still in
        ``received``."""

        async def loop() -> None:
            while self.counts[kind] < count:
                if self.closed:
                    raise ConnectionClosedError("the server closed the connection")
                await self._event.wait()

        await asyncio.wait_for(loop(), timeout)
        return self.of(kind)

    async def changed(self, timeout: float) -> None:
        """Wait until something arrives (or ``timeout``)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader
        with contextlib.suppress(WaltzError):
            await self.conn.close()
