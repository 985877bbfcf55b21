"""What a workload's transactions mean: decoding, replay, and the workload's invariants.

Every transaction a workload writes carries a small JSON envelope
(:func:`encode_txn`): the op id of the submission, the client high-water mark it
was built on, its locks, its kind and its body. So the checker needs nothing but
the committed log to know, for each transaction, which submission it is, what it
locked and what it observed.

A :class:`Semantics` replays a partition's committed transactions into a state
(:meth:`Semantics.apply`), reporting what a transaction could not legally do on
the state it met (a withdrawal below zero, a write built on a value that had
changed...). Clients keep their databases with the same :meth:`apply`, so a
client's database must equal the replay of the log up to its high-water mark.

Two workloads come with it: ``bank`` (accounts; deposits take APPEND locks,
withdrawals and transfers WRITE locks, audits READ locks on every account) and
``register`` (registers written with WRITE locks and read with READ locks,
counters incremented with APPEND locks).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

READ = "r"
WRITE = "w"
APPEND = "a"

Lock = tuple[str, int, str]
"""(name, id, mode): mode READ, WRITE or APPEND."""


@dataclass(frozen=True)
class TxnInfo:
    op_id: str
    client_high_water_mark: int
    locks: tuple[Lock, ...]
    kind: str
    body: Mapping[str, Any]


def encode_txn(
    op_id: str,
    client_high_water_mark: int,
    locks: Iterable[Lock],
    kind: str,
    body: Mapping[str, Any],
) -> bytes:
    envelope = {
        "op": op_id,
        "hwm": client_high_water_mark,
        "locks": [list(lock) for lock in locks],
        "kind": kind,
        "body": dict(body),
    }
    return json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode("utf-8")


def decode_txn(data: bytes) -> TxnInfo | None:
    """The envelope of a transaction's data (None when it is not one)."""
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
        locks = tuple((str(n), int(i), str(m)) for n, i, m in raw["locks"])
        return TxnInfo(str(raw["op"]), int(raw["hwm"]), locks, str(raw["kind"]), raw["body"])
    except (ValueError, KeyError, TypeError):
        return None


class Semantics(ABC):
    """A workload's meaning (pure: no I/O)."""

    name: str = ""

    def decode(self, data: bytes) -> TxnInfo | None:
        return decode_txn(data)

    @abstractmethod
    def initial_state(self, partition: int) -> dict[str, Any]:
        """A partition's state before its first transaction."""

    @abstractmethod
    def apply(self, state: dict[str, Any], txn: TxnInfo) -> list[str]:
        """Apply ``txn`` to ``state`` (in place); returns what it did wrong (empty: nothing)."""

    def state_at(
        self, partition: int, txns: Sequence[TxnInfo | None], marks: Iterable[int]
    ) -> dict[int, dict[str, Any]]:
        """The state after each transaction id in ``marks`` (-1: the initial state)."""
        wanted = sorted(set(marks))
        states: dict[int, dict[str, Any]] = {}
        state = self.initial_state(partition)
        position = -1
        for mark in wanted:
            while position < mark and position + 1 < len(txns):
                position += 1
                txn = txns[position]
                if txn is not None:
                    self.apply(state, txn)
            if position == mark:
                states[mark] = json.loads(json.dumps(state))
        return states


class BankSemantics(Semantics):
    """Accounts ``acct`` ids ``0..accounts-1`` per partition, balances start at 0."""

    name = "bank"

    def __init__(self, accounts: int = 6) -> None:
        self.accounts = accounts

    def initial_state(self, partition: int) -> dict[str, Any]:
        return {"balances": {str(a): 0 for a in range(self.accounts)}}

    def apply(self, state: dict[str, Any], txn: TxnInfo) -> list[str]:
        balances: dict[str, int] = state["balances"]
        body = txn.body
        problems: list[str] = []
        if txn.kind == "deposit":
            balances[str(body["acct"])] += int(body["amount"])
        elif txn.kind == "withdraw":
            acct = str(body["acct"])
            if int(body["seen"]) != balances[acct]:
                problems.append(
                    f"withdrawal from account {acct} was built on balance {body['seen']}, "
                    f"but the balance was {balances[acct]} when it committed"
                )
            balances[acct] -= int(body["amount"])
            if balances[acct] < 0:
                problems.append(f"account {acct} went negative ({balances[acct]})")
        elif txn.kind == "transfer":
            source, target = str(body["from"]), str(body["to"])
            seen = [int(x) for x in body["seen"]]
            if seen != [balances[source], balances[target]]:
                problems.append(
                    f"transfer {source}->{target} was built on balances {seen}, but they were "
                    f"{[balances[source], balances[target]]} when it committed"
                )
            balances[source] -= int(body["amount"])
            balances[target] += int(body["amount"])
            if balances[source] < 0:
                problems.append(f"account {source} went negative ({balances[source]})")
        elif txn.kind == "audit":
            observed = {str(k): int(v) for k, v in body["seen"].items()}
            if observed != balances:
                problems.append(f"audit saw balances {observed}, but they were {balances}")
        else:
            problems.append(f"unknown bank transaction kind {txn.kind!r}")
        return problems


class RegisterSemantics(Semantics):
    """Registers ``reg`` (WRITE to set, READ to read) and counters ``ctr`` (APPEND)."""

    name = "register"

    def __init__(self, registers: int = 4, counters: int = 2) -> None:
        self.registers = registers
        self.counters = counters

    def initial_state(self, partition: int) -> dict[str, Any]:
        return {
            "registers": {str(r): 0 for r in range(self.registers)},
            "counters": {str(c): 0 for c in range(self.counters)},
        }

    def apply(self, state: dict[str, Any], txn: TxnInfo) -> list[str]:
        registers: dict[str, int] = state["registers"]
        counters: dict[str, int] = state["counters"]
        body = txn.body
        problems: list[str] = []
        if txn.kind == "incr":
            counters[str(body["ctr"])] += int(body["by"])
        elif txn.kind in ("write", "read"):
            reg = str(body["reg"])
            if int(body["seen"]) != registers[reg]:
                problems.append(
                    f"{txn.kind} of register {reg} saw {body['seen']}, but it held "
                    f"{registers[reg]} when the transaction committed"
                )
            if txn.kind == "write":
                registers[reg] = int(body["value"])
        else:
            problems.append(f"unknown register transaction kind {txn.kind!r}")
        return problems


SEMANTICS: dict[str, type[Semantics]] = {"bank": BankSemantics, "register": RegisterSemantics}


__all__ = [
    "APPEND",
    "READ",
    "SEMANTICS",
    "WRITE",
    "BankSemantics",
    "Lock",
    "RegisterSemantics",
    "Semantics",
    "TxnInfo",
    "decode_txn",
    "encode_txn",
]
