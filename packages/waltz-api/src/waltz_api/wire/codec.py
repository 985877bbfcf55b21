"""The codec: :func:`encode` and :func:`decode`, one message <-> one frame.

Each message type gets its own encoder and decoder, generated once at import from
its schema (:data:`~waltz_api.wire.schema.SCHEMAS`) as plain straight-line Python, as
:mod:`dataclasses` does for ``__init__``: one ``struct`` pack (or unpack) for the
whole fixed part, then the variable tails, with no loop over fields and no
reflection per message. That is what keeps the codec within a few times a bare
``struct`` call (``bench/codec.py`` prints both).

How a field becomes code is written once per field *kind* (:func:`_scalar`,
:func:`_reqid`, :func:`_locks`, ...): each returns a :class:`_FieldCode`, the field's
share of the fixed part's struct format, of the encoder (statements, packed values, a
tail) and of the decoder (unpacked names, statements, the value).
:func:`_generate` puts the shares of a message's fields together. The result for
``FeedData``, as :func:`layout_source` shows it (a long line wrapped, setters elided)::

    def encode(m):
        r_req_id = m.req_id
        return _ENC.pack(14, 1, r_req_id.client_id, r_req_id.generation,
                         r_req_id.partition_id, r_req_id.seq_num, m.transaction_id, m.header)

    def decode(f, n):
        if n != 30:
            if n < 30:
                raise truncated(_what, 30, n)
            raise trailing(_what, 30, n)
        r0_req_id, r1_req_id, r2_req_id, r3_req_id, v_transaction_id, v_header, = _unpack(f, 2)
        v_req_id = _new(_ReqId)
        _set_rid_client_id(v_req_id, r0_req_id)
        ...
        m = _new(_cls)
        _set_req_id(m, v_req_id)
        _set_transaction_id(m, v_transaction_id)
        _set_header(m, v_header)
        return m

The decoder raises only ``struct.error``, ``IndexError`` and ``ValueError`` for bad
bytes besides :class:`ProtocolError`; :func:`decode` turns those into
:class:`ProtocolError`.
"""

from __future__ import annotations

import enum
import struct
import textwrap
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Final, Protocol

from waltz_api.errors import ArgumentTypeError, FrameTooLargeError, ProtocolError
from waltz_api.messages import (
    ALL_MESSAGES,
    FeedData,
    Message,
    RangeReadResponse,
    RecordListResponse,
    RepairRequest,
    StorageAppendRequest,
)
from waltz_api.types import LockRequest, ReqId
from waltz_api.wire.blocks import (
    decode_block,
    decode_headers,
    decode_optional_header,
    decode_optional_record,
    decode_records,
    decode_unverified_records,
    encode_headers,
    encode_optional_header,
    encode_optional_record,
    encode_records,
)
from waltz_api.wire.construct import (
    LOCK_FIELDS,
    REQ_ID_FIELDS,
    check_plain_dataclass,
    make_session_info,
)
from waltz_api.wire.schema import (
    CHECKSUMMED,
    DECODE_ERRORS,
    DEFAULT_MAX_FRAME_SIZE,
    ENCODE_ERRORS,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    SCHEMAS,
    SESSION_INFO_FIELDS,
    SUPPORTED_VERSIONS,
    Field,
    bad_checksum,
    crc32c,
    frame_too_large,
    trailing,
    truncated,
)

# -- lock hashes ------------------------------------------------------------------------------

_U64_ARRAYS: Final = [struct.Struct(f">{n}Q") for n in range(65)]


def _pack_u64s(values: tuple[int, ...]) -> bytes:
    n = len(values)
    if n <= 64:
        return _U64_ARRAYS[n].pack(*values)
    return struct.pack(f">{n}Q", *values)


def _unpack_u64s(count: int, frame: bytes, offset: int) -> tuple[int, ...]:
    if count <= 64:
        return _U64_ARRAYS[count].unpack_from(frame, offset)
    return struct.unpack_from(f">{count}Q", frame, offset)


def _enum_table(enum_type: type[enum.IntEnum]) -> tuple[enum.IntEnum, ...]:
    members = sorted(enum_type, key=int)
    if [int(m) for m in members] != list(range(len(members))):
        raise TypeError(f"{enum_type.__name__} values must be dense from 0 to fit the wire codec")
    return tuple(members)


