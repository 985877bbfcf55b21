"""The wire codec: round trips, the documented layout, checksums, limits, robustness.

(Above 800 lines on purpose: the strategies at the top serve every test below them
(round trips, the documented layout, the test vectors, the fuzzers); the blocks and the
connection have their own modules, test_wire_blocks.py and test_wire_connection.py.)"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import struct
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from waltz_api import wire
from waltz_api.errors import (
    ChecksumError,
    FrameTooLargeError,
    ProtocolError,
    VersionMismatchError,
)
from waltz_api.messages import (
    ALL_MESSAGES,
    AppendRequest,
    ErrorCode,
    FailureResponse,
    FeedData,
    Hello,
    HelloResponse,
    Message,
    MountResponse,
    MountStatus,
    RangeReadResponse,
    RecordHeaderListResponse,
    RecordHeaderResponse,
    RecordListResponse,
    RecordResponse,
    StorageAdminResponse,
    StorageAppendRequest,
    StorageOpenRequest,
    TransactionDataResponse,
)
from waltz_api.types import LockRequest, Record, RecordHeader, ReqId, SessionInfo

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies: valid values of every field -------------------------------------------------------

I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
U64 = st.integers(0, 2**64 - 1)
DATA = st.binary(max_size=300)
TEXT = st.text(max_size=40)

REQ_IDS = st.builds(ReqId, I32, I32, I32, I32)
SESSION_INFOS = st.builds(SessionInfo, I64, I64, I64, I64)
LOCK_REQUESTS = st.builds(
    LockRequest,
    st.lists(U64, max_size=3).map(tuple),
    # more than 64 hashes takes the codec's uncached struct path
    st.one_of(st.lists(U64, max_size=4), st.lists(U64, min_size=60, max_size=70)).map(tuple),
    st.lists(U64, max_size=3).map(tuple),
)


@st.composite
def records(draw: st.DrawFn) -> Record:
    data = draw(DATA)
    return Record(draw(I64), draw(REQ_IDS), draw(I32), data, wire.checksum(data))


RECORDS = records()
HEADERS = st.builds(RecordHeader, I64, REQ_IDS, I32)
RECORD_TUPLES = st.lists(RECORDS, max_size=4).map(tuple)
HEADER_TUPLES = st.lists(HEADERS, max_size=6).map(tuple)

_BY_KIND: dict[str, st.SearchStrategy[Any]] = {
    "i32": I32,
    "i64": I64,
    "u8": st.integers(0, 255),
    "u32": st.integers(0, 2**32 - 1),
    "bool": st.booleans(),
    "reqid": REQ_IDS,
    "session_info": SESSION_INFOS,
    "uuid": st.uuids(),
    "bytes": DATA,
    "str": TEXT,
    "versions": st.lists(st.integers(0, 255), max_size=6).map(tuple),
    "locks": LOCK_REQUESTS,
    "records": RECORD_TUPLES,
    "headers": HEADER_TUPLES,
    "opt_record": st.none() | RECORDS,
    "opt_header": st.none() | HEADERS,
}


def message_strategy(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Valid instances of ``cls`` (a checksum always matches its data)."""

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        values: dict[str, Any] = {}
        for field in wire.schema.SCHEMAS[cls]:
            if field.kind == "enum":
                assert field.enum_type is not None
                values[field.name] = draw(st.sampled_from(list(field.enum_type)))
            elif field.name == "checksum" and "data" in values:
                values["checksum"] = wire.checksum(values["data"])
            else:
                values[field.name] = draw(_BY_KIND[field.kind])
        return cls(**values)

    return build()


ANY_MESSAGE = st.sampled_from(ALL_MESSAGES).flatmap(message_strategy)


def append_request(data: bytes = bytes(range(100))) -> AppendRequest:
    return AppendRequest(
        ReqId(17, 3, 5, 123), 99, LockRequest((1,), (2, 3), ()), -7, data, wire.checksum(data)
    )


def sample_messages() -> list[Message]:
    """One message of every type, variable parts non-empty (deterministic)."""
    data = b"transaction-data"
    record = Record(41, ReqId(1, 2, 3, 4), 5, data, wire.checksum(data))
    header = record.record_header
    messages = []
    for cls in ALL_MESSAGES:
        values: dict[str, Any] = {}
        for field in wire.schema.SCHEMAS[cls]:
            values[field.name] = {
                "i32": 7,
                "i64": 1 << 40,
                "u8": 1,
                "u32": 0,
                "bool": True,
                "reqid": ReqId(1, 2, 3, 4),
                "session_info": SessionInfo(9, 8, 7, 6),
                "uuid": uuid.UUID(int=12345),
                "bytes": data,
                "str": "héllo",
                "versions": (1, 2),
                "locks": LockRequest((11,), (12, 13), (14,)),
                "records": (record, record),
                "headers": (header, header),
                "opt_record": record,
                "opt_header": header,
                "enum": ErrorCode.FENCED if cls is not MountResponse else MountStatus.READY,
            }[field.kind]
        if "checksum" in values:
            values["checksum"] = wire.checksum(values["data"])
        messages.append(cls(**values))
    return messages


