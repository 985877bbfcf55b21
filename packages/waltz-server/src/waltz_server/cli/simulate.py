"""``waltz simulate``: the deterministic simulation (needs the waltz-sim package).

The command lives in ``waltz_sim.cli``; :class:`LazyCommand` stands for it in the
``waltz`` tree and imports it only when it is used (its options, its help, a run),
so ``waltz`` starts without it and works without the package installed.
"""

from __future__ import annotations

import importlib
from typing import Any

import click


class LazyCommand(click.Command):
    """A command whose implementation (a click command at ``module:attribute``) is
    imported on first use; ``short_help`` is what ``waltz --help`` shows meanwhile."""

    def __init__(self, name: str, target: str, short_help: str, missing: str) -> None:
        super().__init__(name, short_help=short_help, add_help_option=False)
        self._target_path = target
        self._missing = missing
        self._loaded: click.Command | None = None

    def target(self) -> click.Command:
        if self._loaded is None:
            module, _, attribute = self._target_path.partition(":")
            try:
                loaded = getattr(importlib.import_module(module), attribute)
            except ImportError as exc:
                raise click.ClickException(f"{exc}: {self._missing}") from exc
            if not isinstance(loaded, click.Command):
                raise click.ClickException(f"{self._target_path} is not a click command")
            self._loaded = loaded
        return self._loaded

    @property
    def params(self) -> list[click.Parameter]:
        # (read by click.Command.__init__ before the target is known: none yet)
        return [] if getattr(self, "_target_path", None) is None else self.target().params

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        """Set by click.Command.__init__ (empty): the target's are used."""

    @property
    def help(self) -> str | None:
        return self.target().help

    @help.setter
    def help(self, value: str | None) -> None:
        """Set by click.Command.__init__: the target's help is used."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return self.target().get_params(ctx)

    def invoke(self, ctx: click.Context) -> Any:
        callback = self.target().callback
        assert callback is not None
        return ctx.invoke(callback, **ctx.params)


simulate_command = LazyCommand(
    "simulate",
    "waltz_sim.cli:simulate",
    short_help="Deterministic simulation of the whole cluster (seeded faults, virtual time).",
    missing="install the simulation first (pip install -e packages/waltz-sim)",
)
