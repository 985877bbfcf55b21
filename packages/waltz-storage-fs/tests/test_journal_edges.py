"""The node journal's edge cases (waltz_storage_fs.journal) that its mutation run found
no test for (docs/simulation.md, "Mutation score"): an entry ending exactly at the end
of the ring, a round of no records, a whole entry whose body does not decode, the room
the live entries take, the files a failed open leaves, a replay past partitions not
hosted any more.
"""

from __future__ import annotations

import re
import struct
import uuid
from pathlib import Path

import crc32c
import pytest

from waltz_api.errors import CorruptionError, StorageError
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import journal as jnl
from waltz_storage_fs.files import REAL_FILES, Files
from waltz_storage_fs.journal import ALIGN, HEADER_BLOCK, JOURNAL_FILE_NAME, Chunk, Journal

KEY = uuid.UUID("5f0e2c9a-8b1d-4e7a-a3c6-2d9b0f1e4a7c")
CHUNK_HEAD = 20
"""A chunk's fields before its records (partition, first id, count, byte length)."""


def sized_round(number: int, length: int) -> list[Chunk]:
    """One chunk, its entry ``length`` bytes long (unpadded)."""
    blob = f"round {number} ".encode().ljust(length - jnl.HEAD_SIZE - CHUNK_HEAD, b".")
    return [Chunk(0, number, 1, blob)]


