"""Construction of decoded values without ``__init__``.

Decoded messages are instances of the public frozen slots dataclasses. Their generated
``__init__`` sets each field through ``object.__setattr__`` (frozen), which costs about
twice as much as calling each slot's member descriptor directly; the decoder does the
latter: ``object.__new__`` plus one ``slot.__set__`` per field (bench/codec.py measures
the alternatives; ReqId 400 -> 205 ns, AppendRequest 545 -> 297 ns on the dev machine).
The result is indistinguishable from an instance built by ``__init__`` (same class,
equality, hash, immutability);
none of these classes has a ``__post_init__``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, Final

from waltz_api.types import LockRequest, Record, RecordHeader, ReqId, SessionInfo


def check_plain_dataclass(cls: type) -> None:
    if hasattr(cls, "__post_init__") or "__slots__" not in cls.__dict__:
        raise TypeError(
            f"waltz_api.wire builds {cls.__name__} without __init__; it must be a slots "
            "dataclass without __post_init__ (update the wire codec's constructors)"
        )


def make_constructor(cls: type) -> Callable[..., Any]:
    """A function building ``cls`` from its field values (positional, in field order)."""
    check_plain_dataclass(cls)
    names = [f.name for f in fields(cls)]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    body = ["    o = _new(_cls)"]
    for name in names:
        namespace[f"_set_{name}"] = cls.__dict__[name].__set__
        body.append(f"    _set_{name}(o, {name})")
    source = f"def make({', '.join(names)}):\n" + "\n".join(body) + "\n    return o\n"
    exec(compile(source, f"<waltz_api.wire make {cls.__name__}>", "exec"), namespace)
    constructor: Callable[..., Any] = namespace["make"]
    return constructor


make_req_id: Final = make_constructor(ReqId)
REQ_ID_FIELDS: Final = tuple(f.name for f in fields(ReqId))
LOCK_FIELDS: Final = tuple(f.name for f in fields(LockRequest))
check_plain_dataclass(LockRequest)
check_plain_dataclass(Record)
REQ_ID_SETTERS: Final = tuple(
    ReqId.__dict__[name].__set__ for name in ("client_id", "generation", "partition_id", "seq_num")
)
RECORD_SETTERS: Final = tuple(
    Record.__dict__[name].__set__
    for name in ("transaction_id", "req_id", "header", "data", "checksum")
)
make_record_header: Final = make_constructor(RecordHeader)
make_session_info: Final = make_constructor(SessionInfo)
