"""Waltz tiered storage: old records archived as Parquet to object storage.

- :mod:`waltz_archive.archiver`: the archiver of one partition (run by its owner).
- :mod:`waltz_archive.reader`: archived records read back (the server's reads below its
  replicas), with a bounded cache.
- :mod:`waltz_archive.metadata`: the archive mark in the cluster metadata (CAS).
- :mod:`waltz_archive.manifest`, :mod:`waltz_archive.objects`,
  :mod:`waltz_archive.records`, :mod:`waltz_archive.layout`: the archive's format.
- :mod:`waltz_archive.store`: the location (an fsspec URL).
- :mod:`waltz_archive.tools`: status, verify, restore (``waltz archive``).

Nothing is imported here: pyarrow and fsspec load only when a module is used.
The design and its safety argument: docs/archive.md.
"""
