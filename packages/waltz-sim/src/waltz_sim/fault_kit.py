"""What the nemesis keeps of a fault it injected (shared by :mod:`waltz_sim.faults` and
:mod:`waltz_sim.storage_faults`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol


class Startable(Protocol):
    """A process the nemesis restarts (the world's ``SimProcess``)."""

    @property
    def alive(self) -> bool: ...

    def start(self) -> object: ...


@dataclass(eq=False)
class ActiveFault:
    kind: str
    description: str
    heal: Callable[[], None]
    impairs: frozenset[str] = frozenset()
    """Processes it makes unavailable (for the phase rules)."""
    duration: float | None = None
    """How long it lasts, when the fault itself decides (else the nemesis' draw)."""
    timer: asyncio.TimerHandle | None = None
    script: object = None
    """What plays the fault over time, when it is more than one step (its own state)."""


def restart(processes: Iterable[Startable]) -> None:
    """Start those of ``processes`` that are down."""
    for process in processes:
        if not process.alive:
            process.start()


__all__ = ["ActiveFault", "restart"]