# -- what each field kind contributes -----------------------------------------------------------
#
# In the generated code ``m`` is the message being encoded; ``f`` the frame being
# decoded, ``n`` its length and ``o`` the offset of the next tail. A field ``x`` names
# its locals after itself (``v_x`` its decoded value, ``n_x`` a length, ...).

_GLOBALS: Final[dict[str, Any]] = {
    # every generated function may use these (each message's own are added to a copy)
    "_new": object.__new__,
    "_ReqId": ReqId,
    "_LockRequest": LockRequest,
    **{f"_set_rid_{a}": ReqId.__dict__[a].__set__ for a in REQ_ID_FIELDS},
    **{f"_set_locks_{a}": LockRequest.__dict__[a].__set__ for a in LOCK_FIELDS},
    "_EMPTY_LOCKS": LockRequest(),
    "_make_session_info": make_session_info,
    "_pack_u64s": _pack_u64s,
    "_unpack_u64s": _unpack_u64s,
    "_encode_records": encode_records,
    "_encode_headers": encode_headers,
    "_encode_optional_record": encode_optional_record,
    "_encode_optional_header": encode_optional_header,
    "_decode_records": decode_records,
    "_decode_block": decode_block,
    "_decode_unverified_records": decode_unverified_records,
    "_decode_headers": decode_headers,
    "_decode_optional_record": decode_optional_record,
    "_decode_optional_header": decode_optional_header,
    "truncated": truncated,
    "trailing": trailing,
    "bad_checksum": bad_checksum,
    "_crc32c": crc32c,
    "_UUID": uuid.UUID,
    "_BOOLS": (False, True),
    "ProtocolError": ProtocolError,
}


@dataclass
class _FieldCode:
    """One field's share of its message's generated encoder and decoder."""

    encode_format: str
    """Its struct codes in the fixed part, as the encoder packs them."""
    packed: list[str]
    """The expressions the encoder packs for those codes."""
    unpacked: list[str]
    """The names the decoder binds to those codes."""
    value: str
    """The decoded value (an expression over the names the decoder bound)."""
    decode_format: str = ""
    """As the decoder unpacks them, when it differs (a bool: packed '?', unpacked 'B')."""
    encode_steps: list[str] = field(default_factory=list)
    """Encoder statements before the pack."""
    tail: str | None = None
    """The encoder's expression of the field's variable tail, if it has one."""
    decode_steps: list[str] = field(default_factory=list)
    """Decoder statements after the fixed part is unpacked, in field order (they read
    the field's tail at ``o`` and move ``o`` past it)."""
    names: dict[str, Any] = field(default_factory=dict)
    """Objects the code refers to, beyond ``_GLOBALS``."""


def _lines(code: str) -> list[str]:
    return textwrap.dedent(code).strip("\n").splitlines()


_SCALARS: Final = {"i32": "i", "i64": "q", "u8": "B", "u32": "I"}


def _scalar(x: str, spec: Field, records_as: str) -> _FieldCode:
    """``i32``, ``i64``, ``u8``, ``u32``: one struct code."""
    return _FieldCode(_SCALARS[spec.kind], [f"m.{x}"], [f"v_{x}"], f"v_{x}")


def _bool(x: str, spec: Field, records_as: str) -> _FieldCode:
    """One byte, 0 or 1: packed from the truth value; any other byte fails the lookup."""
    return _FieldCode(
        "?",
        [f"m.{x}"],
        [f"b_{x}"],
        f"v_{x}",
        decode_format="B",
        decode_steps=[f"v_{x} = _BOOLS[b_{x}]"],
    )


def _enum(x: str, spec: Field, records_as: str) -> _FieldCode:
    """One byte holding the member's value (a value outside the enum fails the lookup)."""
    assert spec.enum_type is not None
    table = _enum_table(spec.enum_type)
    return _FieldCode(
        "B",
        [f"_EV_{x}[m.{x}]"],
        [f"e_{x}"],
        f"v_{x}",
        decode_steps=[f"v_{x} = _E_{x}[e_{x}]"],
        names={f"_E_{x}": table, f"_EV_{x}": {member: int(member) for member in table}},
    )


