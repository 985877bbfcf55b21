"""The ``waltz`` command line: one entry point, each command contributed by a plugin.

The commands come from the installed packages through the ``waltz_cli_commands``
hook (see :mod:`waltz_cli.group`); this package holds the root (:mod:`waltz_cli.app`),
the options every command shares (:mod:`waltz_cli.output`, :mod:`waltz_cli.coordination`,
:mod:`waltz_cli.deadline`: ``--timeout`` and exit code 4) and ``waltz plugins list``.

The names below are imported on first use: the package's entry point
(:mod:`waltz_cli.plugin`) is read by every process that reads the plugins, which must
not cost click.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_cli.app import main
    from waltz_cli.group import PluginCommands, WaltzGroup, load_all

__all__ = ["PluginCommands", "WaltzGroup", "load_all", "main"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"main": ".app", "PluginCommands": ".group", "WaltzGroup": ".group", "load_all": ".group"},
)
