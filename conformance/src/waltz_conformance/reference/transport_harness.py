"""The conformance harness of the reference transport (``memory``).

Its peers live in this process; their faults are simulated: a kill breaks
every connection at once, a pause freezes the peer's transport.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from waltz_api.contracts.transport import Transport
from waltz_conformance.reference.transport import DEFAULT_BUFFER_BYTES, MemoryTransport
from waltz_conformance.suites.transport import Peer, TransportHarness, echo_handler

_names = itertools.count(1)


class SimulatedPeer(Peer):
    """An in-process echo peer on a MemoryTransport of its own."""

    def __init__(self, endpoint: str, options: Mapping[str, Any]) -> None:
        self._endpoint = endpoint
        self._options = dict(options)
        self.transport: MemoryTransport | None = None

    @property
    def endpoint(self) -> str:
        return self._endpoint

    async def start(self) -> None:
        self.transport = MemoryTransport(self._options)
        await self.transport.listen(self._endpoint, echo_handler)

    async def kill(self) -> None:
        if self.transport is not None:
            self.transport.simulate_crash()

    async def pause(self) -> None:
        if self.transport is not None:
            self.transport.simulate_pause()

    async def resume(self) -> None:
        if self.transport is not None:
            self.transport.simulate_resume()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def stop(self) -> None:
        if self.transport is not None:
            self.transport.simulate_resume()
            await self.transport.close()
            self.transport = None


@dataclass(kw_only=True)
class MemoryTransportHarness(TransportHarness):
    def create(self, options: Mapping[str, Any]) -> Transport:
        return MemoryTransport(options)

    def endpoint(self) -> str:
        return f"memory://suite-{os.getpid()}-{next(_names)}"

    async def start_peer(self) -> Peer:
        peer = SimulatedPeer(self.endpoint(), self.options)
        await peer.start()
        return peer

    def small_buffer_options(self) -> dict[str, Any]:
        return {"buffer_bytes": 256 * 1024}

    def stalled_receiver_bound(self, options: Mapping[str, Any], frame_size: int) -> int:
        return int(options.get("buffer_bytes", DEFAULT_BUFFER_BYTES)) + frame_size