def _reqid(x: str, spec: Field, records_as: str) -> _FieldCode:
    """Four ``i32``; the ReqId is built inline (no call): every client message has one."""
    parts = [f"r{i}_{x}" for i in range(len(REQ_ID_FIELDS))]
    return _FieldCode(
        "iiii",
        [f"r_{x}.{a}" for a in REQ_ID_FIELDS],
        parts,
        f"v_{x}",
        encode_steps=[f"r_{x} = m.{x}"],
        decode_steps=[
            f"v_{x} = _new(_ReqId)",
            *(f"_set_rid_{a}(v_{x}, {p})" for a, p in zip(REQ_ID_FIELDS, parts, strict=True)),
        ],
    )


def _session_info(x: str, spec: Field, records_as: str) -> _FieldCode:
    """One ``i64`` per SessionInfo field."""
    parts = [f"s{i}_{x}" for i in range(len(SESSION_INFO_FIELDS))]
    return _FieldCode(
        "q" * len(SESSION_INFO_FIELDS),
        [f"s_{x}.{a}" for a in SESSION_INFO_FIELDS],
        parts,
        f"_make_session_info({', '.join(parts)})",
        encode_steps=[f"s_{x} = m.{x}"],
    )


def _uuid(x: str, spec: Field, records_as: str) -> _FieldCode:
    """16 bytes."""
    return _FieldCode("16s", [f"m.{x}.bytes"], [f"u_{x}"], f"_UUID(bytes=u_{x})")


_AS_BYTES: Final = {"bytes": "m.{x}", "str": "m.{x}.encode()", "versions": "bytes(m.{x})"}
_FROM_BYTES: Final = {"bytes": "f[o:e]", "str": "f[o:e].decode()", "versions": "tuple(f[o:e])"}


def _bytes_like(x: str, spec: Field, records_as: str) -> _FieldCode:
    """``bytes``, ``str`` (UTF-8), ``versions`` (a byte each): ``u32`` length, then the bytes."""
    return _FieldCode(
        "I",
        [f"len(t_{x})"],
        [f"n_{x}"],
        f"v_{x}",
        encode_steps=[f"t_{x} = " + _AS_BYTES[spec.kind].format(x=x)],
        tail=f"t_{x}",
        decode_steps=_lines(f"""
            e = o + n_{x}
            if e > n:
                raise truncated(_what + '.{x}', e, n)
            v_{x} = {_FROM_BYTES[spec.kind]}
            o = e
        """),
    )


def _locks(x: str, spec: Field, records_as: str) -> _FieldCode:
    """A LockRequest: three ``u32`` counts, then the read, write and append hashes."""
    return _FieldCode(
        "III",
        [f"len(lr_{x})", f"len(lw_{x})", f"len(la_{x})"],
        [f"nr_{x}", f"nw_{x}", f"na_{x}"],
        f"v_{x}",
        encode_steps=[
            f"l_{x} = m.{x}",
            f"lr_{x} = l_{x}.read",
            f"lw_{x} = l_{x}.write",
            f"la_{x} = l_{x}.append",
        ],
        tail=f"_pack_u64s(lr_{x} + lw_{x} + la_{x})",
        decode_steps=_lines(f"""
            k = nr_{x} + nw_{x} + na_{x}
            if k:
                e = o + 8 * k
                if e > n:
                    raise truncated(_what + ' lock hashes', e, n)
                h = _unpack_u64s(k, f, o)
                o = e
                w = nr_{x} + nw_{x}
                v_{x} = _new(_LockRequest)
                _set_locks_read(v_{x}, h[:nr_{x}])
                _set_locks_write(v_{x}, h[nr_{x}:w])
                _set_locks_append(v_{x}, h[w:])
            else:
                v_{x} = _EMPTY_LOCKS
        """),
    )


def _records_like(x: str, spec: Field, records_as: str) -> _FieldCode:
    """``record*``/``header*`` (a ``u32`` count) and ``record?``/``header?`` (a presence
    bool), then the records or headers (:mod:`waltz_api.wire.blocks`). ``records_as``
    says how a ``record*`` is decoded: ``"records"`` (every checksum verified),
    ``"block"`` (a RecordBlock, its checksums left to its reader) or ``"unverified"``
    (records whose checksums the receiver's storage engine verifies)."""
    counted = spec.kind in ("records", "headers")
    encoder = {
        "records": "_encode_records",
        "headers": "_encode_headers",
        "opt_record": "_encode_optional_record",
        "opt_header": "_encode_optional_header",
    }[spec.kind]
    decoder = {
        "records": _RECORDS_DECODERS[records_as],
        "headers": "_decode_headers",
        "opt_record": "_decode_optional_record",
        "opt_header": "_decode_optional_header",
    }[spec.kind]
    return _FieldCode(
        "I" if counted else "?",
        [f"len(c_{x})" if counted else f"c_{x} is not None"],
        [f"n_{x}"],
        f"v_{x}",
        decode_format="I" if counted else "B",
        encode_steps=[f"c_{x} = m.{x}"],
        tail=f"{encoder}(c_{x})",
        decode_steps=[f"v_{x}, o = {decoder}(f, o, n_{x}, n, _what)"],
    )


