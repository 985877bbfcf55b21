"""The writer child of the storage crash test (run with ``python -m``).

It opens an existing storage, appends batches to some partitions
concurrently, and after each append returns writes ``<partition> <last id>``
on stdout (the acknowledgement the parent counts on) until it is killed or
has written ``--max-records`` per partition.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import uuid

from waltz_api.contracts.storage import StorageEngine
from waltz_api.types import SessionInfo
from waltz_conformance.records import make_record


def _load(ref: str) -> type[StorageEngine]:
    module_name, _, attr = ref.partition(":")
    engine_class = getattr(importlib.import_module(module_name), attr)
    assert isinstance(engine_class, type) and issubclass(engine_class, StorageEngine)
    return engine_class


async def _write(args: argparse.Namespace) -> None:
    engine_class = _load(args.engine)
    engine = await engine_class.open(
        args.location,
        cluster_key=uuid.UUID(args.cluster_key),
        num_partitions=args.num_partitions,
        options=json.loads(args.options),
    )
    out = sys.stdout

    async def writer(partition_id: int) -> None:
        part = engine.partition(partition_id)
        next_id = part.max_transaction_id() + 1
        while next_id < args.max_records:
            batch = [
                make_record(t, partition_id)
                for t in range(next_id, min(next_id + args.batch, args.max_records))
            ]
            await part.append(batch)
            next_id += len(batch)
            out.write(f"{partition_id} {next_id - 1}\n")
            out.flush()

    async def session_writer(partition_id: int) -> None:
        part = engine.partition(partition_id)
        session = part.session_info().session_id + 1
        for _ in range(args.max_records):
            await part.set_session_info(SessionInfo(session, session * 2, session * 2 - 1, session))
            out.write(f"{partition_id} {session}\n")
            out.flush()
            session += 1

    work = session_writer if args.sessions else writer
    try:
        await asyncio.gather(*(work(p) for p in args.partitions))
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True, help="module:StorageEngineClass")
    parser.add_argument("--location", required=True)
    parser.add_argument("--cluster-key", required=True)
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--partitions", type=int, nargs="+", required=True)
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--max-records", type=int, default=100_000)
    parser.add_argument(
        "--sessions", action="store_true", help="update session info instead of appending"
    )
    asyncio.run(_write(parser.parse_args()))


if __name__ == "__main__":
    main()
