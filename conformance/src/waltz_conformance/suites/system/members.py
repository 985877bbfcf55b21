"""The members of a system harness: a storage node or a server, run as a real child
process (killed with SIGKILL and restarted by pid) or in the test's event loop."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from waltz_api.contracts.transport import Transport
from waltz_server.server.testing import ServerProcess
from waltz_storage_node.testing import StorageNodeProcess


class Member(ABC):
    """One storage node or server of the harness, in a process or in the loop."""

    @abstractmethod
    async def start(self) -> None:
        """Start (or restart) the member."""

    @abstractmethod
    async def kill(self) -> None:
        """Stop it abruptly (kill -9 for a process)."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """True while it runs."""


@dataclass
class StorageProcessMember(Member):
    process: StorageNodeProcess
    transport: Transport

    async def start(self) -> None:
        self.process.start()
        await self.process.wait_ready(self.transport, timeout=60)

    async def kill(self) -> None:
        self.process.kill()

    @property
    def alive(self) -> bool:
        return self.process.process is not None and self.process.process.poll() is None


@dataclass
class StorageInLoop(Member):
    config: dict[str, Any]
    node: Any = None

    async def start(self) -> None:
        from waltz_storage_node.config import load_storage_config
        from waltz_storage_node.main import start_node

        self.node = await start_node(load_storage_config(None, overrides=self.config))

    async def kill(self) -> None:
        if self.node is None:
            return
        node, self.node = self.node, None
        crash = getattr(node.transport, "simulate_crash", None)
        if crash is not None:
            crash()
        await node.close()
        await node.transport.close()

    @property
    def alive(self) -> bool:
        return self.node is not None


@dataclass
class ServerProcessMember(Member):
    process: ServerProcess

    async def start(self) -> None:
        self.process.start()
        await self.process.wait_ready(timeout=60)

    async def kill(self) -> None:
        self.process.kill()

    @property
    def alive(self) -> bool:
        return self.process.running

    def server_id(self) -> int | None:
        found = re.findall(r"server (\d+) ready on", self.process.output())
        return int(found[-1]) if found and self.alive else None


@dataclass
class ServerInLoop(Member):
    config: dict[str, Any]
    running: Any = None

    async def start(self) -> None:
        from waltz_server.server.config import load_server_config
        from waltz_server.server.main import start_server

        self.running = await start_server(load_server_config(None, overrides=self.config))

    async def kill(self) -> None:
        if self.running is not None:
            running, self.running = self.running, None
            # its connections drop without a goodbye, then its tasks stop (and its
            # registration goes: partitions move without waiting for the session timeout)
            crash = getattr(running.transport, "simulate_crash", None)
            if crash is not None:
                crash()
            await running.stop()

    @property
    def alive(self) -> bool:
        return self.running is not None

    def server_id(self) -> int | None:
        return None if self.running is None else int(self.running.manager.server_id)