_RECORDS_DECODERS: Final = {
    "records": "_decode_records",
    "block": "_decode_block",
    "unverified": "_decode_unverified_records",
}

_KINDS: Final[dict[str, Callable[[str, Field, str], _FieldCode]]] = {
    "i32": _scalar,
    "i64": _scalar,
    "u8": _scalar,
    "u32": _scalar,
    "bool": _bool,
    "enum": _enum,
    "reqid": _reqid,
    "session_info": _session_info,
    "uuid": _uuid,
    "bytes": _bytes_like,
    "str": _bytes_like,
    "versions": _bytes_like,
    "locks": _locks,
    "records": _records_like,
    "headers": _records_like,
    "opt_record": _records_like,
    "opt_header": _records_like,
}

# -- a message's encoder and decoder --------------------------------------------------------------


@dataclass
class _Generated:
    encoder: Callable[[Any], bytes]
    decoder: Callable[[bytes, int], Message]
    fixed_size: int
    source: str


def _indent(lines: Iterable[str]) -> str:
    return "".join(f"    {line}\n" for line in lines)


def _generate(
    cls: type[Message], schema: tuple[Field, ...], records_as: str = "records"
) -> _Generated:
    """The encoder and decoder of ``cls``; ``records_as``: how its ``record*`` fields
    are decoded (see :func:`_records_like`)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    if [f.name for f in schema] != names:
        raise TypeError(
            f"the wire schema of {cls.__name__} lists {[f.name for f in schema]} but the "
            f"message has fields {names}; update waltz_api.wire.schema.SCHEMAS"
        )
    check_plain_dataclass(cls)
    codes = [_KINDS[spec.kind](spec.name, spec, records_as) for spec in schema]
    what = cls.__name__
    namespace = {**_GLOBALS, "_cls": cls, "_what": what}
    for code in codes:
        namespace.update(code.names)

    # The fixed part: ``u8 type, u8 version`` and every field's share, one struct each way
    # (the decoder's starts after the type and version).
    encoder_struct = struct.Struct(">BB" + "".join(c.encode_format for c in codes))
    decoder_struct = struct.Struct(">" + "".join(c.decode_format or c.encode_format for c in codes))
    fixed_size = encoder_struct.size
    if decoder_struct.size != fixed_size - HEADER_SIZE:  # pragma: no cover - generator bug
        raise AssertionError(f"{what}: encoder and decoder layouts differ")
    namespace["_ENC"] = encoder_struct
    namespace["_unpack"] = decoder_struct.unpack_from

    # encode(m): the fixed part packed in one call, then the tails, joined once
    packed = [str(cls.TYPE), str(PROTOCOL_VERSION), *(p for c in codes for p in c.packed)]
    tails = [c.tail for c in codes if c.tail is not None]
    frame = f"_ENC.pack({', '.join(packed)})"
    if len(tails) == 1:
        frame = f"{frame} + {tails[0]}"
    elif tails:
        frame = f"b''.join(({frame}, {', '.join(tails)}))"
    encoder_source = (
        "def encode(m):\n"
        + _indent(step for c in codes for step in c.encode_steps)
        + f"    return {frame}\n"
    )

    # decode(f, n): the fixed part unpacked in one call, each tail read in field order,
    # the frame used exactly, the data's checksum verified, the message built inline
    if tails:
        length_check = f"""
            if n < {fixed_size}:
                raise truncated(_what, {fixed_size}, n)
        """
    else:
        length_check = f"""
            if n != {fixed_size}:
                if n < {fixed_size}:
                    raise truncated(_what, {fixed_size}, n)
                raise trailing(_what, {fixed_size}, n)
        """
    steps = _lines(length_check)
    steps.append(f"{', '.join(u for c in codes for u in c.unpacked)}, = _unpack(f, {HEADER_SIZE})")
    if tails:
        steps.append(f"o = {fixed_size}")
    steps += [step for c in codes for step in c.decode_steps]
    if tails:
        steps += ["if o != n:", "    raise trailing(_what, o, n)"]
    if cls in CHECKSUMMED:
        steps += [
            "if _crc32c(v_data) != v_checksum:",
            "    raise bad_checksum(_what, '', v_checksum, _crc32c(v_data))",
        ]
    # built without __init__ (see waltz_api.wire.construct)
    steps.append("m = _new(_cls)")
    for name, code in zip(names, codes, strict=True):
        namespace[f"_set_{name}"] = cls.__dict__[name].__set__
        steps.append(f"_set_{name}(m, {code.value})")
    steps.append("return m")
    decoder_source = "def decode(f, n):\n" + _indent(steps)

    source = encoder_source + "\n" + decoder_source
    exec(compile(source, f"<waltz_api.wire {what}>", "exec"), namespace)
    return _Generated(namespace["encode"], namespace["decode"], fixed_size, source)


_GENERATED: Final[dict[type[Message], _Generated]] = {
    cls: _generate(cls, schema) for cls, schema in SCHEMAS.items()
}

_missing = set(ALL_MESSAGES) - set(_GENERATED)
if _missing:  # pragma: no cover - a message added without its wire schema
    raise TypeError(f"no wire schema for {sorted(c.__name__ for c in _missing)}")

_BLOCK_MESSAGES: Final = (RangeReadResponse, RecordListResponse)
"""The messages that :func:`decode` with ``record_blocks=True`` returns with a RecordBlock."""

_ENCODERS: Final[dict[type, Callable[[Any], bytes]]] = {
    cls: g.encoder for cls, g in _GENERATED.items()
}
_DECODERS: Final[list[Callable[[bytes, int], Message] | None]] = [None] * 256
NAMES: Final[list[str]] = [""] * 256
"""The message name of each type code ("" for an unknown code)."""
for _cls, _gen in _GENERATED.items():
    if _DECODERS[_cls.TYPE] is not None:  # pragma: no cover - a duplicated type code
        raise TypeError(f"wire type code {_cls.TYPE} is used twice ({_cls.__name__})")
    _DECODERS[_cls.TYPE] = _gen.decoder
    NAMES[_cls.TYPE] = _cls.__name__
_UNVERIFIED_MESSAGES: Final = (StorageAppendRequest, RepairRequest)
"""The messages that :func:`decode` with ``verify_record_checksums=False`` returns with
records whose checksums are not verified (a storage engine verifies them as it stores them)."""

_Decoders = list[Callable[[bytes, int], Message] | None]


def _with(table: _Decoders, messages: tuple[type[Message], ...], records_as: str) -> _Decoders:
    replaced = list(table)
    for cls in messages:
        replaced[cls.TYPE] = _generate(cls, SCHEMAS[cls], records_as).decoder
    return replaced


_BLOCK_DECODERS: Final = _with(_DECODERS, _BLOCK_MESSAGES, "block")
_UNVERIFIED_DECODERS: Final = _with(_DECODERS, _UNVERIFIED_MESSAGES, "unverified")
_UNVERIFIED_BLOCK_DECODERS: Final = _with(_BLOCK_DECODERS, _UNVERIFIED_MESSAGES, "unverified")


def layout_source(cls: type[Message], *, records_as: str = "records") -> str:
    """The generated encoder and decoder of ``cls`` (to read, or to debug the codec);
    ``records_as``: ``"block"`` or ``"unverified"`` for the variants :func:`decode` uses
    with ``record_blocks`` or without ``verify_record_checksums``."""
    if records_as != "records":
        return _generate(cls, SCHEMAS[cls], records_as).source
    return _GENERATED[cls].source


# -- the public codec -----------------------------------------------------------------------------


def encode(message: Message, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """The frame of one message (protocol version :data:`PROTOCOL_VERSION`).

    Raises :class:`ProtocolError` when a field does not fit its wire type (e.g. a
    header outside ``i32``, a negative checksum) and :class:`FrameTooLargeError`
    when the frame would exceed ``max_frame_size``.
    """
    try:
        encoder = _ENCODERS[type(message)]
    except KeyError:
        raise ArgumentTypeError(
            f"cannot encode {type(message).__name__}: not a waltz_api.messages message"
        ) from None
    try:
        frame = encoder(message)
    except ENCODE_ERRORS as exc:
        raise ProtocolError(
            f"cannot encode {message!r:.200}: {exc}; a field has a value its wire type "
            "cannot hold (see the layout in waltz_api.wire)"
        ) from exc
    if len(frame) > max_frame_size:
        raise FrameTooLargeError(
            f"a {type(message).__name__} frame of {len(frame)} bytes exceeds the maximum "
            f"frame size of {max_frame_size} bytes; send less data per message or raise "
            "the maximum frame size on both peers"
        )
    return frame


def decode(
    frame: bytes | bytearray | memoryview,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    record_blocks: bool = False,
    verify_record_checksums: bool = True,
) -> Message:
    """The message in one frame.

    Raises :class:`ProtocolError` (or its subclasses :class:`ChecksumError`,
    :class:`FrameTooLargeError`) for anything but a well-formed frame of a supported
    version; never another exception for a byte string.

    ``record_blocks``: the records of a RangeReadResponse or RecordListResponse come as
    a :class:`RecordBlock` (no Record is built): the frame's structure is checked here,
    the records' checksums when the block is read (:meth:`RecordBlock.check`, or
    decoding its records, raise :class:`ChecksumError`).

    ``verify_record_checksums=False``: the records of a StorageAppendRequest or
    RepairRequest are not verified here. For a storage node only, whose storage engine
    verifies each record as it stores it (``StorageEngine.append`` and ``repair`` refuse
    a mismatch with ChecksumError), so CRC-32C is computed once on that hop.
    """
    if type(frame) is not bytes:
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"decode() takes a byte string, not {type(frame).__name__}")
        size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
        if size > max_frame_size:  # refused before copying it
            raise frame_too_large(size, max_frame_size)
        frame = bytes(frame)
    n = len(frame)
    if n > max_frame_size:
        raise frame_too_large(n, max_frame_size)
    if n < HEADER_SIZE:
        raise ProtocolError(
            f"a frame of {n} bytes is shorter than the 2-byte type and version header; "
            "the peer sent a malformed frame, close the connection"
        )
    type_code = frame[0]
    if verify_record_checksums:
        table = _BLOCK_DECODERS if record_blocks else _DECODERS
    else:
        table = _UNVERIFIED_BLOCK_DECODERS if record_blocks else _UNVERIFIED_DECODERS
    decoder = table[type_code]
    if decoder is None:
        raise ProtocolError(
            f"unknown message type {type_code}; the peer speaks another protocol or sent a "
            "corrupted frame, close the connection"
        )
    version = frame[1]
    if version != PROTOCOL_VERSION and version not in SUPPORTED_VERSIONS and type_code > 2:
        raise ProtocolError(
            f"{NAMES[type_code]} frame of protocol version {version}; this codec speaks "
            f"{SUPPORTED_VERSIONS} (negotiate a version with Hello first)"
        )
    try:
        return decoder(frame, n)
    except DECODE_ERRORS as exc:
        raise ProtocolError(
            f"malformed {NAMES[type_code]} frame of {n} bytes: {exc}; "
            "the peer sent a malformed frame, close the connection"
        ) from None


# -- batch helpers ------------------------------------------------------------------------------

_FEED_DATA: Final = struct.Struct(">BBiiiiqi")


class FeedItem(Protocol):
    """What a FeedData frame is made of: a FeedData, or the committed Record or
    RecordHeader it announces."""

    @property
    def req_id(self) -> ReqId: ...

    @property
    def transaction_id(self) -> int: ...

    @property
    def header(self) -> int: ...


def encode_feed_data(feed: Iterable[FeedItem]) -> list[bytes]:
    """The FeedData frames of many committed transactions at once, each exactly as
    :func:`encode` builds ``FeedData(item.req_id, item.transaction_id, item.header)``
    (one bound pack each, no message object, no per-message dispatch). The frame of a
    transaction is the same for every connection (one protocol version): the server
    encodes each committed transaction once and sends that frame to every feed."""
    pack = _FEED_DATA.pack
    t = FeedData.TYPE
    v = PROTOCOL_VERSION
    try:
        return [
            pack(
                t,
                v,
                m.req_id.client_id,
                m.req_id.generation,
                m.req_id.partition_id,
                m.req_id.seq_num,
                m.transaction_id,
                m.header,
            )
            for m in feed
        ]
    except ENCODE_ERRORS as exc:
        raise ProtocolError(f"cannot encode FeedData: {exc}") from exc
