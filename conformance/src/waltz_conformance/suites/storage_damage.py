"""The seeded damage sweep of the storage suite (capability ``file_faults``).

A pristine storage (partitions of fsynced records across several files) is
copied once per variant and damaged one way, chosen by the variant's seed:
a file truncated, a bit flipped, a sector or page zeroed (in a data, index or
metadata file), or an extra file under a name the engine reads: junk (stray),
a copy of one of the partition's own files (duplicated), a file of another
partition or of another cluster's storage (foreign). Then the engine opens it,
and for every record written:

- a record that is served is byte-identical to what was appended;
- a record that is not is refused with an error naming its id
  (CorruptionError), lies in a range the engine reports missing, or lies past
  the log's end;
- no intact record is deleted: a record whose bytes the damage did not touch
  is served, or its stored bytes are still in a file under the location
  (an engine moves what it cannot read aside, it never deletes it);
- with ``repair``, the missing ranges filled from the pristine records make
  the log read back whole, across a reopen.

The engine may refuse to open, or close a partition, with a StorageError; the
intact records must still be on disk then. The sweep counts each outcome.

:mod:`waltz_conformance.suites.storage` runs the sweep with its harness; what the sweep
needs of it is a :class:`DamageHarness` (this module does not import the suite).
"""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import crc32c

from waltz_api.contracts.storage import StorageEngine
from waltz_api.errors import CorruptionError, StorageError
from waltz_api.types import Record, ReqId, SessionInfo


class DamageHarness(Protocol):
    """What the sweep uses of the storage suite's harness
    (:class:`~waltz_conformance.suites.storage.StorageHarness`, capability
    ``file_faults``)."""

    @property
    def root(self) -> Path: ...

    @property
    def capabilities(self) -> frozenset[str]: ...

    def new_location(self) -> str: ...

    async def open(
        self,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> StorageEngine: ...

    def record_extent(
        self, location: str, partition_id: int, transaction_id: int
    ) -> tuple[Path, int, int]: ...

    def index_files(self, location: str, partition_id: int) -> list[Path]: ...

    def data_files(self, location: str, partition_id: int) -> list[Path]: ...

    def metadata_files(self, location: str) -> list[Path]: ...

    def stray_names(self, location: str, partition_id: int) -> list[Path]: ...

    def copy_location(self, source: str, target: str) -> None: ...


KINDS = ("truncate", "flip", "zero", "stray", "duplicate", "foreign")
PARTITIONS = (0, 1)
RECORDS = 240


def sweep_record(transaction_id: int, partition_id: int) -> Record:
    """Records of varied sizes, so damage lands anywhere in them."""
    size = (transaction_id * 37 + partition_id * 11) % 300
    data = bytes((transaction_id + i * 7 + partition_id) % 251 for i in range(size))
    return Record(
        transaction_id,
        ReqId(9, 2, partition_id, transaction_id),
        transaction_id % 7,
        data,
        crc32c.crc32c(data),
    )


@dataclass
class Pristine:
    """The undamaged storage the variants are copied from."""

    location: str
    cluster_key: uuid.UUID
    num_partitions: int
    extents: dict[tuple[int, int], tuple[Path, int, int]]
    """(partition, id) -> (file relative to the location, start, end) of the stored record."""
    stored: dict[tuple[int, int], bytes]
    foreign_location: str


@dataclass
class Damage:
    kind: str
    partition_id: int
    target: Path | None = None
    """The damaged file (relative to the location), or the extra file's name."""
    span: tuple[int, int] | None = None
    """Bytes damaged in ``target`` (to the end of the file for a truncation)."""
    describe: str = ""


@dataclass
class SweepResult:
    variants: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    served: int = 0
    refused: int = 0
    missing: int = 0
    past_end: int = 0
    intact_not_served: int = 0
    changed_served: int = 0
    intact_deleted: int = 0
    repaired: int = 0
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.variants} damage variants ({dict(sorted(self.outcomes.items()))}): records "
            f"served {self.served}, refused {self.refused}, in missing ranges {self.missing}, "
            f"past the end {self.past_end}; intact records not served {self.intact_not_served} "
            f"(all still on disk); changed records served {self.changed_served}, intact records "
            f"deleted {self.intact_deleted}; records repaired {self.repaired}"
        )


async def build_pristine(harness: DamageHarness, options: dict[str, Any]) -> Pristine:
    """Two partitions of RECORDS records each, closed (everything flushed)."""
    key = uuid.uuid4()
    locations = []
    for cluster_key in (key, uuid.uuid4()):
        location = harness.new_location()
        engine = await harness.open(
            location, cluster_key=cluster_key, num_partitions=4, options=options
        )
        try:
            for pid in PARTITIONS:
                part = await engine.add_partition(pid)
                for first in range(0, RECORDS, 7):
                    stop = min(first + 7, RECORDS)
                    await part.append([sweep_record(t, pid) for t in range(first, stop)])
                await part.set_session_info(SessionInfo(3, RECORDS - 1, RECORDS - 1, 3))
        finally:
            await engine.close()
        locations.append(location)
    extents = {}
    stored = {}
    for pid in PARTITIONS:
        for t in range(RECORDS):
            path, start, end = harness.record_extent(locations[0], pid, t)
            extents[(pid, t)] = (path.relative_to(locations[0]), start, end)
            stored[(pid, t)] = path.read_bytes()[start:end]
    return Pristine(locations[0], key, 4, extents, stored, locations[1])