SAMPLE_FRAMES = [wire.encode(message) for message in sample_messages()]
VECTORS = Path(__file__).parent / "data" / "wire_v1_vectors.txt"


def decodes_or_protocol_error(frame: bytes) -> Message | None:
    """Decode ``frame``; a ProtocolError is fine, any other exception fails the test.
    The frame decoded with ``record_blocks=True`` agrees (see blocks_agree), and so does
    a storage node's decode (see unverified_agrees)."""
    try:
        message = wire.decode(frame)
    except ProtocolError as exc:
        blocks_agree(frame, None, exc)
        unverified_agrees(frame, None)
        return None
    blocks_agree(frame, message, None)
    unverified_agrees(frame, message)
    # whatever decodes is a well-formed message that encodes back to the same frame
    # (Hello and HelloResponse are decoded whatever their version byte)
    reencoded = wire.encode(message)
    if message.TYPE in (Hello.TYPE, HelloResponse.TYPE):
        assert reencoded[0] == frame[0] and reencoded[2:] == frame[2:]
    else:
        assert reencoded == frame
    return message


def unverified_agrees(frame: bytes, verified: Message | None) -> None:
    """``verify_record_checksums=False`` (a storage node) raises only ProtocolError too,
    decodes whatever the default decodes to the same message, and what only it decodes
    (a record checksum left to the engine) encodes back to the same frame."""
    try:
        message = wire.decode(frame, verify_record_checksums=False)
    except ProtocolError:
        assert verified is None, "the storage node's decoder refused a valid frame"
        return
    if verified is not None:
        assert message == verified
    elif message.TYPE not in (Hello.TYPE, HelloResponse.TYPE):
        assert wire.encode(message) == frame


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_round_trip_every_message(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(message_strategy(cls))
    frame = wire.encode(message)
    assert frame[0] == cls.TYPE and frame[1] == wire.PROTOCOL_VERSION
    decoded = wire.decode(frame)
    assert type(decoded) is cls
    assert decoded == message
    assert hash(decoded) == hash(message) or _unhashable(message)
    assert wire.decode(memoryview(frame)) == message
    assert wire.decode(bytearray(frame)) == message


def _unhashable(message: Message) -> bool:
    try:
        hash(message)
    except TypeError:
        return True
    return False


def test_edge_values_round_trip() -> None:
    lo, hi = -(2**63), 2**63 - 1
    empty = Record(lo, ReqId(-(2**31), -(2**31), -(2**31), -(2**31)), -(2**31), b"", 0)
    full = Record(hi, ReqId(2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1), 2**31 - 1, b"\0", 0)
    full = dataclasses.replace(full, checksum=wire.checksum(full.data))
    for message in [
        RecordResponse(lo, hi, -(2**31), None),
        RecordResponse(hi, lo, 2**31 - 1, empty),
        RecordHeaderResponse(-1, -1, -1, None),
        RecordListResponse(0, 0, 0, ()),
        RecordListResponse(0, 0, 0, (empty, full)),
        RecordHeaderListResponse(1, 2, 3, ()),
        AppendRequest(ReqId(0, 0, 0, 0), -1, LockRequest(), 0, b"", 0),
        AppendRequest(ReqId(0, 0, 0, 0), -1, LockRequest((2**64 - 1,), (0,), ()), 0, b"", 0),
        TransactionDataResponse(ReqId(1, 1, 1, 1), 5, False, error="not found: ☃ \U0001f600"),
        StorageAdminResponse(3, True, b"{}"),
        Hello((), ""),
        HelloResponse(255),
        StorageOpenRequest(-1, -1, -1, uuid.UUID(int=2**128 - 1), 2**31 - 1),
        FailureResponse(1, 2, 3, ErrorCode.SERVER_BUSY, "", -1),
    ]:
        assert wire.decode(wire.encode(message)) == message


def test_decoded_messages_are_frozen_dataclasses() -> None:
    decoded = wire.decode(wire.encode(append_request()))
    assert isinstance(decoded, AppendRequest)
    assert decoded == append_request()
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.header = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.req_id.seq_num = 1  # type: ignore[misc]
    assert dataclasses.replace(decoded, header=1).header == 1
    assert repr(decoded) == repr(append_request())


def test_every_message_has_a_distinct_type_code_and_a_documented_layout() -> None:
    codes = [cls.TYPE for cls in ALL_MESSAGES]
    assert len(set(codes)) == len(codes)
    doc = wire.__doc__ or ""
    for cls in ALL_MESSAGES:
        assert re.search(rf"^\s+{cls.TYPE} +{cls.__name__} ", doc, re.MULTILINE), cls.__name__


_DOC_ALIASES = {
    "req_id": "ReqId",
    "session_info": "SessionInfo",
    "cluster_key": "cluster_key:UUID",
    "record": "present:bool",
    "record_header": "present:bool",
    "record_headers": "headers:u32",
}
_SESSION_FIELDS = ("session_id", "seq_num", "partition_id")


def _doc_entries() -> dict[int, str]:
    """The module docstring's message table: type code -> the entry's text."""
    doc = wire.__doc__ or ""
    entries: dict[int, str] = {}
    current: int | None = None
    for line in doc.splitlines():
        found = re.match(r"^\s{4}(\d+)\s+\w+\s+(.*)$", line)
        if found:
            current = int(found.group(1))
            entries[current] = found.group(2)
        elif current is not None and line.startswith(" " * 20) and line.strip():
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_documented_layout_names_every_field_in_wire_order(cls: type[Message]) -> None:
    entry = _doc_entries()[cls.TYPE]
    fixed = entry.split("|")[0]
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    if tuple(names[:3]) == _SESSION_FIELDS:
        assert fixed.startswith("S"), entry
        names = names[3:]
    position = 0
    for name in names:
        found = fixed.find(_DOC_ALIASES.get(name, name), position)
        assert found >= 0, f"{cls.__name__}.{name} missing (or out of order) in {entry!r}"
        position = found


# -- the documented layout, byte for byte ----------------------------------------------------------


def test_feed_data_layout() -> None:
    frame = wire.encode(FeedData(ReqId(1, -2, 3, 4), 2**40, -5))
    assert frame == struct.pack(">BBiiiiqi", 14, 1, 1, -2, 3, 4, 2**40, -5)
    assert len(frame) == 30


def test_append_request_layout() -> None:
    message = append_request(b"abc")
    expected = (
        struct.pack(
            ">BBiiiiqIIIiII", 12, 1, 17, 3, 5, 123, 99, 1, 2, 0, -7, 3, wire.checksum(b"abc")
        )
        + struct.pack(">3Q", 1, 2, 3)
        + b"abc"
    )
    assert wire.encode(message) == expected


def test_record_list_and_optional_layouts() -> None:
    record = Record(9, ReqId(1, 2, 3, 4), 5, b"xy", wire.checksum(b"xy"))
    record_bytes = struct.pack(">qiiiiiII", 9, 1, 2, 3, 4, 5, wire.checksum(b"xy"), 2) + b"xy"
    prefix = struct.pack(">qqi", 10, 11, 12)
    assert wire.encode(RecordListResponse(10, 11, 12, (record, record))) == (
        bytes([65, 1]) + prefix + struct.pack(">I", 2) + record_bytes * 2
    )
    assert wire.encode(RecordResponse(10, 11, 12, None)) == bytes([61, 1]) + prefix + b"\0"
    assert wire.encode(RecordHeaderResponse(10, 11, 12, record.record_header)) == (
        bytes([59, 1]) + prefix + b"\1" + struct.pack(">qiiiii", 9, 1, 2, 3, 4, 5)
    )
    assert wire.encode_records([record]) == record_bytes


def test_strings_and_hello_layout() -> None:
    assert wire.encode(Hello((1, 3), "é")) == (
        bytes([1, 1]) + struct.pack(">II", 2, 2) + bytes([1, 3]) + "é".encode()
    )
    frame = wire.encode(StorageAdminResponse(7, False, b"r", "err"))
    assert frame == bytes([81, 1]) + struct.pack(">q?II", 7, False, 1, 3) + b"r" + b"err"


def _read_vectors() -> dict[str, bytes]:
    vectors = {}
    for line in VECTORS.read_text().splitlines():
        if line and not line.startswith("#"):
            _, name, frame = line.split()
            vectors[name] = bytes.fromhex(frame)
    return vectors


def test_test_vectors_of_every_message() -> None:
    """The frames of tests/data/wire_v1_vectors.txt (test vectors for other implementations).

    A change here is a change of protocol version 1: only regenerate the file
    (``python packages/waltz-api/tests/test_wire.py``) for a deliberate, announced change.
    """
    vectors = _read_vectors()
    messages = sample_messages()
    assert sorted(vectors) == sorted(type(m).__name__ for m in messages)
    for message in messages:
        frame = vectors[type(message).__name__]
        assert wire.encode(message) == frame, type(message).__name__
        assert wire.decode(frame) == message


def test_checksum_is_crc32c() -> None:
    # the CRC-32C check value (RFC 3720 B.4)
    assert wire.checksum(b"123456789") == 0xE3069283
    assert wire.checksum(b"") == 0


# -- checksums -------------------------------------------------------------------------------------


def test_append_request_checksum_mismatch() -> None:
    bad = dataclasses.replace(append_request(), checksum=append_request().checksum ^ 1)
    with pytest.raises(ChecksumError, match="CRC-32C"):
        wire.decode(wire.encode(bad))


def test_transaction_data_response_checksum_mismatch() -> None:
    bad = TransactionDataResponse(ReqId(1, 1, 1, 1), 5, True, b"data", 12345)
    with pytest.raises(ChecksumError):
        wire.decode(wire.encode(bad))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda r: StorageAppendRequest(1, 2, 3, (r,)),
        lambda r: RecordResponse(1, 2, 3, r),
        lambda r: RecordListResponse(1, 2, 3, (r,)),
        lambda r: RangeReadResponse(ReqId(1, 2, 3, 4), 5, (r,)),
    ],
    ids=["StorageAppendRequest", "RecordResponse", "RecordListResponse", "RangeReadResponse"],
)
def test_record_checksum_mismatch(wrap: Any) -> None:
    good = Record(7, ReqId(1, 2, 3, 4), 5, b"payload", wire.checksum(b"payload"))
    bad = dataclasses.replace(good, data=b"paylaod")
    assert wire.decode(wire.encode(wrap(good))) == wrap(good)
    with pytest.raises(ChecksumError, match="transaction 7"):
        wire.decode(wire.encode(wrap(bad)))


