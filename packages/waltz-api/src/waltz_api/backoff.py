"""Exponential back-off with jitter, the one used by every retry loop.

Time comes from the event loop (``asyncio.sleep``) and randomness from an injected
``random.Random``, so a retry loop replays exactly under a simulated clock and seed.
"""

from __future__ import annotations

import asyncio
import random

from waltz_api.errors import ConfigError


class Backoff:
    """Delays that start at ``initial`` seconds and double up to ``maximum``, each
    shortened by a random fraction of at most ``jitter`` (so peers that failed
    together do not retry together). :meth:`reset` after a success."""

    __slots__ = ("_current", "_rng", "factor", "initial", "jitter", "maximum")

    def __init__(
        self,
        initial: float,
        maximum: float,
        rng: random.Random | None = None,
        *,
        factor: float = 2.0,
        jitter: float = 0.5,
    ) -> None:
        if not 0 < initial <= maximum:
            raise ConfigError(
                f"back-off delays need 0 < initial <= maximum, got {initial} and {maximum}"
            )
        if factor < 1 or not 0 <= jitter < 1:
            raise ConfigError(
                f"back-off needs factor >= 1 and 0 <= jitter < 1, got {factor} and {jitter}"
            )
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._current = initial

    def next_delay(self) -> float:
        """The next delay in seconds (and grow the one after it)."""
        delay = self._current * self._rng.uniform(1.0 - self.jitter, 1.0)
        self._current = min(self._current * self.factor, self.maximum)
        return delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay())

    def reset(self) -> None:
        self._current = self.initial
