"""Archived history as Parquet scans (docs/archive.md, "Spark").

The driver reads each partition's archive mark (cluster metadata) and manifest (the
archive) once per plan, and cuts the requested ``[start, end)`` at the mark: ids up to
the mark become :class:`ArchiveSplit` s (read by the executors straight from the
archive's Parquet files, through fsspec: no server in the path), the rest is left to
the servers. The boundary is the one mark read at planning, so no id is read twice or
skipped.

An executor reads only the row groups its split overlaps (the rows of a range are the
dense ids from its first, so a row group's ids follow from the row counts), checks the
object's footer against the manifest, the rows' ids, and Parquet's page checksums;
with ``verifyRecordChecksums`` also every record's CRC-32C.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from waltz_api.errors import ArchiveError
from waltz_archive.manifest import ArchivedRange
from waltz_archive.objects import RangeFile
from waltz_archive.store import ArchiveStore, parse_storage_options
from waltz_archive.tools import load_manifest
from waltz_spark.reader import LogReader

log = logging.getLogger(__name__)


@dataclass
class ArchiveSplit(InputPartition):
    """Transactions ``start <= id < end`` of a partition, in one archived range object."""

    partition: int
    start: int
    end: int
    url: str
    storage_options: str
    """JSON (an InputPartition is pickled to the executors)."""
    name: str
    first: int
    last: int
    size: int
    data_bytes: int
    digest: int
    ids: frozenset[int] | None = field(default=None)

    def __post_init__(self) -> None:
        InputPartition.__init__(self, ("archive", self.partition, self.start, self.end))

    @property
    def archived(self) -> ArchivedRange:
        return ArchivedRange(
            self.first, self.last, self.name, self.size, self.data_bytes, self.digest
        )


@dataclass(frozen=True)
class ArchiveOptions:
    """The data source's archive options."""

    enabled: bool = True
    url: str = ""
    storage_options: str = ""
    verify_records: bool = False

    @classmethod
    def of(cls, options: Mapping[str, str]) -> ArchiveOptions:
        """From the (lower-cased) data source options."""
        enabled = str(options.get("archive", "true")).lower() != "false"
        verify = str(options.get("verifyrecordchecksums", "false")).lower() == "true"
        raw = options.get("archivestorageoptions", "")
        parse_storage_options(raw)  # a bad value fails at planning, naming the option
        return cls(enabled, options.get("archiveurl", ""), raw, verify)


def split_archived(
    archive: ArchiveOptions,
    reader: LogReader,
    ranges: dict[int, tuple[int, int]],
    split: int,
    ids: frozenset[int] | None = None,
) -> tuple[list[ArchiveSplit], dict[int, tuple[int, int]]]:
    """The archived part of each partition's ``[start, end)`` as splits of at most
    ``split`` ids (never across a range object), and what is left for the servers."""
    if not archive.enabled or not ranges:
        return [], dict(ranges)
    marks = reader.archive_marks(sorted(ranges))
    splits: list[ArchiveSplit] = []
    live: dict[int, tuple[int, int]] = {}
    for p, (start, end) in sorted(ranges.items()):
        mark = marks[p]
        if mark.mark < start or end <= start:
            live[p] = (start, end)
            continue
        store = ArchiveStore(
            archive.url or mark.url, parse_storage_options(archive.storage_options)
        )
        manifest = load_manifest(store, p, mark.manifest)
        top = min(end, manifest.mark + 1)
        for archived in manifest.ranges:
            low, high = max(start, archived.first), min(top, archived.last + 1)
            for at in range(low, high, split):
                chunk_end = min(at + split, high)
                if ids is not None and not any(at <= i < chunk_end for i in ids):
                    continue
                splits.append(
                    ArchiveSplit(
                        p,
                        at,
                        chunk_end,
                        store.url,
                        json.dumps(store.storage_options),
                        archived.name,
                        archived.first,
                        archived.last,
                        archived.size,
                        archived.data_bytes,
                        archived.digest,
                        ids,
                    )
                )
        live[p] = (max(start, top), end)
    return splits, live


def read_archive_split(
    split: ArchiveSplit, schema: pa.Schema, verify_records: bool = False
) -> Iterator[pa.RecordBatch]:
    """The rows of ``split`` in the data source's ``schema`` (runs on an executor)."""
    store = ArchiveStore(split.url, json.loads(split.storage_options or "{}"))
    reader = RangeFile(store, split.partition, split.archived)
    try:
        reader.check_footer()
        starts = [*reader.row_starts, split.last + 1]
        for index in range(len(reader.row_starts)):
            group_first, group_end = starts[index], starts[index + 1]
            if group_end <= split.start or group_first >= split.end:
                continue
            table = reader.read_row_group(index, verify_data=verify_records)
            low = max(split.start, group_first) - group_first
            high = min(split.end, group_end) - group_first
            for batch in table.slice(low, high - low).to_batches():
                yield _to_schema(split, batch, schema)
    except ArchiveError:
        raise
    except Exception as exc:  # fsspec, pyarrow: named, with the range and the object
        raise ArchiveError(f"{reader.where}: {type(exc).__name__}: {exc}") from exc
    finally:
        reader.close()


def _to_schema(split: ArchiveSplit, batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """An archived batch as the data source's schema (no copy of the data column)."""
    n = batch.num_rows
    columns: dict[str, Any] = {
        "partition": pa.array(np.full(n, split.partition, dtype=np.int32)),
        "transaction_id": batch.column("transaction_id"),
        "header": batch.column("header"),
        "client_id": batch.column("client_id"),
        "generation": batch.column("generation"),
        "req_partition": batch.column("req_partition"),
        "seq_num": batch.column("seq_num"),
        "data": batch.column("data"),
    }
    out = pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema)
    if split.ids is not None:
        chosen = np.isin(
            batch.column("transaction_id").to_numpy(), np.fromiter(split.ids, np.int64)
        )
        out = out.filter(pa.array(chosen))
    return out