def test_corrupted_data_bytes_raise_checksum_error() -> None:
    frame = bytearray(wire.encode(append_request()))
    for position in range(len(frame) - 100, len(frame)):
        corrupted = bytearray(frame)
        corrupted[position] ^= 0x10
        with pytest.raises(ChecksumError):
            wire.decode(bytes(corrupted))


# -- limits ----------------------------------------------------------------------------------------


def test_max_frame_size() -> None:
    assert wire.DEFAULT_MAX_FRAME_SIZE == 64 * 1024 * 1024
    message = append_request(b"x" * 1000)
    frame = wire.encode(message)
    assert wire.decode(frame, max_frame_size=len(frame)) == message
    with pytest.raises(FrameTooLargeError, match="maximum frame size"):
        wire.decode(frame, max_frame_size=len(frame) - 1)
    with pytest.raises(FrameTooLargeError, match="maximum frame size"):
        wire.encode(message, max_frame_size=len(frame) - 1)
    assert wire.encode(message, max_frame_size=len(frame)) == frame


def test_default_max_frame_size_refuses_a_huge_frame() -> None:
    for function in (wire.encode, wire.decode, wire.encode_stream):
        default = inspect.signature(function).parameters["max_frame_size"].default
        assert default == wire.DEFAULT_MAX_FRAME_SIZE
    huge = bytearray(wire.DEFAULT_MAX_FRAME_SIZE + 4)
    huge[0:2] = bytes([12, 1])
    for frame in (huge, memoryview(huge), memoryview(huge).cast("I")):
        with pytest.raises(FrameTooLargeError):
            wire.decode(frame)


