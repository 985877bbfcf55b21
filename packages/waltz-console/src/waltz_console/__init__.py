"""Waltz console: a web console for operators (``waltz console``).

:mod:`waltz_console.views` computes what the page shows (pure), :mod:`.collector`
reads it (coordination watches, the processes' ``/status`` and ``/metrics``),
:mod:`.web` serves it (aiohttp, Server-Sent Events), :mod:`.actions` changes the
cluster (behind :mod:`.auth`), :mod:`.transactions` reads a partition's log.
"""
