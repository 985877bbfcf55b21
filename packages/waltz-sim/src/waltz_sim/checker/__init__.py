"""The invariant checker, shared by the simulation and by fault tests on real processes.

Pure: it reads a recorded :class:`History` and a :class:`ClusterSnapshot` (see
:mod:`waltz_sim.checker.model` for the data model) and returns the violations of
the invariants of DESIGN.md section 5 (:func:`check`, described in
:mod:`waltz_sim.checker.invariants`). A workload's meaning comes from a
:class:`Semantics` (:mod:`waltz_sim.checker.semantics`). Nothing here imports the
simulation, an event loop, or any Waltz component.
"""

from waltz_sim.checker.invariants import LIVENESS, SAFETY, check
from waltz_sim.checker.model import (
    FAIL,
    INVOKE,
    OK,
    UNKNOWN,
    CheckResult,
    ClientSnapshot,
    ClusterSnapshot,
    FeedEvent,
    History,
    LivenessBounds,
    LockFailure,
    OpEvent,
    PartitionSnapshot,
    SessionSpan,
    StoredRecord,
    Violation,
)
from waltz_sim.checker.semantics import (
    SEMANTICS,
    BankSemantics,
    RegisterSemantics,
    Semantics,
    TxnInfo,
    decode_txn,
    encode_txn,
)

__all__ = [
    "FAIL",
    "INVOKE",
    "LIVENESS",
    "OK",
    "SAFETY",
    "SEMANTICS",
    "UNKNOWN",
    "BankSemantics",
    "CheckResult",
    "ClientSnapshot",
    "ClusterSnapshot",
    "FeedEvent",
    "History",
    "LivenessBounds",
    "LockFailure",
    "OpEvent",
    "PartitionSnapshot",
    "RegisterSemantics",
    "Semantics",
    "SessionSpan",
    "StoredRecord",
    "TxnInfo",
    "Violation",
    "check",
    "decode_txn",
    "encode_txn",
]
