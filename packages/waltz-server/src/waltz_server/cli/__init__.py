"""The server's commands of the ``waltz`` command line: ``cluster``, ``server``,
``acl`` and ``archive``, contributed through the ``waltz_cli_commands`` hook
(:mod:`waltz_server.plugin`); ``storage`` is waltz-storage-node's, ``dev`` waltz-dev's.

``main`` is the whole ``waltz`` command (:data:`waltz_cli.main`, every installed
plugin's commands), kept here so ``python -m waltz_server.cli`` still runs it.
"""

from waltz_cli import main

__all__ = ["main"]
