"""How a damaged record reads back from a simulated disk: the kinds of damage a storage
fault leaves (:attr:`waltz_sim.disk.PartitionImage.corrupt`) and what a read of one
raises, worded as the ``fs`` engine words it."""

from __future__ import annotations

INDEX_CHECKPOINT = 1000
"""The ``fs`` engine's default index checkpoint interval: its start-up recovery trusts
the index up to the last checkpoint and reads only the records after it (a simulated
log is shorter: it reads them all); damage below it is found on read."""
ZEROS = "zeros"
"""A record whose bytes read back as zeros (a write that never reached the disk)."""
CHECKSUM = "checksum"
"""A record whose bytes changed at rest (its checksums fail)."""
STALE = "stale"
"""A record whose place holds older bytes of something else (a lost write)."""
HOLDS = "holds "
"""Prefix of a record whose place holds another record (``holds 40``: a misdirected
write of transaction 40)."""


def corruption_message(partition_id: int, transaction_id: int, how: str) -> str:
    """What a read of a corrupt record raises (as the ``fs`` engine words it)."""
    if how.startswith(HOLDS):
        other = how[len(HOLDS) :]
        return (
            f"partition {partition_id}: the record stored as transaction {transaction_id} is "
            f"not transaction {transaction_id} (it holds {other}: a misdirected write)"
        )
    why = {
        ZEROS: "its bytes read back as zeros",
        STALE: "its place holds bytes of something else",
    }.get(how, "its data fails its CRC-32C checksum")
    return f"partition {partition_id}: transaction {transaction_id} is corrupt ({why})"


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, overlapping or adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


__all__ = [
    "CHECKSUM",
    "HOLDS",
    "INDEX_CHECKPOINT",
    "STALE",
    "ZEROS",
    "corruption_message",
    "merged",
]
