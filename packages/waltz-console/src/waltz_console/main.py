"""Running the console: ``waltz console --coordination URI [--listen HOST:PORT] ...``."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, PluginError
from waltz_console.auth import Sessions, load_token
from waltz_console.collector import Collector
from waltz_console.views import redact_uri
from waltz_console.web import Console

log = logging.getLogger(__name__)

READY = "console ready on"


@dataclass
class ConsoleConfig:
    coordination: str
    listen: str = "127.0.0.1:8090"
    http_urls: list[str] = field(default_factory=list)
    token_file: str | None = None
    transport: str = "zmq"
    transport_options: dict[str, Any] = field(default_factory=dict)
    storage_endpoint: str = "tcp://{}"
    interval: float = 1.0
    timeout: float = 5.0


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(
            f"--listen must be HOST:PORT (for example 127.0.0.1:8090; port 0 picks a free "
            f"one), got {listen!r}",
            "listen",
        )
    return host, int(port)


def make_transport(name: str, options: dict[str, Any]) -> Transport:
    from waltz_api.plugins import get_registry

    try:
        descriptor = get_registry().get("transport", name)
    except PluginError as exc:
        raise ConfigError(f"--transport: {exc}", key="transport") from None
    transport: Transport = descriptor.factory(dict(options))
    return transport


async def serve(config: ConsoleConfig, stop: asyncio.Event) -> None:
    host, port = parse_listen(config.listen)
    if "{}" not in config.storage_endpoint:
        raise ConfigError(
            "--storage-endpoint must contain {} (a node's host:port)", "storage_endpoint"
        )
    token, made = load_token(config.token_file, os.environ.get("WALTZ_CONSOLE_TOKEN"))
    loop = asyncio.get_running_loop()
    collector = Collector(
        config.coordination,
        http_urls=config.http_urls,
        storage_endpoint=config.storage_endpoint,
        interval=config.interval,
        timeout=config.timeout,
    )
    console = Console(
        collector,
        Sessions(token, loop.time),
        lambda: make_transport(config.transport, config.transport_options),
        storage_endpoint=config.storage_endpoint,
        timeout=config.timeout,
    )
    runner = web.AppRunner(console.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --listen",
                "listen",
            ) from exc
        await collector.start()
        addresses = runner.addresses
        bound = int(addresses[0][1]) if addresses else port
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound}/"
        if made and config.token_file is None:
            # shown once, where only the operator who started the console sees it
            sys.stderr.write(f"waltz console: actions need the token {token}\n")
            sys.stderr.flush()
        elif made:
            log.info("a new console token was written to %s", config.token_file)
        log.info("%s %s (coordination %s)", READY, url, redact_uri(config.coordination))
        await stop.wait()
    finally:
        console.end_streams()
        await collector.close()
        await console.close()
        await runner.cleanup()


def run(config: ConsoleConfig, log_level: str = "INFO") -> None:
    from waltz_api.process import run_until_signalled

    if log_level != "DEBUG":
        # client libraries log every connection retry as a WARNING; the page says what
        # failed (and a DEBUG log shows them)
        logging.getLogger("kazoo").setLevel(logging.ERROR)
    run_until_signalled(lambda stop: serve(config, stop), log_level=log_level, what="console")
