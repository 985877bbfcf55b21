"""What every long-running ``waltz`` process shares: logging set-up (plain text,
or JSON objects one per line) and the run-until-SIGINT/SIGTERM loop with a
clean shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from waltz_api.errors import WaltzError

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The ``log_level`` choices of the config files."""
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_level_field() -> Any:
    """The ``log_level`` key of a process's config (a server's, a storage node's)."""
    return dataclasses.field(default="INFO", metadata={"choices": LOG_LEVELS, "help": "log level"})


def log_format_field() -> Any:
    """The ``log_format`` key of a process's config: how :func:`configure_logging` writes."""
    return dataclasses.field(
        default="text",
        metadata={
            "choices": LOG_FORMATS,
            "help": "log lines on stderr: text, or json (one object per line)",
        },
    )


_PARTITION = re.compile(r"\bpartition (\d+)\b")
_SESSION = re.compile(r"\b(?:store )?session (\d+)\b")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, ``pid``, and ``partition`` / ``session`` when the record is about
    one: from the record's own attributes (``log.info(..., extra={"partition": 3})``),
    else from the message (the code's messages say ``partition N`` and
    ``session N``). An exception adds ``exception`` (its traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
            "pid": os.getpid(),
        }
        for field, pattern in (("partition", _PARTITION), ("session", _SESSION)):
            value = getattr(record, field, None)
            if value is None:
                found = pattern.search(message)
                value = int(found.group(1)) if found else None
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Log to stderr at ``level`` (supervisors and tests read the ready line there),
    as plain text or as JSON objects one per line (``log_format = "json"``)."""
    root = logging.getLogger()
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
        root.handlers[0].setFormatter(formatter)
    elif log_format == "json":
        for existing in root.handlers:
            existing.setFormatter(formatter)
    root.setLevel(level)


def run_until_signalled(
    serve: Callable[[asyncio.Event], Awaitable[None]],
    *,
    log_level: str,
    what: str,
    log_format: str = "text",
) -> None:
    """Run ``serve(stop)`` on a new event loop; SIGINT or SIGTERM sets ``stop``.

    An OSError (a port taken, a directory not writable) becomes a WaltzError
    naming ``what`` failed, so the CLI prints one line and exits 1.
    """
    configure_logging(log_level, log_format)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in _SIGNALS:
            loop.add_signal_handler(signum, stop.set)
        try:
            await serve(stop)
        finally:
            for signum in _SIGNALS:
                loop.remove_signal_handler(signum)

    try:
        asyncio.run(main())
    except WaltzError:
        raise
    except OSError as exc:
        raise WaltzError(f"{what} failed: {exc}") from exc
