"""The Waltz bank demo: accounts in SQLite as a materialized view of the log.

The names below are imported on first use: the package's entry point
(:mod:`waltz_bank.plugin`, ``waltz spark``) imports this package in every ``waltz``
run, which must not cost the bank and the client."""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_bank.bank import Accounts, Operation, Replay, Report, run_bank

__all__ = ["Accounts", "Operation", "Replay", "Report", "run_bank"]
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, ".bank"))
