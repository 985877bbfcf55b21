"""Wire codec throughput: encode+decode round trips per second.

Prints, for an AppendRequest (100-byte data, 2 write locks) and for FeedData:
the codec's round trips/s, and beside them, in the same run, a bare ``struct``
pack/unpack of the same fields (the floor any Python codec pays), plus the
frame sizes. Several repeats; the best and the median are printed (the machine
is shared, so the best is the least disturbed figure). Never pass/fail.

    .venv/bin/python bench/codec.py [--repeats 7] [--number 50000]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import struct
import timeit
from collections.abc import Callable

from waltz_api import wire
from waltz_api.messages import AppendRequest, FeedData, RecordListResponse
from waltz_api.types import Lock, LockMode, LockRequest, Record, ReqId


def _rate(fn: Callable[[], object], number: int, repeats: int) -> tuple[float, float]:
    """(best, median) calls per second of ``fn`` over ``repeats`` runs of ``number`` calls."""
    times = timeit.repeat(fn, number=number, repeat=repeats)
    rates = [number / t for t in times]
    return max(rates), statistics.median(rates)


def _line(label: str, best: float, median: float, reference: float | None = None) -> str:
    text = f"  {label:<44} best {best:>11,.0f}/s   median {median:>11,.0f}/s"
    if reference:
        text += f"   ({best / reference:.0%} of bare struct)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=50_000)
    args = parser.parse_args()
    n, r = args.number, args.repeats

    data = bytes(range(100))
    locks = LockRequest.from_locks(
        [Lock("account", 1, LockMode.WRITE), Lock("account", 2, LockMode.WRITE)]
    )
    append = AppendRequest(ReqId(17, 3, 5, 123456), 99_999, locks, 7, data, wire.checksum(data))
    append_frame = wire.encode(append)
    feed = FeedData(ReqId(17, 3, 5, 123456), 1_000_000, 7)
    feed_frame = wire.encode(feed)
    encode, decode = wire.encode, wire.decode
    assert decode(append_frame) == append and decode(feed_frame) == feed

    # Bare struct: the same fields, packed and unpacked, no objects built.
    append_struct = struct.Struct(">BBiiiiqIIIiII2Q")
    rid, lw = append.req_id, locks.write

    def bare_append() -> object:
        frame = (
            append_struct.pack(
                12,
                1,
                rid.client_id,
                rid.generation,
                rid.partition_id,
                rid.seq_num,
                99_999,
                0,
                2,
                0,
                7,
                100,
                append.checksum,
                lw[0],
                lw[1],
            )
            + data
        )
        fields = append_struct.unpack_from(frame, 0)
        return fields, frame[append_struct.size :]

    feed_struct = struct.Struct(">BBiiiiqi")

    def bare_feed() -> object:
        return feed_struct.unpack_from(feed_struct.pack(14, 1, 17, 3, 5, 123456, 1_000_000, 7), 0)

    def codec_append() -> object:
        return decode(encode(append))

    def codec_feed() -> object:
        return decode(encode(feed))

    batch = [FeedData(ReqId(17, 3, 5, i), i, 7) for i in range(1000)]
    encode_feed_data = wire.encode_feed_data

    def batch_feed() -> object:
        return [decode(f) for f in encode_feed_data(batch)]

    records = tuple(Record(i, ReqId(17, 3, 5, i), 7, data, wire.checksum(data)) for i in range(100))
    record_list = RecordListResponse(1, 2, 5, records)

    def codec_records() -> object:
        return decode(encode(record_list))

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"wire codec: {r} repeats of {n:,} calls; best and median round trips/s")
    print("AppendRequest (100-byte data, 2 write locks):")
    best, median = _rate(bare_append, n, r)
    print(_line("bare struct pack+unpack (reference)", best, median))
    ref = best
    best, median = _rate(codec_append, n, r)
    print(_line("wire.encode + wire.decode", best, median, ref))
    best, median = _rate(lambda: encode(append), n, r)
    print(_line("  wire.encode alone", best, median))
    best, median = _rate(lambda: decode(append_frame), n, r)
    print(_line("  wire.decode alone (incl. CRC-32C check)", best, median))
    print("FeedData:")
    best, median = _rate(bare_feed, n, r)
    print(_line("bare struct pack+unpack (reference)", best, median))
    ref = best
    best, median = _rate(codec_feed, n, r)
    print(_line("wire.encode + wire.decode", best, median, ref))
    best, median = _rate(batch_feed, max(1, n // 1000), r)
    print(_line("encode_feed_data (x1000) + decode", best * 1000, median * 1000, ref))
    print("RecordListResponse (100 records of 100 bytes):")
    best, median = _rate(codec_records, max(1, n // 100), r)
    print(_line("wire.encode + wire.decode, records/s", best * 100, median * 100))
    print("building a decoded AppendRequest + its ReqId (construction alternatives):")
    rid_fields = (17, 3, 5, 123456)
    values = (99_999, locks, 7, data, append.checksum)
    new, setattr_ = object.__new__, object.__setattr__
    req_names = [f.name for f in dataclasses.fields(ReqId)]
    append_names = [f.name for f in dataclasses.fields(AppendRequest)]

    def via_init() -> object:
        return AppendRequest(ReqId(*rid_fields), *values)

    def via_object_setattr() -> object:
        req_id = new(ReqId)
        for name, value in zip(req_names, rid_fields, strict=True):
            setattr_(req_id, name, value)
        message = new(AppendRequest)
        for name, field_value in zip(append_names, (req_id, *values), strict=True):
            setattr_(message, name, field_value)
        return message

    make_req_id = wire._make_req_id
    make_append = wire._make_constructor(AppendRequest)

    def via_slot_descriptors() -> object:
        return make_append(make_req_id(*rid_fields), *values)

    assert via_init() == via_object_setattr() == via_slot_descriptors()
    for label, fn in (
        ("dataclass __init__ (frozen)", via_init),
        ("object.__new__ + object.__setattr__ loop", via_object_setattr),
        ("object.__new__ + slot descriptors (used)", via_slot_descriptors),
    ):
        best, median = _rate(fn, n, r)
        print(_line(label, best, median))
    print("bytes per message:")
    print(f"  AppendRequest (100-byte data, 2 locks)  {len(append_frame)}")
    print(f"  FeedData                                {len(feed_frame)}")
    print(f"  RecordListResponse (100 x 100 bytes)    {len(encode(record_list))}")


if __name__ == "__main__":
    main()