def test_an_entry_ending_exactly_at_the_end_of_the_ring_is_written_there(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = [journal.append(sized_round(n, 2 * ALIGN)) for n in range(4)]
    journal.sync()
    # the last one ends on the body's last byte: it fits there, no wrap over live entries
    assert positions == [HEADER_BLOCK + n * 2 * ALIGN for n in range(4)]
    assert journal.used == 8 * ALIGN
    assert not journal.fits(1)
    journal.close()
    journal, found = Journal.open(REAL_FILES, tmp_path)
    journal.close()
    assert [list(e.chunks) for e in found.entries] == [sized_round(n, 2 * ALIGN) for n in range(4)]
    assert found.entries[-1].end == HEADER_BLOCK + 8 * ALIGN


def test_a_round_of_no_records_is_a_whole_entry(tmp_path: Path) -> None:
    """A round without chunks, or with a chunk of no records, is written and read back
    like any other (not taken for a torn entry, nor for damage before the next)."""
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    rounds = [[], [Chunk(3, 7, 0, b"")], sized_round(2, 100)]
    for chunks in rounds:
        journal.append(chunks)
    journal.sync()
    journal.close()
    journal, found = Journal.open(REAL_FILES, tmp_path)
    journal.close()
    assert [(e.sequence, list(e.chunks)) for e in found.entries] == list(enumerate(rounds))
    assert found.tail == "zeros"


def forged_entry(salt: bytes, sequence: int, body: bytes) -> bytes:
    """An entry whose head and CRCs are right for ``body`` (what a bug could write)."""
    head = jnl._HEAD.pack(b"WJE1", sequence, len(body), crc32c.crc32c(body))
    return head + jnl._CRC.pack(crc32c.crc32c(salt + head)) + body


UNDECODABLE = {
    "records-past-the-body": (jnl._CHUNK.pack(0, 0, 1, 40), bytes(30)),
    "negative-count": (jnl._CHUNK.pack(0, 0, -1, 30), bytes(30)),
    # a reader that took the -1 would step back a byte and read on: 19 zeros after it
    # make a chunk of no records that ends the body
    "negative-length": (jnl._CHUNK.pack(0, 0, 1, -1), bytes(19)),
    "short-chunk-head": (b"", bytes(12)),
    "a-short-chunk-head-after-a-chunk": (jnl._CHUNK.pack(0, 0, 1, 10), bytes(10 + 12)),
}
"""Bodies of a whole entry (its CRCs right) that are no run of chunks: the chunk's
fields, then what follows them."""


@pytest.mark.parametrize("what", sorted(UNDECODABLE))
def test_a_whole_entry_whose_body_does_not_decode_is_no_entry(tmp_path: Path, what: str) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    journal.append(sized_round(0, 100))
    journal.sync()
    salt, position = journal.header.salt, journal.position
    journal.close()
    body = b"".join(UNDECODABLE[what])
    with open(tmp_path / JOURNAL_FILE_NAME, "r+b") as f:
        f.seek(position)
        f.write(forged_entry(salt, 1, body))
    journal, found = Journal.open(REAL_FILES, tmp_path)
    journal.close()
    assert [e.sequence for e in found.entries] == [0], what
    assert (found.tail, found.position, found.sequence) == ("torn", position, 1), what


def test_the_room_the_live_entries_take(tmp_path: Path) -> None:
    """``used``: the bytes from the oldest entry not checkpointed to the writer's
    position (the padding included), round the end of the ring once it wrapped; what
    the engine checkpoints by."""
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    assert journal.used == 0
    positions = [journal.append(sized_round(n, 300)) for n in range(3)]
    assert journal.used == 3 * ALIGN
    journal.checkpointed(positions[1])
    assert journal.used == 2 * ALIGN
    journal.append(sized_round(3, 2 * ALIGN))
    journal.append(sized_round(4, 3 * ALIGN))  # ends at the end of the ring
    assert journal.used == 7 * ALIGN
    journal.checkpointed(positions[2])
    assert journal.append(sized_round(5, 300)) == HEADER_BLOCK  # wrapped
    assert journal.used == 7 * ALIGN
    journal.close()


class OpenFiles(Files):
    """The real file system, counting the fds open."""

    def __init__(self) -> None:
        self.open_fds: set[int] = set()

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.open_fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self.open_fds.discard(fd)
        super().close(fd)


@pytest.mark.parametrize("damage", ["header", "short-file", "damaged-entries"])
def test_an_open_that_fails_leaves_no_file_open(tmp_path: Path, damage: str) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = [journal.append(sized_round(n, 100)) for n in range(3)]
    journal.sync()
    journal.close()
    path = tmp_path / JOURNAL_FILE_NAME
    with open(path, "r+b") as f:
        if damage == "header":
            f.seek(10)
            f.write(b"\xff")
        elif damage == "short-file":
            f.truncate(HEADER_BLOCK + 4 * ALIGN)
        else:
            f.seek(positions[1])
            f.write(b"\x00")
    files = OpenFiles()
    with pytest.raises(CorruptionError):
        Journal.open(files, tmp_path)
    assert files.open_fds == set()


def test_a_create_that_fails_leaves_no_file_open(tmp_path: Path) -> None:
    class NoFlush(OpenFiles):
        def fsync(self, fd: int) -> None:
            raise OSError(5, "the flush failed")

    files = NoFlush()
    with pytest.raises(OSError, match="the flush failed"):
        Journal.create(files, tmp_path, KEY, 8 * ALIGN)
    assert files.open_fds == set()


def records_chunk(pid: int, first: int, count: int) -> Chunk:
    blob = b"".join(fmt.encode_record(make_record(t, pid)) for t in range(first, first + count))
    return Chunk(pid, first, count, blob)


def test_a_replay_skips_a_partition_not_hosted_and_goes_on_with_the_entry() -> None:
    entries = [
        jnl.Entry(HEADER_BLOCK, 0, 0, (records_chunk(0, 0, 2),)),
        jnl.Entry(HEADER_BLOCK + ALIGN, 1, 0, (records_chunk(9, 5, 1), records_chunk(0, 2, 3))),
    ]
    plan = jnl.replay_plan(entries, {0: 1})
    assert [(c.first_txid, c.count) for c in plan[0]] == [(1, 1), (2, 3)]
    assert plan[0][1] == records_chunk(0, 2, 3)


def header_bytes(version: int) -> bytes:
    """A header's fields and CRC as the module's docstring lays them out."""
    fields = struct.pack(">4siq16sq8s", b"WJNL", version, 1234, KEY.bytes, 4096, b"saltsalt")
    return fields + struct.pack(">I", crc32c.crc32c(fields))


def test_the_header_is_version_1_in_its_4_kib_block() -> None:
    header = jnl.decode_header(header_bytes(1))
    assert (header.version, header.created_ms, header.cluster_key) == (1, 1234, KEY)
    assert (header.body_size, header.salt) == (4096, b"saltsalt")
    assert jnl.encode_header(header) == header_bytes(1).ljust(HEADER_BLOCK, b"\0")
    with pytest.raises(StorageError, match="journal version 2; this Waltz reads version 1"):
        jnl.decode_header(header_bytes(2))


@pytest.mark.parametrize("body_size", [0, ALIGN // 2, 2 * ALIGN - 24, 2 * ALIGN + 1])
def test_a_body_size_not_a_multiple_of_a_sector_is_refused(tmp_path: Path, body_size: int) -> None:
    with pytest.raises(StorageError, match=f"journal body size {body_size}: a multiple of 512"):
        Journal.create(REAL_FILES, tmp_path, KEY, body_size)
    assert not (tmp_path / JOURNAL_FILE_NAME).exists()


def test_a_journal_of_one_sector_holds_a_round_at_a_time(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, ALIGN)
    assert journal.append(sized_round(0, ALIGN)) == HEADER_BLOCK
    assert not journal.fits(1)
    journal.checkpointed(journal.position)
    assert journal.append(sized_round(1, 100)) == HEADER_BLOCK
    journal.sync()
    journal.close()
    _, found = Journal.open(REAL_FILES, tmp_path, (HEADER_BLOCK, 1))
    assert [list(e.chunks) for e in found.entries] == [sized_round(1, 100)]


def test_a_wrapped_entry_may_end_right_at_the_oldest_live_one(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = [journal.append(sized_round(n, 300)) for n in range(4)]
    journal.checkpointed(positions[2])  # rounds 0 and 1 are in durable segments
    journal.append(sized_round(4, 4 * ALIGN))  # up to the end of the ring
    assert journal.fits(2 * ALIGN) and not journal.fits(2 * ALIGN + 1)
    assert journal.append(sized_round(5, 2 * ALIGN)) == HEADER_BLOCK  # ends at round 2
    journal.sync()
    journal.close()
    _, found = Journal.open(REAL_FILES, tmp_path, (positions[2], 2))
    assert [e.sequence for e in found.entries] == [2, 3, 4, 5]


def test_a_round_that_would_wrap_onto_live_entries_is_refused(tmp_path: Path) -> None:
    # not wrapped yet: the round does not fit before the end, and the start of the ring
    # up to the oldest live entry is too small for it
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = [journal.append(sized_round(n, 300)) for n in range(6)]
    journal.checkpointed(positions[2])
    assert not journal.fits(3 * ALIGN)
    with pytest.raises(StorageError, match="journal is full"):
        journal.append(sized_round(6, 3 * ALIGN))
    assert journal.append(sized_round(6, 300)) == positions[5] + ALIGN
    journal.close()


def test_a_checkpoint_that_does_not_move_keeps_a_wrapped_writer_wrapped(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 8 * ALIGN)
    positions = [journal.append(sized_round(n, 300)) for n in range(8)]
    journal.checkpointed(positions[4])
    assert [journal.append(sized_round(n, 300)) for n in range(8, 11)] == positions[:3]
    journal.checkpointed(positions[4])  # the same again: nothing more is durable
    assert journal.used == 7 * ALIGN
    assert journal.fits(ALIGN) and not journal.fits(2 * ALIGN)
    assert journal.append(sized_round(11, 300)) == positions[3]
    assert not journal.fits(1)
    journal.close()


def test_the_damage_names_the_first_five_whole_entries_past_it(tmp_path: Path) -> None:
    journal = Journal.create(REAL_FILES, tmp_path, KEY, 16 * ALIGN)
    positions = [journal.append(sized_round(n, 100)) for n in range(9)]
    journal.sync()
    journal.close()
    with open(tmp_path / JOURNAL_FILE_NAME, "r+b") as f:
        f.seek(positions[1])
        f.write(b"\0")
    later = ", ".join(f"#{n} at {positions[n]}" for n in range(2, 7))
    expected = f"entry #1 at offset {positions[1]} is not whole, but later entries are ({later})"
    with pytest.raises(CorruptionError, match=re.escape(expected)):
        Journal.open(REAL_FILES, tmp_path)


def test_an_invalid_record_in_a_replay_is_named_by_its_id() -> None:
    chunk = records_chunk(0, 10, 4)
    second = len(fmt.encode_record(make_record(10, 0)))
    broken = Chunk(0, 10, 4, chunk.blob[: second + 5] + b"?" + chunk.blob[second + 6 :])
    entries = [jnl.Entry(HEADER_BLOCK, 0, 0, (broken,))]
    with pytest.raises(CorruptionError, match="partition 0's record 11 is invalid"):
        jnl.replay_plan(entries, {0: 13})


def test_a_header_of_exactly_its_fields_decodes() -> None:
    header = jnl.JournalHeader(jnl.JOURNAL_VERSION, 1234, KEY, 8 * ALIGN, b"saltsalt")
    raw = jnl.encode_header(header)
    fields = jnl._HEADER.size + jnl._CRC.size
    assert jnl.decode_header(raw[:fields]) == header
    with pytest.raises(CorruptionError, match=f"header is short \\({fields - 1} bytes\\)"):
        jnl.decode_header(raw[: fields - 1])
