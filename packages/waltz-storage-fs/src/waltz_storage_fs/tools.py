"""Offline tools over a storage directory: verify, dump a segment, dump the control file.

They only read (never repair, never take a lock): run them on a stopped
storage node's directory, or on a copy. ``waltz storage verify|dump-segment|
dump-control-file`` are their command line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from waltz_api.errors import CorruptionError, StorageError
from waltz_api.types import LOST_SESSION, NO_SESSION
from waltz_storage_fs import format as fmt

# -- control file ----------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionInfoDump:
    partition_id: int
    stored_partition_id: int | None
    structs: tuple[fmt.InfoStruct | None, fmt.InfoStruct | None]
    current_slot: int | None

    @property
    def current(self) -> fmt.InfoStruct | None:
        return None if self.current_slot is None else self.structs[self.current_slot]


@dataclass(frozen=True)
class ControlFileDump:
    path: Path
    header: fmt.ControlHeader
    size: int
    partitions: list[PartitionInfoDump]


def control_file_path(path: str | os.PathLike[str]) -> Path:
    """The control file of a storage directory, or the file itself."""
    p = Path(path)
    return p / fmt.CONTROL_FILE_NAME if p.is_dir() else p


def read_control_file(path: str | os.PathLike[str]) -> ControlFileDump:
    """Parse a control file (``path``: the file or its storage directory)."""
    file = control_file_path(path)
    if not file.exists():
        raise StorageError(f"{file}: no such control file; give a storage directory or its .ctl")
    raw = file.read_bytes()
    header = fmt.decode_control_header(raw[: fmt.HEADER_SIZE])
    if header is None:
        raise CorruptionError(f"{file}: the control file header is short or fails its checksum")
    partitions = []
    size = fmt.partition_info_size(header.version) if header.version in fmt.CONTROL_VERSIONS else 0
    for pid in range(header.num_partitions if size else 0):
        offset = fmt.partition_info_offset(pid, header.version)
        stored, first, second = fmt.decode_partition_info(
            pid, raw[offset : offset + size], header.version
        )
        current = fmt.current_struct(first, second)
        partitions.append(
            PartitionInfoDump(pid, stored, (first, second), None if current is None else current[0])
        )
    return ControlFileDump(file, header, len(raw), partitions)


def format_control_file(dump: ControlFileDump) -> Iterator[str]:
    h = dump.header
    yield f"control file: {dump.path} ({dump.size} bytes)"
    yield f"format version: {h.version}" + _version_note(h.version)
    yield f"creation time: {h.creation_time_ms} ms"
    yield f"cluster key: {h.cluster_key}"
    yield f"number of partitions: {h.num_partitions}"
    for p in dump.partitions:
        current = p.current
        state = (
            "INVALID (both structs torn)"
            if current is None
            else ("hosted" if current.assigned else "not hosted")
        )
        yield f"partition {p.partition_id}: {state}"
        for slot, s in enumerate(p.structs):
            mark = "*" if slot == p.current_slot else " "
            if s is None:
                yield f"  {mark}struct {slot + 1}: invalid (checksum mismatch)"
            else:
                i = s.session_info
                yield (
                    f"  {mark}struct {slot + 1}: sequence={s.sequence} flags={s.flags:#x} "
                    f"session={i.session_id} low_water_mark={i.low_water_mark} "
                    f"local_low_water_mark={i.local_low_water_mark} "
                    f"low_water_mark_session={_session_name(i.low_water_mark_session_id)}"
                    + _acked_end_text(s, h.version)
                )


def _version_note(version: int) -> str:
    if version == fmt.FORMAT_VERSION or version not in fmt.CONTROL_VERSIONS:
        return ""
    level = fmt.level_of_format(version)
    migration = (
        f"opening migrates it to {fmt.FORMAT_OF_LEVEL[level]}"
        if version < fmt.FORMAT_OF_LEVEL[level]
        else f"raising the cluster's feature level above {level} migrates it to "
        f"{fmt.FORMAT_OF_LEVEL[level + 1]}"
    )
    return f" (cluster feature level {level}; {migration})"


def _acked_end_text(struct: fmt.InfoStruct, version: int) -> str:
    if version < 3:
        return ""
    if struct.acked_end == fmt.ACKED_END_UNKNOWN:
        return " acknowledged_end=unknown (set at the next open)"
    return f" acknowledged_end={struct.acked_end}"


def _session_name(session_id: int) -> str:
    if session_id == LOST_SESSION:
        return "LOST (records it acknowledged may be lost: it is caught up from its peers)"
    if session_id == NO_SESSION:
        return "unknown"
    return str(session_id)


# -- segments -----------------------------------------------------------------------------


@dataclass
class SegmentDump:
    path: Path
    header: fmt.SegmentHeader | None
    size: int
    records: list[fmt.ScannedRecord] = field(default_factory=list)
    stop_reason: str = ""
    end: int = fmt.HEADER_SIZE


def iter_segment(
    path: str | os.PathLike[str], result: fmt.ScanResult
) -> tuple[fmt.SegmentHeader | None, int, Iterator[fmt.ScannedRecord]]:
    """(header, file size, good records in order). Reads in chunks; ``result`` says
    where and why the scan stopped once the iterator is exhausted."""
    file = Path(path)
    if not file.exists():
        raise StorageError(f"{file}: no such segment file")
    fd = os.open(file, os.O_RDONLY)
    size = os.fstat(fd).st_size
    header = fmt.decode_segment_header(os.pread(fd, fmt.HEADER_SIZE, 0))

    def records() -> Iterator[fmt.ScannedRecord]:
        try:
            if header is None:
                result.stop_reason = "the segment header is short or fails its checksum"
                return
            yield from fmt.scan_records(
                fd, fmt.HEADER_SIZE, size, header.first_transaction_id, result
            )
        finally:
            os.close(fd)

    return header, size, records()


def format_segment(
    path: str | os.PathLike[str], *, show_data: bool = False, limit: int | None = None
) -> Iterator[str]:
    result = fmt.ScanResult(fmt.HEADER_SIZE)
    header, size, records = iter_segment(path, result)
    yield f"segment: {path} ({size} bytes)"
    if header is not None:
        yield (
            f"header: version={header.version} created={header.creation_time_ms} ms "
            f"cluster_key={header.cluster_key} partition={header.partition_id} "
            f"first_transaction_id={header.first_transaction_id}"
        )
    count = 0
    for scanned in records:
        count += 1
        if limit is not None and count > limit:
            continue
        r = scanned.record
        q = r.req_id
        line = (
            f"{r.transaction_id} offset={scanned.offset} len={len(r.data)} "
            f"header={r.header} req_id=({q.client_id},{q.generation},{q.partition_id},"
            f"{q.seq_num}) crc={r.checksum:#010x}"
        )
        if show_data:
            line += f" data={r.data[:64].hex()}{'...' if len(r.data) > 64 else ''}"
        yield line
    yield f"records: {count}, valid bytes: {result.end} of {size}"
    if result.stop_reason:
        yield f"scan stopped: {result.stop_reason}"
    elif result.end < size:
        yield f"trailing bytes: {size - result.end}"


# -- finding records (the conformance harness uses these) -----------------------------


def segment_firsts(directory: str | os.PathLike[str]) -> list[int]:
    """First transaction ids of a partition directory's segments, ascending."""
    firsts = []
    for name in os.listdir(directory):
        parsed = fmt.parse_segment_file_name(name)
        if parsed is not None and parsed[1] == fmt.SEGMENT_SUFFIX:
            firsts.append(parsed[0])
    return sorted(firsts)


