"""Browsing a partition's transactions: a range read from the partition's owner over the
Waltz protocol (the request a catch-up consumer makes), shown as header, size and data
(hex, UTF-8 when it decodes, pretty JSON when it parses).

The console asks as client ``-1`` on a connection of its own, per request: it mounts
nothing, so it never appears among the partition's clients, and a read never
changes anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from waltz_api import wire
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, WaltzError
from waltz_api.messages import ErrorResponse, RangeReadRequest, RangeReadResponse
from waltz_api.types import Record, ReqId

MAX_RECORDS = 200
MAX_BYTES = 4 * 1024 * 1024
PREVIEW_BYTES = 4096
"""Data bytes shown per transaction (the size says how many there are)."""

_seq = itertools.count(1)


@dataclass(frozen=True, slots=True)
class RangeAnswer:
    high_water_mark: int
    records: tuple[Record, ...]


class ReadError(WaltzError):
    """The owner could not be asked, or refused the read (the message says why)."""


async def read_range(
    transport: Transport,
    endpoint: str,
    partition_id: int,
    generation: int,
    *,
    start: int,
    count: int,
    timeout: float = 5.0,
) -> RangeAnswer:
    """Up to ``count`` committed transactions of ``partition_id`` from ``start``, read
    from its owner at ``endpoint`` (which serves it at ``generation``)."""
    if not 1 <= count <= MAX_RECORDS:
        raise ConfigError(f"count must be from 1 to {MAX_RECORDS}, got {count}", key="count")
    if start < 0:
        raise ConfigError(f"start must be a transaction id (0 or more), got {start}", key="start")
    try:
        async with asyncio.timeout(timeout * 2):
            conn = await transport.connect(endpoint, timeout=timeout)
            try:
                protocol = wire.ProtocolConnection(
                    wire.Role.INITIATOR,
                    sender="waltz-console",
                    max_frame_size=transport.max_frame_size,
                )
                await conn.send(protocol.start_handshake())
                protocol.receive_frame(await asyncio.wait_for(conn.recv(), timeout))
                req_id = ReqId(-1, generation, partition_id, next(_seq))
                await conn.send(protocol.send(RangeReadRequest(req_id, start, count, MAX_BYTES)))
                while True:
                    message = protocol.receive_frame(await asyncio.wait_for(conn.recv(), timeout))
                    if getattr(message, "req_id", None) != req_id:
                        continue
                    if isinstance(message, RangeReadResponse):
                        return RangeAnswer(message.high_water_mark, tuple(message.records))
                    if isinstance(message, ErrorResponse):
                        raise ReadError(
                            f"partition {partition_id}'s server refused the read: "
                            f"{message.code.name}: {message.message}"
                        )
                    raise ReadError(f"unexpected answer {type(message).__name__}")
            finally:
                with contextlib.suppress(WaltzError, OSError):
                    await conn.close()
    except TimeoutError:
        raise ReadError(
            f"partition {partition_id}'s server ({endpoint}) did not answer within "
            f"{timeout * 2:g} s"
        ) from None
    except ReadError:
        raise
    except (WaltzError, OSError) as exc:
        raise ReadError(f"reading partition {partition_id} from {endpoint}: {exc}") from None


def describe_data(data: bytes) -> dict[str, Any]:
    """How the page shows transaction data: hex (of the first :data:`PREVIEW_BYTES`),
    UTF-8 text when the bytes decode, and indented JSON when the text parses."""
    shown = data[:PREVIEW_BYTES]
    text: str | None = None
    pretty: str | None = None
    try:
        text = data.decode("utf-8") if len(data) <= PREVIEW_BYTES else shown.decode("utf-8")
    except UnicodeDecodeError:
        with contextlib.suppress(UnicodeDecodeError):
            # cut inside a multi-byte character: drop the partial character
            text = shown[:-3].decode("utf-8") if len(data) > PREVIEW_BYTES else None
    if text is not None and len(data) <= PREVIEW_BYTES:
        with contextlib.suppress(ValueError):
            pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    return {
        "size": len(data),
        "truncated": len(data) > PREVIEW_BYTES,
        "hex": shown.hex(" "),
        "text": text,
        "json": pretty,
    }


def describe_record(record: Record) -> dict[str, Any]:
    return {
        "transaction_id": record.transaction_id,
        "header": record.header,
        "client_id": record.req_id.client_id,
        "request": {
            "client_id": record.req_id.client_id,
            "generation": record.req_id.generation,
            "seq_num": record.req_id.seq_num,
        },
        "checksum": f"{record.checksum:08x}",
        # Locks are checked when a transaction is appended and never stored in the log.
        "locks": None,
        **describe_data(record.data),
    }