def _fixed_append(**overrides: int) -> bytes:
    values = {
        "client_id": 1,
        "hwm": 2,
        "n_read": 0,
        "n_write": 0,
        "n_append": 0,
        "header": 0,
        "data_len": 0,
        "crc": 0,
    }
    values.update(overrides)
    return struct.pack(
        ">BBiiiiqIIIiII",
        12,
        1,
        values["client_id"],
        1,
        1,
        1,
        values["hwm"],
        values["n_read"],
        values["n_write"],
        values["n_append"],
        values["header"],
        values["data_len"],
        values["crc"],
    )


@pytest.mark.parametrize(
    "frame",
    [
        _fixed_append(data_len=2**32 - 1),
        _fixed_append(n_read=2**32 - 1),
        _fixed_append(n_read=2**32 - 1, n_write=2**32 - 1, n_append=2**32 - 1),
        _fixed_append(n_write=100) + bytes(8 * 99),
        bytes([65, 1]) + struct.pack(">qqiI", 1, 2, 3, 2**32 - 1),
        bytes([63, 1]) + struct.pack(">qqiI", 1, 2, 3, 2**32 - 1),
        bytes([65, 1]) + struct.pack(">qqiI", 1, 2, 3, 1) + struct.pack(">qiiiiiII", *[0] * 7, 99),
        bytes([1, 1]) + struct.pack(">II", 2**32 - 1, 0),
        bytes([24, 1]) + struct.pack(">iiiiBI", 1, 1, 1, 1, 0, 2**31),
    ],
    ids=[
        "data-len",
        "lock-count",
        "all-lock-counts",
        "short-locks",
        "record-count",
        "header-count",
        "record-data",
        "versions",
        "string",
    ],
)
def test_huge_declared_lengths_are_rejected_without_allocating(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="truncated"):
        wire.decode(frame)