def find_record(
    storage_directory: str | os.PathLike[str], partition_id: int, transaction_id: int
) -> tuple[Path, int, int]:
    """(segment file, start, end) of a record, through the index."""
    directory = Path(storage_directory) / str(partition_id)
    firsts = [f for f in segment_firsts(directory) if f <= transaction_id]
    if not firsts:
        raise StorageError(f"no segment of partition {partition_id} holds {transaction_id}")
    first = firsts[-1]
    data = directory / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
    index = directory / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
    with index.open("rb") as f:
        f.seek(fmt.HEADER_SIZE + (transaction_id - first) * fmt.INDEX_ENTRY_SIZE)
        raw = f.read(fmt.INDEX_ENTRY_SIZE)
    if len(raw) != fmt.INDEX_ENTRY_SIZE:
        raise StorageError(f"{index} has no entry for transaction {transaction_id}")
    (offset,) = fmt.INDEX_ENTRY.unpack(raw)
    with data.open("rb") as f:
        f.seek(offset)
        head = f.read(fmt.RECORD_HEAD.size)
    length = fmt.RECORD_HEAD.unpack(head)[6]
    return data, offset, offset + fmt.RECORD_OVERHEAD + length


# -- verify --------------------------------------------------------------------------------


@dataclass
class PartitionReport:
    partition_id: int
    hosted: bool
    segments: int = 0
    records: int = 0
    max_transaction_id: int = -1
    session_info: str = ""


@dataclass(frozen=True)
class QuarantineEntry:
    """A quarantine folder: what recovery moved aside, and why (its README)."""

    partition_id: int
    folder: Path
    files: tuple[str, ...]
    readme: str


