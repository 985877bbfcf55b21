"""waltz-storage-sqlite: a Waltz storage engine on SQLite, registered as the plugin ``sqlite``.

An example of a third-party plugin: a separate installable package that
registers itself through the ``waltz`` entry-point group and is verified by
the shared conformance suite (``waltz-conformance``). Choose it in a storage
node's configuration::

    [storage]
    data_dir = "/var/lib/waltz/storage"
    engine = "sqlite"
    [storage.options]
    synchronous = "full"
"""

from __future__ import annotations

__version__ = "0.2.0.dev0"