# -- malformed frames ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "shorter than"),
        (b"\x0e", "shorter than"),
        (bytes([200, 1]), "unknown message type 200"),
        (bytes([0, 1]), "unknown message type 0"),
        (bytes([14, 9]) + bytes(28), "version 9"),
        (bytes([14, 1]) + bytes(27), "truncated FeedData"),
        (bytes([14, 1]) + bytes(29), "trailing"),
        (wire.encode(append_request()) + b"\0", "trailing"),
        (bytes([11, 1]) + bytes(16) + b"\x07" + bytes(8), "MountResponse"),  # bad enum
        (bytes([67, 1]) + bytes(20) + b"\xff" + bytes(12), "FailureResponse"),  # bad enum
        (bytes([16, 1]) + bytes(24) + b"\x02" + bytes(12), "TransactionDataResponse"),  # bool
        (bytes([81, 1]) + bytes(8) + b"\x01" + struct.pack(">II", 0, 1) + b"\xff", "UTF-8|utf-8"),
        (bytes([61, 1]) + bytes(20) + b"\x02", "presence byte 2"),
        (bytes([59, 1]) + bytes(20) + b"\x05" + bytes(28), "presence byte 5"),
        (bytes([61, 1]) + bytes(20) + b"\x01" + bytes(10), "truncated"),
    ],
)
def test_malformed_frames(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(frame)


def test_hello_is_decoded_whatever_its_version_byte() -> None:
    frame = bytearray(wire.encode(Hello((1, 2, 3), "client:1")))
    frame[1] = 77
    assert wire.decode(bytes(frame)) == Hello((1, 2, 3), "client:1")


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(TypeError):
        wire.decode("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        wire.decode(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "message",
    [
        FeedData(ReqId(2**31, 0, 0, 0), 0, 0),
        FeedData(ReqId(0, 0, 0, 0), 2**63, 0),
        FeedData(ReqId(0, 0, 0, 0), 0, 2**31),
        AppendRequest(ReqId(0, 0, 0, 0), 0, LockRequest((-1,), (), ()), 0, b"", 0),
        AppendRequest(ReqId(0, 0, 0, 0), 0, LockRequest((), (), ()), 0, b"", -1),
        AppendRequest(ReqId(0, 0, 0, 0), 0, LockRequest(), 0, "text", 0),  # type: ignore[arg-type]
        Hello((256,), "x"),
        Hello((1,), "\ud800"),
        HelloResponse(-1),
        MountResponse(ReqId(0, 0, 0, 0), 9, 0),  # type: ignore[arg-type]
        RecordListResponse(0, 0, 0, (None,)),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses_values_outside_their_wire_type(message: Message) -> None:
    with pytest.raises(ProtocolError, match="cannot encode"):
        wire.encode(message)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError, match=r"not a waltz_api\.messages message"):
        wire.encode(ReqId(1, 2, 3, 4))  # type: ignore[arg-type]


def blocks_agree(frame: bytes, eager: Message | None, error: ProtocolError | None) -> None:
    """``record_blocks=True`` refuses only frames the eager decoder refuses, and accepts
    those it refuses only for a checksum; a block whose checksums fail raises
    ChecksumError when checked or read; a block re-encodes to the same frame."""
    blocks = frame[:1] in (bytes([RangeReadResponse.TYPE]), bytes([RecordListResponse.TYPE]))
    try:
        lazy = wire.decode(frame, record_blocks=True)
    except ChecksumError:
        assert not blocks, "a block decode checked a checksum"
        assert isinstance(error, ChecksumError)
        return
    except ProtocolError:
        # a malformed structure (the eager decoder may have met a bad checksum first)
        assert eager is None and error is not None
        return
    records = getattr(lazy, "records", None)
    if eager is None:
        assert isinstance(error, ChecksumError)
        assert isinstance(records, wire.RecordBlock)
        with pytest.raises(ChecksumError):
            records.check()
        with pytest.raises(ChecksumError):
            records.records()
        return
    assert lazy == eager
    if isinstance(records, wire.RecordBlock):
        assert wire.encode(lazy) == frame
        assert records.offsets() == records.check()
        assert records.records() == eager.records  # type: ignore[attr-defined]


# -- fuzz ------------------------------------------------------------------------------------------
#
# The same inputs on every CI run (derandomized); for a long run, WALTZ_FUZZ_ITERATIONS inputs
# per fuzzer and WALTZ_FUZZ_SEED (as the transport suite's control-plane fuzzers take them):
#     WALTZ_FUZZ_ITERATIONS=200000 WALTZ_FUZZ_SEED=7 pytest test_wire.py -k fuzz

FUZZ_ITERATIONS = int(os.environ.get("WALTZ_FUZZ_ITERATIONS") or 0)
FUZZ_SEED = os.environ.get("WALTZ_FUZZ_SEED")
Test = TypeVar("Test", bound=Callable[..., None])


def fuzzer(ci_examples: int) -> Callable[[Test], Test]:
    """Settings of a codec fuzzer (put above ``@given``): ``ci_examples`` fixed inputs, or
    the long run's iterations and seed."""

    def decorate(test: Test) -> Test:
        configured = settings(
            max_examples=FUZZ_ITERATIONS or ci_examples,
            deadline=None,
            derandomize=FUZZ_SEED is None,
            database=None,
        )(test)
        return configured if FUZZ_SEED is None else seed(int(FUZZ_SEED))(configured)

    return decorate


@fuzzer(300)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(frame: bytes) -> None:
    decodes_or_protocol_error(frame)


@fuzzer(300)
@given(st.sampled_from([cls.TYPE for cls in ALL_MESSAGES]), st.binary(max_size=200))
def test_fuzz_random_bodies_of_every_type(type_code: int, body: bytes) -> None:
    decodes_or_protocol_error(bytes([type_code, 1]) + body)


@fuzzer(60)
@given(ANY_MESSAGE, st.data())
def test_fuzz_mutated_valid_frames(message: Message, data: st.DataObject) -> None:
    frame = bytearray(wire.encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] = data.draw(st.integers(0, 255))
    decodes_or_protocol_error(bytes(frame))


@pytest.mark.parametrize("frame", SAMPLE_FRAMES, ids=lambda f: wire.codec.NAMES[f[0]])
def test_every_truncation_and_extension_of_a_valid_frame_is_refused(frame: bytes) -> None:
    for end in range(len(frame)):
        with pytest.raises(ProtocolError):
            wire.decode(frame[:end])
    for extra in (b"\0", b"\xff" * 9):
        with pytest.raises(ProtocolError):
            wire.decode(frame + extra)


@pytest.mark.parametrize("frame", SAMPLE_FRAMES, ids=lambda f: wire.codec.NAMES[f[0]])
def test_every_bit_flip_of_a_valid_frame(frame: bytes) -> None:
    original = wire.decode(frame)
    for bit in range(len(frame) * 8):
        flipped = bytearray(frame)
        flipped[bit // 8] ^= 1 << (bit % 8)
        decoded = decodes_or_protocol_error(bytes(flipped))
        if bit // 8 == 1 and frame[0] in (Hello.TYPE, HelloResponse.TYPE):
            assert decoded == original  # the handshake ignores the version byte
        else:
            assert decoded != original


# -- batch helpers ---------------------------------------------------------------------------------


@FAST
@given(st.lists(message_strategy(FeedData), max_size=20))
def test_encode_feed_data_matches_encode(feed: list[FeedData]) -> None:
    frames = wire.encode_feed_data(feed)
    assert frames == [wire.encode(m) for m in feed]
    assert [wire.decode(f) for f in frames] == feed


@FAST
@given(st.lists(message_strategy(FeedData), max_size=20))
def test_encode_feed_data_of_records_announces_them(feed: list[FeedData]) -> None:
    # the server encodes the frames from the committed records themselves
    records = [Record(m.transaction_id, m.req_id, m.header, b"x", 0) for m in feed]
    headers = [r.record_header for r in records]
    assert wire.encode_feed_data(records) == wire.encode_feed_data(headers)
    assert [wire.decode(f) for f in wire.encode_feed_data(records)] == feed


def test_encode_feed_data_refuses_bad_values() -> None:
    with pytest.raises(ProtocolError):
        wire.encode_feed_data([FeedData(ReqId(0, 0, 0, 0), 0, 2**31)])


# -- stream framing --------------------------------------------------------------------------------


@FAST
@given(st.lists(ANY_MESSAGE, max_size=6), st.lists(st.integers(1, 50), max_size=40))
def test_frame_buffer_across_arbitrary_chunkings(messages: list[Message], cuts: list[int]) -> None:
    stream = wire.encode_stream(messages)
    buffer = wire.FrameBuffer()
    received: list[Message] = []
    position = 0
    chunk_sizes = iter(cuts)
    while position < len(stream):
        size = next(chunk_sizes, len(stream))
        buffer.receive_data(stream[position : position + size])
        position += size
        received += [wire.decode(frame) for frame in buffer.frames()]
    buffer.receive_data(b"")
    assert buffer.next_frame() is None
    assert buffer.at_eof
    assert received == messages


def test_frame_buffer_refuses_a_huge_frame_before_buffering_it() -> None:
    buffer = wire.FrameBuffer(max_frame_size=1000)
    buffer.receive_data(wire.frame_length_prefix(b"x" * 1000) + b"x" * 1000)
    assert buffer.next_frame() == b"x" * 1000
    with pytest.raises(FrameTooLargeError, match="1001 bytes"):
        buffer.receive_data(struct.pack(">I", 1001) + b"x" * 10)
    assert buffer.buffered == 0
    with pytest.raises(FrameTooLargeError):  # the buffer stays failed
        buffer.receive_data(b"more")
    with pytest.raises(FrameTooLargeError):
        buffer.next_frame()


def test_frame_buffer_checks_the_next_length_as_soon_as_it_arrives() -> None:
    buffer = wire.FrameBuffer(max_frame_size=10)
    with pytest.raises(FrameTooLargeError):
        buffer.receive_data(struct.pack(">I", 2) + b"ok" + struct.pack(">I", 2**32 - 1))


def test_frame_buffer_end_of_stream_inside_a_frame() -> None:
    buffer = wire.FrameBuffer()
    buffer.receive_data(struct.pack(">I", 5) + b"abc")
    assert buffer.next_frame() is None
    buffer.receive_data(b"")
    with pytest.raises(ProtocolError, match="ended inside a frame"):
        buffer.next_frame()
    with pytest.raises(ProtocolError):
        buffer.receive_data(b"de")


def test_frame_buffer_data_after_end_of_stream() -> None:
    buffer = wire.FrameBuffer()
    buffer.receive_data(b"")
    with pytest.raises(ProtocolError, match="after the end"):
        buffer.receive_data(b"x")


def test_frame_buffer_empty_frames() -> None:
    buffer = wire.FrameBuffer()
    buffer.receive_data(bytes(8))
    assert list(buffer.frames()) == [b"", b""]
    with pytest.raises(ValueError):
        wire.FrameBuffer(max_frame_size=-1)


# -- handshake and connection state ----------------------------------------------------------------


def state(connection: wire.ProtocolConnection) -> wire.ConnectionState:
    """The connection's state (a call, so mypy does not narrow it between steps)."""
    return connection.state


def handshake() -> tuple[wire.ProtocolConnection, wire.ProtocolConnection]:
    client = wire.ProtocolConnection(wire.Role.INITIATOR, sender="client:1")
    server = wire.ProtocolConnection(wire.Role.ACCEPTOR, sender="server:1")
    assert state(client) is wire.ConnectionState.IDLE
    assert state(server) is wire.ConnectionState.AWAITING_HELLO
    hello = client.start_handshake()
    assert state(client) is wire.ConnectionState.AWAITING_HELLO_RESPONSE
    assert server.receive_frame(hello) == Hello((1,), "client:1")
    assert state(server) is wire.ConnectionState.SENDING_HELLO_RESPONSE
    assert server.peer == "client:1"
    response = server.send(server.hello_response())
    assert state(server) is wire.ConnectionState.OPEN
    assert client.receive_frame(response) == HelloResponse(1)
    assert state(client) is wire.ConnectionState.OPEN
    assert client.version == server.version == 1
    return client, server


def test_handshake_then_messages_both_ways() -> None:
    client, server = handshake()
    assert server.receive_frame(client.send(append_request())) == append_request()
    feed = FeedData(ReqId(1, 2, 3, 4), 5, 6)
    assert client.receive_frame(server.send(feed)) == feed


def test_messages_before_the_handshake_are_refused() -> None:
    client = wire.ProtocolConnection(wire.Role.INITIATOR)
    with pytest.raises(ProtocolError, match="handshake"):
        client.send(append_request())
    assert state(client) is wire.ConnectionState.IDLE  # a refused send changes nothing
    server = wire.ProtocolConnection(wire.Role.ACCEPTOR)
    with pytest.raises(ProtocolError, match="handshake"):
        server.receive_frame(wire.encode(append_request()))
    assert state(server) is wire.ConnectionState.FAILED
    with pytest.raises(ProtocolError, match="failed"):
        server.receive_frame(wire.encode(Hello((1,), "late")))


def test_initiator_refuses_anything_but_hello_response() -> None:
    client = wire.ProtocolConnection(wire.Role.INITIATOR)
    client.start_handshake()
    with pytest.raises(ProtocolError, match="handshake"):
        client.receive_frame(wire.encode(FeedData(ReqId(1, 2, 3, 4), 5, 6)))
    assert state(client) is wire.ConnectionState.FAILED


def test_acceptor_must_answer_before_sending_anything_else() -> None:
    server = wire.ProtocolConnection(wire.Role.ACCEPTOR)
    server.receive_frame(wire.encode(Hello((1,), "c")))
    with pytest.raises(ProtocolError):
        server.send(FeedData(ReqId(1, 2, 3, 4), 5, 6))
    with pytest.raises(ProtocolError, match="negotiated version 1"):
        server.send(HelloResponse(2))
    server.send(server.hello_response())
    assert state(server) is wire.ConnectionState.OPEN


def test_hello_after_the_handshake_is_refused() -> None:
    client, server = handshake()
    with pytest.raises(ProtocolError, match="after the handshake"):
        client.send(Hello((1,), "again"))
    with pytest.raises(ProtocolError, match="after the handshake"):
        server.receive_frame(wire.encode(Hello((1,), "again")))
    assert state(server) is wire.ConnectionState.FAILED


def test_frame_of_another_version_after_the_handshake() -> None:
    client, _ = handshake()
    frame = bytearray(wire.encode(FeedData(ReqId(1, 2, 3, 4), 5, 6)))
    frame[1] = 2
    with pytest.raises(ProtocolError):
        client.receive_frame(bytes(frame))
    assert state(client) is wire.ConnectionState.FAILED


def test_version_mismatch_on_the_acceptor() -> None:
    server = wire.ProtocolConnection(wire.Role.ACCEPTOR, sender="server:1")
    server.receive_frame(wire.encode(Hello((7, 8), "client:9")))
    assert server.version is None
    response = server.send(server.hello_response())
    assert wire.decode(response) == HelloResponse(0)
    assert state(server) is wire.ConnectionState.FAILED
    assert isinstance(server.error, VersionMismatchError)
    with pytest.raises(VersionMismatchError, match=r"speaks \(1,\).*'client:9'.*\(7, 8\)"):
        server.send(FeedData(ReqId(1, 2, 3, 4), 5, 6))
    with pytest.raises(VersionMismatchError):
        server.receive_frame(wire.encode(FeedData(ReqId(1, 2, 3, 4), 5, 6)))


def test_version_mismatch_on_the_initiator() -> None:
    client = wire.ProtocolConnection(wire.Role.INITIATOR, sender="client:1")
    client.start_handshake()
    with pytest.raises(VersionMismatchError, match=r"no common protocol version.*upgrade"):
        client.receive_frame(wire.encode(HelloResponse(0)))
    assert state(client) is wire.ConnectionState.FAILED
    assert client.version is None


def test_initiator_refuses_a_version_it_did_not_offer() -> None:
    client = wire.ProtocolConnection(wire.Role.INITIATOR)
    client.start_handshake()
    with pytest.raises(ProtocolError, match="did not offer"):
        client.receive_frame(wire.encode(HelloResponse(5)))


def test_acceptor_picks_the_highest_common_version() -> None:
    server = wire.ProtocolConnection(wire.Role.ACCEPTOR)
    server.receive_frame(wire.encode(Hello((0, 1, 2, 3), "newer-client")))
    assert server.hello_response() == HelloResponse(1)


def test_connection_rejects_unsupported_versions() -> None:
    with pytest.raises(ValueError):
        wire.ProtocolConnection(wire.Role.INITIATOR, versions=(2,))
    with pytest.raises(ValueError):
        wire.ProtocolConnection(wire.Role.INITIATOR, versions=())


def test_connection_max_frame_size() -> None:
    client, server = handshake()
    server.max_frame_size = 100
    with pytest.raises(FrameTooLargeError):
        server.send(append_request())
    with pytest.raises(FrameTooLargeError):
        server.receive_frame(client.send(append_request()))
    assert state(server) is wire.ConnectionState.FAILED


if __name__ == "__main__":
    # Regenerate the test vectors (a deliberate change of the protocol's version 1 only).
    VECTORS.parent.mkdir(exist_ok=True)
    lines = ["# Waltz wire protocol v1 test vectors: type code, message, frame (hex)."]
    lines += ["# The messages are tests/test_wire.py sample_messages()."]
    lines += [f"{m.TYPE} {type(m).__name__} {wire.encode(m).hex()}" for m in sample_messages()]
    VECTORS.write_text("\n".join(lines) + "\n")


def test_a_schema_field_of_an_unknown_kind_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown wire field kind 'i33'"):
        wire.schema.Field("header", "i33")


def test_the_generated_decoder_is_the_one_the_codec_docstring_shows() -> None:
    source = wire.codec.layout_source(FeedData)
    for line in (
        "    if n != 30:",
        "    r0_req_id, r1_req_id, r2_req_id, r3_req_id, v_transaction_id, v_header, "
        "= _unpack(f, 2)",
        "    v_req_id = _new(_ReqId)",
        "    _set_header(m, v_header)",
    ):
        assert line in source.splitlines()
        assert line.strip() in (wire.codec.__doc__ or "")


def test_a_storage_nodes_decoder_leaves_the_append_checksums_to_the_engine() -> None:
    """``verify_record_checksums=False`` passes the records of a StorageAppendRequest and
    a RepairRequest through unverified (the engine verifies them); every other checksum,
    and everything else about the frame, is still checked."""
    from waltz_api.messages import RepairRequest

    record = Record(5, ReqId(1, 2, 3, 4), 0, b"data", wire.checksum(b"other"))
    for message in (
        StorageAppendRequest(1, 2, 3, (record,)),
        RepairRequest(1, 2, 3, (record,)),
    ):
        frame = wire.encode(message)
        with pytest.raises(ChecksumError):
            wire.decode(frame)
        assert wire.decode(frame, verify_record_checksums=False) == message
        with pytest.raises(ProtocolError):
            wire.decode(frame[:-1], verify_record_checksums=False)
    listed = wire.encode(RecordListResponse(1, 2, 3, (record,)))
    with pytest.raises(ChecksumError):
        wire.decode(listed, verify_record_checksums=False)
    data = AppendRequest(ReqId(1, 2, 3, 4), -1, LockRequest(), 0, b"x", wire.checksum(b"y"))
    with pytest.raises(ChecksumError):
        wire.decode(wire.encode(data), verify_record_checksums=False)
    acceptor = wire.ProtocolConnection(wire.Role.ACCEPTOR, verify_record_checksums=False)
    acceptor.receive_frame(wire.encode(Hello((1,), "server")))
    acceptor.send(acceptor.hello_response())
    assert acceptor.receive_frame(wire.encode(StorageAppendRequest(1, 2, 3, (record,))))