def choose_damage(rng: random.Random, harness: DamageHarness, pristine: Pristine) -> Damage:
    kind = rng.choice(KINDS)
    pid = rng.choice(PARTITIONS)
    base = Path(pristine.location)
    if kind in ("stray", "duplicate", "foreign"):
        names = harness.stray_names(pristine.location, pid)
        name = rng.choice(names).relative_to(base)
        return Damage(kind, pid, name, describe=f"{kind} file {name}")
    data = harness.data_files(pristine.location, pid)
    index = harness.index_files(pristine.location, pid)
    meta = harness.metadata_files(pristine.location)
    pool = data * 4 + index + meta
    target = rng.choice(pool)
    size = target.stat().st_size
    rel = target.relative_to(base)
    if kind == "truncate" or size == 0:
        offset = rng.randrange(size + 1)
        return Damage("truncate", pid, rel, (offset, size), f"truncate {rel} at {offset}")
    if kind == "flip":
        offset = rng.randrange(size)
        return Damage("flip", pid, rel, (offset, offset + 1), f"flip a bit at {offset} of {rel}")
    unit = rng.choice((512, 4096))
    block = rng.randrange(-(-size // unit)) * unit
    end = min(block + unit, size)
    return Damage("zero", pid, rel, (block, end), f"zero bytes {block}..{end} of {rel}")


def apply_damage(
    rng: random.Random, damage: Damage, harness: DamageHarness, pristine: Pristine, where: str
) -> None:
    base = Path(where)
    assert damage.target is not None
    target = base / damage.target
    if damage.kind == "truncate":
        assert damage.span is not None
        with target.open("r+b") as f:
            f.truncate(damage.span[0])
    elif damage.kind == "flip":
        assert damage.span is not None
        raw = bytearray(target.read_bytes())
        raw[damage.span[0]] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(raw))
    elif damage.kind == "zero":
        assert damage.span is not None
        raw = bytearray(target.read_bytes())
        start, end = damage.span
        raw[start:end] = bytes(end - start)
        target.write_bytes(bytes(raw))
    else:
        pid = damage.partition_id
        if damage.kind == "stray":
            content = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))
        elif damage.kind == "duplicate":
            source = rng.choice(harness.data_files(where, pid))
            content = source.read_bytes()
        else:
            other = rng.choice(
                [(pristine.location, p) for p in PARTITIONS if p != pid]
                + [(pristine.foreign_location, p) for p in PARTITIONS]
            )
            source = rng.choice(harness.data_files(other[0], other[1]))
            content = source.read_bytes()
        if target.exists():
            return  # the name is taken: this variant damages nothing
        target.write_bytes(content)


def damaged_records(damage: Damage, pristine: Pristine) -> set[tuple[int, int]]:
    """The records whose stored bytes the damage touched."""
    if damage.span is None or damage.target is None:
        return set()
    start, end = damage.span
    hit = set()
    for key, (path, a, b) in pristine.extents.items():
        if path != damage.target:
            continue
        if damage.kind == "truncate":
            if b > start:
                hit.add(key)
        elif a < end and start < b:
            hit.add(key)
    return hit


def _names(message: str, transaction_id: int) -> bool:
    return re.search(rf"(?<![0-9]){transaction_id}(?![0-9])", message) is not None


async def run_variant(
    harness: DamageHarness,
    pristine: Pristine,
    seed: int,
    options: dict[str, Any],
    result: SweepResult,
) -> None:
    rng = random.Random(seed)
    damage = choose_damage(rng, harness, pristine)
    where = f"{pristine.location}-v{seed}"
    harness.copy_location(pristine.location, where)
    try:
        apply_damage(rng, damage, harness, pristine, where)
        hit = damaged_records(damage, pristine)
        context = f"seed {seed} ({damage.describe})"
        unserved = await _open_and_check(
            harness,
            where,
            options=options,
            pristine=pristine,
            hit=hit,
            context=context,
            result=result,
        )
        blobs = _disk_contents(where) if unserved else []
        lost = [k for k in unserved if not any(pristine.stored[k] in b for b in blobs)]
        if lost:
            result.intact_deleted += len(lost)
            result.failures.append(f"{context}: intact records deleted: {sorted(lost)[:10]}")
        result.intact_not_served += len(unserved)
        result.variants += 1
    finally:
        shutil.rmtree(where, ignore_errors=True)


