"""waltz_api: the contracts, types, plugin hooks, wire codec, errors and config of Waltz."""

from waltz_api.errors import WaltzError
from waltz_api.types import (
    NO_TRANSACTION,
    Lock,
    LockMode,
    LockRequest,
    Record,
    RecordHeader,
    ReqId,
    SessionInfo,
    Transaction,
    lock_hash,
)

__all__ = [
    "NO_TRANSACTION",
    "Lock",
    "LockMode",
    "LockRequest",
    "Record",
    "RecordHeader",
    "ReqId",
    "SessionInfo",
    "Transaction",
    "WaltzError",
    "lock_hash",
]
__version__ = "0.2.0.dev0"