@dataclass
class VerifyReport:
    directory: Path
    partitions: list[PartitionReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    quarantined: list[QuarantineEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the check could not cover (not problems)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(storage_directory: str | os.PathLike[str]) -> VerifyReport:
    """Check every byte of a storage directory: the control file, each segment's
    header, every record's checksums and ids, each index entry, and that the
    segments follow one another. Read-only."""
    directory = Path(storage_directory)
    report = VerifyReport(directory)
    control = read_control_file(directory)
    key = control.header.cluster_key
    expected_size = fmt.partition_info_offset(control.header.num_partitions, control.header.version)
    if control.header.version >= fmt.JOURNAL_CONTROL_VERSION:
        expected_size = fmt.checkpoint_offset(control.header.num_partitions, 2)
        _verify_journal(directory, control.header, report)
    if control.size != expected_size:
        report.problems.append(f"control file is {control.size} bytes, expected {expected_size}")
    if control.header.version < fmt.ACKED_END_VERSION:
        report.notes.append(fmt.LOST_TAIL_UNCHECKED.format(version=control.header.version))
    for p in control.partitions:
        pid = p.partition_id
        current = p.current
        if current is None:
            report.problems.append(f"partition {pid}: both partition info structs are invalid")
            report.partitions.append(PartitionReport(pid, hosted=False))
            continue
        if None in p.structs:
            report.problems.append(
                f"partition {pid}: one partition info struct is invalid (the other is used)"
            )
        info = current.session_info
        part_report = PartitionReport(
            pid,
            current.assigned,
            session_info=(
                f"session={info.session_id} low_water_mark={info.low_water_mark} "
                f"local_low_water_mark={info.local_low_water_mark} "
                f"low_water_mark_session={_session_name(info.low_water_mark_session_id)}"
            ),
        )
        report.partitions.append(part_report)
        if current.assigned and info.low_water_mark_session_id == LOST_SESSION:
            report.problems.append(
                f"partition {pid}: recovery found a damaged tail (moved to the quarantine): "
                "records it acknowledged may be lost; the server catches it up from its peers"
            )
        pdir = directory / str(pid)
        if not current.assigned:
            if pdir.exists():
                report.problems.append(f"partition {pid}: not hosted but {pdir} exists")
            continue
        if not pdir.is_dir():
            report.problems.append(f"partition {pid}: hosted but {pdir} is missing")
            continue
        _verify_partition(pdir, pid, key, part_report, report.problems)
        end = part_report.max_transaction_id + 1
        if control.header.version >= 3 and end < current.acked_end:
            report.problems.append(
                f"partition {pid}: the log ends at {end}, below the acknowledged end "
                f"{current.acked_end} recorded in the control file: transactions {end}.."
                f"{current.acked_end - 1} were made durable and may have been acknowledged, "
                "then lost; opening the storage moves what is left of them to the quarantine "
                "and marks the partition LOST (the server catches it up from its peers)"
            )
    report.quarantined = list_quarantine(directory)
    return report


def _verify_journal(directory: Path, header: fmt.ControlHeader, report: VerifyReport) -> None:
    """Format 4: the journal scanned from the control file's checkpoint (what recovery
    scans); the rounds it holds past the checkpoint are a note (the next open writes
    them back into the segments), a damaged journal a problem."""
    from waltz_storage_fs.files import REAL_FILES
    from waltz_storage_fs.journal import JOURNAL_FILE_NAME, decode_header, scan

    raw = (directory / fmt.CONTROL_FILE_NAME).read_bytes()
    at = fmt.checkpoint_offset(header.num_partitions, 0)
    slots = [fmt.decode_checkpoint(raw[at + i * fmt.CHECKPOINT_SLOT_SIZE :]) for i in range(2)]
    valid = [c for c in slots if c is not None]
    if not valid:
        report.problems.append("both journal checkpoint slots of the control file are invalid")
        return
    checkpoint = max(valid, key=lambda c: c.counter)
    path = directory / JOURNAL_FILE_NAME
    if not path.is_file():
        report.problems.append(f"{path} is missing (control file format 4 has a journal)")
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        journal = decode_header(os.pread(fd, 4096, 0), path)
        if journal.cluster_key != header.cluster_key:
            report.problems.append(f"{path} belongs to cluster {journal.cluster_key}")
            return
        found = scan(REAL_FILES, fd, journal, checkpoint.position, checkpoint.sequence)
    except CorruptionError as exc:
        report.problems.append(str(exc))
        return
    finally:
        os.close(fd)
    if found.tail == "damaged":
        report.problems.append(
            f"{path}: entry #{found.sequence} at offset {found.position} is not whole but "
            "later entries are: records made durable are lost (the storage does not open)"
        )
    elif found.entries:
        report.notes.append(
            f"{path}: {len(found.entries)} round(s) after the last checkpoint; the next "
            "open writes their records back into the segments"
        )


def list_quarantine(storage_directory: str | os.PathLike[str]) -> list[QuarantineEntry]:
    """Every quarantine folder of a storage directory, oldest first per partition."""
    root = Path(storage_directory) / fmt.QUARANTINE_DIR_NAME
    entries: list[QuarantineEntry] = []
    if not root.is_dir():
        return entries
    for pdir in sorted(root.iterdir(), key=lambda p: (not p.name.isdigit(), p.name.zfill(12))):
        if not pdir.is_dir() or not pdir.name.isdigit():
            continue
        for folder in sorted(pdir.iterdir()):
            if not folder.is_dir():
                continue
            readme = folder / "README.txt"
            text = readme.read_text(errors="replace").strip() if readme.exists() else ""
            files = tuple(sorted(p.name for p in folder.iterdir() if p.name != "README.txt"))
            entries.append(QuarantineEntry(int(pdir.name), folder, files, text))
    return entries


def _verify_partition(
    pdir: Path, pid: int, key: object, part_report: PartitionReport, problems: list[str]
) -> None:
    from waltz_storage_fs.files import REAL_FILES
    from waltz_storage_fs.recovery import read_log_start

    start = read_log_start(REAL_FILES, pdir)
    if start is None:
        problems.append(f"partition {pid}: {fmt.LOG_START_FILE_NAME} fails its checksum")
        start = 0
    expected_first = start
    for first in segment_firsts(pdir):
        if first < start:
            continue  # below the dropped (archived) prefix: recovery deletes it
        part_report.segments += 1
        data = pdir / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
        index = pdir / fmt.segment_file_name(first, fmt.INDEX_SUFFIX)
        where = f"partition {pid}: {data.name}"
        if first > expected_first:
            problems.append(
                f"partition {pid}: transactions {expected_first}..{first - 1} are missing (a "
                "hole left by damage; the server repairs it from a peer)"
            )
        elif first < expected_first:
            problems.append(f"{where}: starts at {first}, expected {expected_first}")
        result = fmt.ScanResult(fmt.HEADER_SIZE)
        header, size, records = iter_segment(data, result)
        if header is None:
            problems.append(f"{where}: header is short or fails its checksum")
            continue
        if header.cluster_key != key or header.partition_id != pid:
            problems.append(
                f"{where}: header is for cluster {header.cluster_key} partition "
                f"{header.partition_id}"
            )
        if header.first_transaction_id != first:
            problems.append(f"{where}: header says first id {header.first_transaction_id}")
        if not index.exists():
            problems.append(f"{where}: index file {index.name} is missing")
        index_header: fmt.SegmentHeader | None = None
        with index.open("rb") if index.exists() else open(os.devnull, "rb") as idx:
            raw_header = idx.read(fmt.HEADER_SIZE)
            if index.exists():
                index_header = fmt.decode_segment_header(raw_header)
                if index_header != header:
                    problems.append(f"{where}: index header does not match the segment header")
            count = 0
            for scanned in records:
                count += 1
                entry = idx.read(fmt.INDEX_ENTRY_SIZE) if index_header is not None else b""
                if index_header is not None and (
                    len(entry) != fmt.INDEX_ENTRY_SIZE
                    or fmt.INDEX_ENTRY.unpack(entry)[0] != scanned.offset
                ):
                    problems.append(
                        f"{where}: index entry for transaction "
                        f"{scanned.record.transaction_id} is missing or wrong"
                    )
                    index_header = None  # one report per index
            extra = idx.read(fmt.INDEX_ENTRY_SIZE) if index_header is not None else b""
            if extra:
                problems.append(f"{where}: the index has entries past the last record")
        if result.end != size:
            problems.append(
                f"{where}: {size - result.end} bad bytes after transaction "
                f"{first + count - 1} ({result.stop_reason or 'trailing data'})"
            )
        part_report.records += count
        expected_first = first + count
    part_report.max_transaction_id = expected_first - 1


def format_verify(report: VerifyReport) -> Iterator[str]:
    yield f"storage directory: {report.directory}"
    for p in report.partitions:
        if not p.hosted:
            continue
        yield (
            f"partition {p.partition_id}: {p.segments} segment(s), {p.records} record(s), "
            f"max transaction id {p.max_transaction_id}, {p.session_info}"
        )
    for entry in report.quarantined:
        summary = entry.readme.splitlines()[0] if entry.readme else "(no README)"
        yield f"QUARANTINED: partition {entry.partition_id}: {entry.folder}: {summary}"
        for name in entry.files:
            yield f"    {name}"
    for note in report.notes:
        yield f"note: {note}"
    for problem in report.problems:
        yield f"PROBLEM: {problem}"
    if report.quarantined:
        yield (
            f"{len(report.quarantined)} quarantine folder(s): what recovery moved aside, "
            "kept for inspection (delete them once no longer needed)"
        )
    yield "OK" if report.ok else f"{len(report.problems)} problem(s) found"