async def _open_and_check(
    harness: DamageHarness,
    where: str,
    *,
    options: dict[str, Any],
    pristine: Pristine,
    hit: set[tuple[int, int]],
    context: str,
    result: SweepResult,
) -> set[tuple[int, int]]:
    """Open the damaged copy and read everything; returns the intact records not served."""
    unserved: set[tuple[int, int]] = set()
    try:
        engine = await harness.open(
            where,
            cluster_key=pristine.cluster_key,
            num_partitions=pristine.num_partitions,
            options=options,
        )
    except StorageError:
        result.outcomes["refused to open"] += 1
        return {k for k in pristine.extents if k not in hit}
    holes = False
    try:
        outcome = "opened"
        for pid in PARTITIONS:
            try:
                part = engine.partition(pid)
                part.max_transaction_id()
            except StorageError:
                outcome = "partition closed"
                unserved |= {(pid, t) for t in range(RECORDS) if (pid, t) not in hit}
                continue
            unserved |= await _check_partition(
                engine, pid, hit=hit, context=context, result=result, harness=harness
            )
            holes = holes or bool(part.missing_ranges())
        result.outcomes[outcome] += 1
    finally:
        await engine.close()
    if holes and "repair" in harness.capabilities:
        await _repair_and_reopen(
            harness, where, options=options, pristine=pristine, context=context, result=result
        )
    return unserved


async def _check_partition(
    engine: StorageEngine,
    pid: int,
    *,
    hit: set[tuple[int, int]],
    context: str,
    result: SweepResult,
    harness: DamageHarness,
) -> set[tuple[int, int]]:
    part = engine.partition(pid)
    top = part.max_transaction_id()
    missing = part.missing_ranges() if "repair" in harness.capabilities else []
    in_holes = {t for a, b in missing for t in range(a, b + 1)}
    unserved: set[tuple[int, int]] = set()
    if top >= RECORDS:
        result.failures.append(f"{context}: partition {pid} claims records up to {top}")
    bulk: list[Record] = []
    with contextlib.suppress(CorruptionError):
        bulk = await part.read_records(0, RECORDS + 5, 1 << 30)
    if bulk != [sweep_record(t, pid) for t in range(len(bulk))]:
        result.changed_served += 1
        result.failures.append(f"{context}: partition {pid}: a range read served changes")
        bulk = []
    if len(bulk) == RECORDS:
        result.served += RECORDS  # the whole log, read back right
        return unserved
    for t in range(RECORDS):
        expected = sweep_record(t, pid)
        if t < len(bulk):
            result.served += 1
            continue
        try:
            got = await part.read_record(t)
        except CorruptionError as exc:
            if not _names(str(exc), t):
                result.failures.append(f"{context}: refusal of {t} does not name it: {exc}")
            if t in in_holes:
                result.missing += 1
            else:
                result.refused += 1
            if (pid, t) not in hit:
                unserved.add((pid, t))
            continue
        if got is None:
            if t <= top:
                result.failures.append(f"{context}: partition {pid} has no record {t} <= {top}")
            result.past_end += 1
            if (pid, t) not in hit:
                unserved.add((pid, t))
            continue
        if got != expected:
            result.changed_served += 1
            result.failures.append(f"{context}: partition {pid} served a changed record {t}")
            continue
        result.served += 1
    return unserved


async def _repair_and_reopen(
    harness: DamageHarness,
    where: str,
    *,
    options: dict[str, Any],
    pristine: Pristine,
    context: str,
    result: SweepResult,
) -> None:
    """Fill every missing range from the pristine records, then read all back."""
    try:
        engine = await harness.open(where, options=options)
    except StorageError:
        return
    try:
        for pid in PARTITIONS:
            try:
                part = engine.partition(pid)
                ranges = part.missing_ranges()
            except StorageError:
                continue
            for first, last in ranges:
                records = [sweep_record(t, pid) for t in range(first, last + 1)]
                for at in range(0, len(records), 50):
                    await part.repair(records[at : at + 50])
                result.repaired += len(records)
            if part.missing_ranges():
                result.failures.append(f"{context}: holes left after repair")
    finally:
        await engine.close()
    engine = await harness.open(where, options=options)
    try:
        for pid in PARTITIONS:
            try:
                part = engine.partition(pid)
                top = part.max_transaction_id()
            except StorageError:
                continue
            got = await _read_all(part.read_records, top)
            if got is not None and got != [sweep_record(t, pid) for t in range(top + 1)]:
                result.failures.append(f"{context}: partition {pid} after repair reads wrong")
    finally:
        await engine.close()


async def _read_all(read: Callable[..., Any], top: int) -> list[Record] | None:
    out: list[Record] = []
    try:
        while len(out) <= top:
            chunk = await read(len(out), 1000, 1 << 30)
            if not chunk:
                return out
            out.extend(chunk)
    except CorruptionError:
        return None  # damage an index vouched for is refused on read: not a failure here
    return out


def _disk_contents(where: str) -> list[bytes]:
    """Every file under the location (to find a record's stored bytes in)."""
    return [path.read_bytes() for path in Path(where).rglob("*") if path.is_file()]


def remove(harness: DamageHarness, pristine: Pristine) -> None:
    """Delete the sweep's pristine storages (and a scratch root the harness made)."""
    for location in (pristine.location, pristine.foreign_location):
        shutil.rmtree(location, ignore_errors=True)
    if harness.root.name.startswith("waltz-sweep-"):
        shutil.rmtree(harness.root, ignore_errors=True)
