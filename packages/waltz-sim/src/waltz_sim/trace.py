"""The trace of a run: every fault, process start and crash, op, and the components' logs.

Each event has the virtual time, who it is about (a process incarnation, or the
world) and a line of text. The trace is hashed as it grows (SHA-256 over every
event), so two runs of one seed can be compared by one number; addresses in log
messages (``0x7f...``) are masked first, as they differ between runs.

Logs of the real components (``waltz_server``, ``waltz_client``...) are captured
while a run lasts, at the trace level (INFO by default), with the process that
logged them: they make the trace readable (store sessions, recoveries,
assignments), and they are part of what a replay must reproduce.
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import crc32c

from waltz_sim.loop import CURRENT, SimLoop

CAPTURED_LOGGERS = (
    "waltz_server",
    "waltz_client",
    "waltz_api",
    "waltz_sim",
    "waltz_storage_fs",
    "waltz_archive",
    "waltz_conformance",
    "asyncio",
)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_FRAME = struct.Struct("<dII")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    time: float
    source: str
    kind: str
    text: str

    def format(self, start: float) -> str:
        return f"{self.time - start:10.4f} {self.source:<14} {self.kind:<8} {self.text}"


class Trace:
    def __init__(self, loop: SimLoop, *, keep: int = 200_000) -> None:
        self.loop = loop
        self.events: list[TraceEvent] = []
        self._hash = hashlib.sha256()
        self._keep = keep
        self.dropped = 0
        self.counts: dict[str, int] = {}
        self._frames: list[bytes] = []

    def add(self, kind: str, text: str, source: str | None = None) -> None:
        if source is None:
            incarnation = CURRENT.get()
            source = incarnation.name if incarnation is not None else "world"
        text = _ADDRESS.sub("0x?", text)
        event = TraceEvent(self.loop.time(), source, kind, text)
        self._flush_frames()  # frames and events in the order they happened
        self._hash.update(f"{event.time!r}|{source}|{kind}|{text}\n".encode())
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.events) < self._keep:
            self.events.append(event)
        else:
            self.dropped += 1

    def mix_frame(self, time: float, connection: int, frame: bytes) -> None:
        """Fold a network frame (when and where it landed, its CRC) into the digest."""
        self._frames.append(_FRAME.pack(time, connection, crc32c.crc32c(frame)))
        if len(self._frames) >= 1024:
            self._flush_frames()

    def _flush_frames(self) -> None:
        if self._frames:
            self._hash.update(b"".join(self._frames))
            self._frames.clear()

    @property
    def digest(self) -> str:
        self._flush_frames()
        return self._hash.hexdigest()

    def before(self, time: float, count: int = 60) -> list[TraceEvent]:
        """The last ``count`` events at or before ``time`` (what led to it)."""
        index = self._index_after(time)
        return self.events[max(0, index - count) : index]

    def after(self, time: float, count: int = 20) -> list[TraceEvent]:
        """The first ``count`` events after ``time`` (what followed)."""
        index = self._index_after(time)
        return self.events[index : index + count]

    def _index_after(self, time: float) -> int:
        index = len(self.events)
        while index > 0 and self.events[index - 1].time > time:
            index -= 1
        return index

    def format(self, events: list[TraceEvent] | None = None) -> str:
        start = self.loop.start_time
        return "\n".join(e.format(start) for e in (self.events if events is None else events))


class TraceHandler(logging.Handler):
    """Puts log records into the trace (virtual time, the logging process)."""

    def __init__(self, trace: Trace, level: int) -> None:
        super().__init__(level)
        self.trace = trace

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad log call must not stop the world
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            message = f"{message} [{type(exc).__name__}: {exc}]"
        self.trace.add(record.levelname.lower(), f"{record.name}: {message}")


@contextmanager
def capture_logs(trace: Trace, level: int) -> Iterator[None]:
    """Route the components' logs into ``trace`` (and nowhere else) while the block runs."""
    handler = TraceHandler(trace, level)
    saved: list[tuple[logging.Logger, int, bool]] = []
    for name in CAPTURED_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, old_level, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = propagate
