"""What every long-running ``waltz`` process shares: logging set-up and the
run-until-SIGINT/SIGTERM loop with a clean shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from waltz_api.errors import WaltzError

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def configure_logging(level: str) -> None:
    """Log to stderr at ``level`` (supervisors and tests read the ready line there)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    root.setLevel(level)


def run_until_signalled(
    serve: Callable[[asyncio.Event], Awaitable[None]], *, log_level: str, what: str
) -> None:
    """Run ``serve(stop)`` on a new event loop; SIGINT or SIGTERM sets ``stop``.

    An OSError (a port taken, a directory not writable) becomes a WaltzError
    naming ``what`` failed, so the CLI prints one line and exits 1.
    """
    configure_logging(log_level)

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
