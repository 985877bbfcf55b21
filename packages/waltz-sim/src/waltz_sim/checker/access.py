"""The ACL's invariants (``History.refused``: the pairs of client and partition whose
appends an enforced ACL refuses; every other client may write there):

- ``acl-refused-committed``: an op of a refused client committed on that partition
  (reported committed, or found in the committed log);
- ``acl-wrongly-refused``: an op of a client that may write there was refused (its
  failure's detail starts with :data:`REFUSED`, what the workload records for an
  ``AccessDeniedError``).

(A refused client's op may also expire or end unknown, when no server answered it in
time; what matters is that it never commits.)
"""

from __future__ import annotations

from waltz_sim.checker.liveness import OpLife
from waltz_sim.checker.model import FAIL, History, Violation
from waltz_sim.checker.semantics import TxnInfo

REFUSED = "refused"
"""How a failure's detail starts when the server refused the op (ACCESS_DENIED)."""


def check_access(
    history: History,
    ops: dict[str, OpLife],
    txns: dict[int, list[TxnInfo | None]],
    out: list[Violation],
) -> None:
    refused = history.refused
    if refused is None:
        return
    for partition, infos in txns.items():
        for transaction_id, info in enumerate(infos):
            op = ops.get(info.op_id) if info is not None else None
            invoke = op.invoke if op is not None else None
            if invoke is not None and (invoke.client, partition) in refused:
                out.append(
                    Violation(
                        "acl-refused-committed",
                        f"op {invoke.op_id} of {invoke.client}, whose appends the ACL refuses "
                        f"on partition {partition}, is committed at {transaction_id}",
                        partition=partition,
                        transaction_id=transaction_id,
                        op_id=invoke.op_id,
                        client=invoke.client,
                    )
                )
    for op in ops.values():
        invoke, end = op.invoke, op.end
        if invoke is None or end is None:
            continue
        if (invoke.client, invoke.partition) in refused:
            continue
        if end.kind != FAIL or not end.detail.startswith(REFUSED):
            continue
        out.append(
            Violation(
                "acl-wrongly-refused",
                f"op {invoke.op_id} of {invoke.client} on partition {invoke.partition} was "
                f"refused, though the ACL lets it write there: {end.detail}",
                end.time,
                partition=invoke.partition,
                op_id=invoke.op_id,
                client=invoke.client,
            )
        )
