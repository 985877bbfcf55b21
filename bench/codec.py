"""Wire codec throughput: encode+decode round trips per second.

Prints, for an AppendRequest (100-byte data, 2 write locks) and for FeedData:
the codec's round trips/s, and beside them, in the same run, a bare ``struct``
pack/unpack of the same fields (the floor any Python codec pays), plus the
frame sizes. Several repeats; the best and the median are printed (the machine
is shared, so the best is the least disturbed figure); the cases are run
interleaved so that each sees the same load. Never pass/fail.

    .venv/bin/python bench/codec.py [--repeats 9] [--number 20000] [--wall]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import time
import timeit
from collections.abc import Callable

from waltz_api import wire
from waltz_api.messages import AppendRequest, FeedData, RecordListResponse
from waltz_api.types import Lock, LockMode, LockRequest, Record, ReqId


def _line(label: str, best: float, median: float, reference: float | None = None) -> str:
    text = f"  {label:<44} best {best:>11,.0f}/s   median {median:>11,.0f}/s"
    if reference:
        text += f"   ({best / reference:.0%} of bare struct)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument(
        "--wall",
        action="store_true",
        help="time by the wall clock (default: this process's CPU time, steadier when the "
        "machine is shared)",
    )
    args = parser.parse_args()
    timer = time.perf_counter if args.wall else time.process_time
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

    rid_fields = (17, 3, 5, 123456)
    values = (99_999, locks, 7, data, append.checksum)
    new, setattr_ = object.__new__, object.__setattr__

    def via_init() -> object:
        return AppendRequest(ReqId(*rid_fields), *values)

    def via_object_setattr() -> object:
        req_id = new(ReqId)
        setattr_(req_id, "client_id", 17)
        setattr_(req_id, "generation", 3)
        setattr_(req_id, "partition_id", 5)
        setattr_(req_id, "seq_num", 123456)
        message = new(AppendRequest)
        setattr_(message, "req_id", req_id)
        setattr_(message, "client_high_water_mark", 99_999)
        setattr_(message, "locks", locks)
        setattr_(message, "header", 7)
        setattr_(message, "data", data)
        setattr_(message, "checksum", append.checksum)
        return message

    make_req_id = wire.construct.make_req_id
    make_append = wire.construct.make_constructor(AppendRequest)

    def via_slot_descriptors() -> object:
        return make_append(make_req_id(*rid_fields), *values)

    assert via_init() == via_object_setattr() == via_slot_descriptors()

    append_section = "AppendRequest (100-byte data, 2 write locks), round trips/s"
    feed_section = "FeedData, round trips/s"
    records_section = "RecordListResponse (100 records of 100 bytes), records/s"
    build_section = "building a decoded AppendRequest + ReqId, objects/s"
    bare = "bare struct pack+unpack (reference)"
    # (section, label, function, calls per run, items per call, reference label in section)
    cases: list[tuple[str, str, Callable[[], object], int, int, str | None]] = [
        (append_section, bare, bare_append, n, 1, None),
        (append_section, "wire.encode + wire.decode", codec_append, n, 1, bare),
        (append_section, "  wire.encode alone", lambda: encode(append), n, 1, None),
        (append_section, "  wire.decode alone (with CRC-32C check)",
         lambda: decode(append_frame), n, 1, None),
        (feed_section, bare, bare_feed, n, 1, None),
        (feed_section, "wire.encode + wire.decode", codec_feed, n, 1, bare),
        (feed_section, "encode_feed_data (x1000) + decode", batch_feed, max(1, n // 1000), 1000,
         bare),
        (records_section, "wire.encode + wire.decode", codec_records, max(1, n // 100), 100,
         None),
        (build_section, "dataclass __init__ (frozen)", via_init, n, 1, None),
        (build_section, "object.__new__ + object.__setattr__", via_object_setattr, n, 1, None),
        (build_section, "object.__new__ + slot descriptors (used)", via_slot_descriptors, n, 1,
         None),
    ]  # fmt: skip
    # Interleaved: every repeat runs every case once, so all see the same machine load.
    rates: dict[tuple[str, str], list[float]] = {(c[0], c[1]): [] for c in cases}
    for _ in range(r):
        for section, label, fn, number, items, _ in cases:
            elapsed = timeit.Timer(fn, timer=timer).timeit(number=number)
            rates[section, label].append(number * items / elapsed)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    clock = "wall-clock" if args.wall else "CPU (process_time)"
    print(f"wire codec: {r} interleaved repeats, {clock} seconds; best and median")
    current = ""
    for section, label, _, _, _, reference in cases:
        if section != current:
            current = section
            print(f"{section}:")
        runs = rates[section, label]
        ref = max(rates[section, reference]) if reference else None
        print(_line(label, max(runs), statistics.median(runs), ref))
    print("bytes per message:")
    print(f"  AppendRequest (100-byte data, 2 locks)  {len(append_frame)}")
    print(f"  FeedData                                {len(feed_frame)}")
    print(f"  RecordListResponse (100 x 100 bytes)    {len(encode(record_list))}")


if __name__ == "__main__":
    main()
