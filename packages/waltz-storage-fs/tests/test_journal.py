"""The shared node journal's format, writer and scan (waltz_storage_fs.journal).

Not used by the engine yet (no feature level writes it): these tests pin what recovery
will rely on: a zero-filled (preallocated) tail is told from a torn entry, an entry
made durable and then lost is never taken for a torn tail (nothing is cut), record data
never passes for an entry, the ring wraps only over checkpointed entries, a power
loss at any step of a run of rounds keeps every round whose flush returned, and a
replay writes back exactly the records past each partition's segments, never guessing
over a gap.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from waltz_api.errors import CorruptionError, StorageError
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import journal as jnl
from waltz_storage_fs.files import REAL_FILES
from waltz_storage_fs.journal import ALIGN, HEADER_BLOCK, JOURNAL_FILE_NAME, Chunk, Journal
from waltz_storage_fs.powerloss import STATES, PowerLossFiles, Snapshot, materialize

KEY = uuid.UUID("0b7d6c1e-5a4f-4c3b-9e2d-1f0a9b8c7d6e")


def round_chunks(number: int, partitions: int = 2, size: int = 60) -> list[Chunk]:
    return [
        Chunk(p, number * 10, 2, f"round {number} partition {p} ".encode().ljust(size, b"."))
        for p in range(partitions)
    ]


def write_rounds(journal: Journal, first: int, count: int, **kwargs: int) -> list[int]:
    positions = []
    for number in range(first, first + count):
        positions.append(journal.append(round_chunks(number, **kwargs)))
        journal.sync()
    return positions


def file_bytes(directory: Path) -> bytes:
    return (directory / JOURNAL_FILE_NAME).read_bytes()


def test_rounds_come_back_in_order_and_the_writer_goes_on(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 64 * ALIGN)
    assert len(file_bytes(tmp_path)) == HEADER_BLOCK + 64 * ALIGN  # preallocated
    write_rounds(journal, 0, 3)
    journal.close()
    journal, found = Journal.open(REAL_FILES, tmp_path)
    assert [e.sequence for e in found.entries] == [0, 1, 2]
    assert [list(e.chunks) for e in found.entries] == [round_chunks(n) for n in range(3)]
    assert found.tail == "zeros"
    write_rounds(journal, 3, 2)
    journal.close()
    journal, found = Journal.open(REAL_FILES, tmp_path)
    journal.close()
    assert [e.sequence for e in found.entries] == [0, 1, 2, 3, 4]
    assert [list(e.chunks) for e in found.entries] == [round_chunks(n) for n in range(5)]
    assert all(e.position % ALIGN == 0 for e in found.entries)


@pytest.mark.parametrize("keep", ["head", "some-sectors", "tail-only"])
def test_a_torn_entry_is_told_from_the_zero_filled_tail(tmp_path: Path, keep: str) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 64 * ALIGN)
    write_rounds(journal, 0, 2)
    journal.close()
    _, clean = Journal.open(REAL_FILES, tmp_path)
    assert clean.tail == "zeros"
    clean_end = clean.position
    # the third round's entry reached the disk only in part (its flush never returned)
    entry = jnl.encode_entry(
        jnl.decode_header(file_bytes(tmp_path)).salt, 2, round_chunks(2, 4, 300)
    )
    assert len(entry) > 2 * ALIGN
    torn = {
        "head": entry[:100],
        "some-sectors": entry[: 2 * ALIGN],
        "tail-only": bytes(ALIGN) + entry[ALIGN:],
    }[keep]
    with open(tmp_path / JOURNAL_FILE_NAME, "r+b") as f:
        f.seek(clean_end)
        f.write(torn)
    journal, found = Journal.open(REAL_FILES, tmp_path)
    assert found.tail == "torn"
    assert [e.sequence for e in found.entries] == [0, 1]
    assert (found.position, found.sequence) == (clean_end, 2)
    # the writer goes on over the torn bytes, and they never come back
    write_rounds(journal, 2, 1, partitions=1)
    journal.close()
    _, found = Journal.open(REAL_FILES, tmp_path)
    assert [e.sequence for e in found.entries] == [0, 1, 2]
    assert list(found.entries[2].chunks) == round_chunks(2, partitions=1)


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_durable_entry_lost_before_later_ones_is_damage_never_cut(
    tmp_path: Path, where: str
) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 64 * ALIGN)
    positions = write_rounds(journal, 0, 4)
    journal.close()
    offset = positions[1] + (3 if where == "head" else jnl.HEAD_SIZE + 30)
    with open(tmp_path / JOURNAL_FILE_NAME, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    before = file_bytes(tmp_path)
    with pytest.raises(CorruptionError, match=r"entry #1 .* later entries are \(#2 at .*, #3 at "):
        Journal.open(REAL_FILES, tmp_path)
    assert file_bytes(tmp_path) == before  # nothing cut, nothing written


def test_a_lost_entry_read_as_zeros_before_later_ones_is_damage(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 64 * ALIGN)
    positions = write_rounds(journal, 0, 3)
    journal.close()
    with open(tmp_path / JOURNAL_FILE_NAME, "r+b") as f:  # a lost write: zeros again
        f.seek(positions[0])
        f.write(bytes(positions[1] - positions[0]))
    with pytest.raises(CorruptionError, match="entry #0"):
        Journal.open(REAL_FILES, tmp_path)


def test_record_data_never_passes_for_an_entry(tmp_path: Path) -> None:
    """A client chooses record data: an entry of another journal (another salt) inside a
    record, or left in the tail, is never read as an entry (no false damage either)."""
    other = tmp_path / "other"
    other.mkdir()
    forged = jnl.encode_entry(b"12345678", 7, round_chunks(7))
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 64 * ALIGN)
    journal.append([Chunk(0, 0, 1, bytes(ALIGN - jnl.HEAD_SIZE - 20) + forged)])
    journal.sync()
    journal.close()
    _, found = Journal.open(REAL_FILES, tmp_path)
    assert [e.sequence for e in found.entries] == [0] and found.tail == "zeros"
    with open(tmp_path / JOURNAL_FILE_NAME, "r+b") as f:
        f.seek(found.position + 4 * ALIGN)
        f.write(jnl.encode_entry(b"12345678", 1, round_chunks(1)))
    journal, found = Journal.open(REAL_FILES, tmp_path)
    journal.close()
    assert [e.sequence for e in found.entries] == [0] and found.tail == "torn"


def test_the_ring_wraps_over_checkpointed_entries_only(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = write_rounds(journal, 0, 4, size=300)  # two sectors each: full
    assert positions == [HEADER_BLOCK + i * 2 * ALIGN for i in range(4)]
    with pytest.raises(StorageError, match=r"journal is full .* checkpoint the segments first"):
        journal.append(round_chunks(4, size=300))
    journal.checkpointed(positions[2])  # rounds 0 and 1 are in durable segments
    assert write_rounds(journal, 4, 2, size=300) == positions[:2]  # wrapped
    with pytest.raises(StorageError, match="journal is full"):
        journal.append(round_chunks(6, size=300))
    journal.close()
    journal, found = Journal.open(REAL_FILES, tmp_path, (positions[2], 2))
    assert [e.sequence for e in found.entries] == [2, 3, 4, 5]
    assert found.tail == "torn"  # what follows is the older lap's round 2
    journal.checkpointed(positions[0])
    assert write_rounds(journal, 6, 1, size=300) == positions[2:3]
    journal.close()
    _, found = Journal.open(REAL_FILES, tmp_path, (positions[0], 4))
    assert [e.sequence for e in found.entries] == [4, 5, 6]
    with pytest.raises(StorageError, match="does not fit in the journal"):
        journal.append(round_chunks(0, size=9 * ALIGN))


def test_a_checkpoint_at_the_end_of_the_ring_keeps_the_next_lap_from_wrapping_over_itself(
    tmp_path: Path,
) -> None:
    # the rounds fill the body exactly: the writer's position, then the checkpoint's,
    # is the end of the body (a simulated node with a 4 KiB journal found it: seed 7 of
    # --faults points --storage-engine fs, its rounds written over the entries since)
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = write_rounds(journal, 0, 4, size=300)
    journal.checkpointed(journal.position)  # every round so far in durable segments
    assert write_rounds(journal, 4, 4, size=300) == positions  # the next lap, whole
    assert not journal.fits(600)
    with pytest.raises(StorageError, match="journal is full"):
        journal.append(round_chunks(8, size=300))
    journal.close()
    journal, found = Journal.open(REAL_FILES, tmp_path, (HEADER_BLOCK + 8 * ALIGN, 4))
    assert [e.sequence for e in found.entries] == [4, 5, 6, 7]
    assert not journal.fits(600)  # reopened: the ring is still full
    journal.checkpointed(journal.position)
    assert write_rounds(journal, 8, 1, size=300) == positions[:1]
    journal.close()


def test_a_wrapped_writer_never_wraps_again_over_the_live_entries(tmp_path: Path) -> None:
    # the live entries run from the checkpoint near the end of the ring, round the end,
    # to the writer's position near it: an entry that does not fit in the room left
    # before the checkpoint has no room at all (the start of the ring is live). Seed 19
    # of --faults standard --storage-engine fs (a 6 KiB journal) found it: fits() said
    # yes, no checkpoint was made, the entry was refused after its records were written
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = write_rounds(journal, 0, 8)  # one sector each: the ring is full
    journal.checkpointed(positions[7])  # rounds 0..6 are in durable segments
    assert write_rounds(journal, 8, 6) == positions[:6]  # wrapped, up to one free sector
    assert not journal.fits(3 * ALIGN)
    with pytest.raises(StorageError, match="journal is full"):
        journal.append(round_chunks(14, size=600))  # three sectors
    journal.close()
    journal, found = Journal.open(REAL_FILES, tmp_path, (positions[7], 7))
    assert [e.sequence for e in found.entries] == list(range(7, 14))
    assert not journal.fits(3 * ALIGN)
    journal.close()


def test_a_power_loss_at_any_step_keeps_every_round_whose_flush_returned(
    tmp_path: Path,
) -> None:
    """Rounds of one to three partitions, the ring wrapping over checkpointed entries;
    a crash at every step, in every crash state (only what flushes covered; everything
    written; the last write torn either way): the scan from the checkpoint recorded by
    then finds every round whose flush returned, in order, whole, at most the one in
    flight besides, and never calls what is left damage."""
    root = tmp_path / "fs"
    files = PowerLossFiles(root)
    now: dict[str, tuple[int, int] | int] = {"synced": 0, "checkpoint": (HEADER_BLOCK, 0)}
    snapshots: list[tuple[Snapshot, dict[str, tuple[int, int] | int]]] = []
    files.on_step = lambda snapshot: snapshots.append((snapshot, dict(now)))
    journal = Journal.create(files, root, KEY, 16 * ALIGN)
    created = len(snapshots)
    for number in range(14):
        if number % 4 == 0 and number:  # rounds before this one are in durable segments
            now["checkpoint"] = (journal.position, journal.sequence)
            journal.checkpointed(journal.position)
        journal.append(power_round(number))
        journal.sync()
        now["synced"] = number + 1
    assert journal.position < journal.live  # it wrapped
    checked = 0
    for snapshot, then in snapshots[created:]:
        synced, checkpoint = then["synced"], then["checkpoint"]
        assert isinstance(synced, int) and isinstance(checkpoint, tuple)
        for state, tree in snapshot.states():
            directory = tmp_path / f"s{snapshot.step}-{state}"
            materialize(tree, directory)
            reopened, found = Journal.open(REAL_FILES, directory, checkpoint)
            reopened.close()
            numbers = [e.sequence for e in found.entries]
            what = (state, snapshot.operation, numbers)
            assert numbers == list(range(checkpoint[1], checkpoint[1] + len(numbers))), what
            assert synced <= checkpoint[1] + len(numbers) <= synced + 1, what
            assert all(list(e.chunks) == power_round(e.sequence) for e in found.entries)
            assert found.tail in ("zeros", "torn"), what
            checked += 1
    assert checked == len(STATES) * (len(snapshots) - created)


def power_round(number: int) -> list[Chunk]:
    return round_chunks(number, partitions=1 + number % 3, size=200 + 40 * number)


def records_chunk(pid: int, first: int, count: int) -> Chunk:
    blob = b"".join(fmt.encode_record(make_record(t, pid)) for t in range(first, first + count))
    return Chunk(pid, first, count, blob)


def entries_of(*rounds: list[Chunk]) -> list[jnl.Entry]:
    return [jnl.Entry(HEADER_BLOCK + n * ALIGN, n, 0, tuple(c)) for n, c in enumerate(rounds)]


def test_the_replay_plan_is_the_records_past_each_partitions_segments() -> None:
    entries = entries_of(
        [records_chunk(0, 10, 3), records_chunk(1, 0, 2)],
        [records_chunk(0, 13, 4)],
        [records_chunk(1, 2, 1), records_chunk(0, 17, 2), records_chunk(5, 0, 1)],
    )
    plan = jnl.replay_plan(entries, {0: 15, 1: 3, 2: 0})
    assert set(plan) == {0}  # partition 1 is whole in its segments; 2 has nothing; 5 gone
    assert [(c.first_txid, c.count) for c in plan[0]] == [(15, 2), (17, 2)]
    assert plan[0][0].blob == records_chunk(0, 15, 2).blob  # cut at a record boundary
    assert plan[0][1] == records_chunk(0, 17, 2)
    whole = jnl.replay_plan(entries, {0: 10, 1: 0})
    assert [(c.first_txid, c.count) for c in whole[0]] == [(10, 3), (13, 4), (17, 2)]
    assert [(c.first_txid, c.count) for c in whole[1]] == [(0, 2), (2, 1)]
    assert jnl.replay_plan(entries, {0: 25}) == {}  # complete records past the journal stay


def test_a_replay_plan_never_guesses_over_a_gap() -> None:
    entries = entries_of([records_chunk(0, 10, 3)], [records_chunk(0, 14, 1)])
    with pytest.raises(CorruptionError, match=r"entry #1 holds partition 0's ids from 14"):
        jnl.replay_plan(entries, {0: 10})
    with pytest.raises(CorruptionError, match=r"ids 8\.\.9, made durable, are in neither"):
        jnl.replay_plan(entries_of([records_chunk(0, 10, 3)]), {0: 8})
    bad = records_chunk(0, 10, 3)
    broken = Chunk(0, 10, 3, bad.blob[:5] + bytes([bad.blob[5] ^ 1]) + bad.blob[6:])
    with pytest.raises(CorruptionError, match="record 10 is invalid"):
        jnl.replay_plan(entries_of([broken]), {0: 12})
