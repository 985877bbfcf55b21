"""The Waltz bank demo: accounts in SQLite as a materialized view of the log."""

from waltz_bank.bank import Accounts, Operation, Replay, Report, run_bank

__all__ = ["Accounts", "Operation", "Replay", "Report", "run_bank"]
