"""Log lines about peers, rate-limited: a hostile or broken peer cannot flood the log.

:class:`PeerLog` writes the first line about each peer (up to ``burst`` lines per
``interval`` seconds in all) and counts the rest; the next line written says how
many were left out. It remembers the last ``memory`` peers it wrote about for
``repeat_after`` seconds, so a peer that keeps failing is logged once, not once per
attempt.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Hashable


class PeerLog:
    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        interval: float = 60.0,
        memory: int = 1024,
        repeat_after: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._burst = burst
        self._interval = interval
        self._memory = memory
        self._repeat_after = repeat_after
        self._clock = clock
        self._seen: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._window_start = float("-inf")
        self._written = 0
        self.suppressed = 0
        """Lines left out since the last one written."""

    def log(self, level: int, peer: Hashable, message: str, *args: object) -> bool:
        """Write ``message % args`` unless ``peer`` was logged recently or the burst
        is spent; True when written."""
        now = self._clock()
        last = self._seen.get(peer)
        if last is not None and now - last < self._repeat_after:
            self.suppressed += 1
            return False
        if now - self._window_start >= self._interval:
            self._window_start = now
            self._written = 0
        if self._written >= self._burst:
            self.suppressed += 1
            return False
        self._written += 1
        self._seen[peer] = now
        self._seen.move_to_end(peer)
        if len(self._seen) > self._memory:
            self._seen.popitem(last=False)
        if self.suppressed:
            message += " (%d similar lines left out before this one)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._logger.log(level, message, *args)
        return True

    def forget(self, peer: Hashable) -> None:
        """Log the next line about ``peer`` again (e.g. once it behaved)."""
        self._seen.pop(peer, None)
