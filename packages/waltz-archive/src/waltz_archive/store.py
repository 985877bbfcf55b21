"""The archive location: an fsspec file system and a root path, blocking calls.

Every call is blocking (the server runs them with :meth:`ArchiveStore.call`: in a
thread, with a deadline); every failure of the location (unreachable, refused, full, missing) is an
:class:`~waltz_api.errors.ArchiveError` naming the URL and the object.

Durability: an object store's PUT is durable when it returns. A local directory
(``file://`` or a plain path) is not until flushed: :meth:`ArchiveStore.put_file` and
:meth:`ArchiveStore.write_bytes` then write to a temporary name, fsync the file, rename
it to its final name and fsync the directory, so that a machine crash after the archive
mark moved can never lose an object the mark relies on.

The seam: :func:`open_store` makes the store of a URL, with a class registered for its
scheme (:func:`register_scheme`) or this fsspec one. The deterministic simulation
registers its object store this way (``waltz_sim.archive``): it overrides the calls,
:meth:`ArchiveStore.call` (its calls run on the event loop after a simulated latency)
and :meth:`ArchiveStore.new_token` (names drawn from the run's seed), and the archiver,
the reader and the server run unchanged over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit

import fsspec

from waltz_api.errors import ArchiveError, ConfigError
from waltz_archive import layout

T = TypeVar("T")

log = logging.getLogger(__name__)

_LOCAL = ("file", "local")


def parse_storage_options(raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """fsspec options from a mapping or a JSON object string (a CLI option, a Spark
    option); ConfigError for anything else."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"archive storage options must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"archive storage options must be a JSON object, got {raw!r}")
    return value


class ArchiveStore:
    """One archive location (``url``, with fsspec ``storage_options``)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        if not url.strip():
            raise ConfigError("the archive URL is empty (e.g. s3://bucket/waltz, file:///srv/arc)")
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"cannot use archive URL {url!r}: {exc} (an s3:// archive needs "
                "pip install 'waltz-archive[s3]')"
            ) from None
        self.root = root.rstrip("/")
        protocol = self.fs.protocol
        self.local = (protocol if isinstance(protocol, str) else protocol[0]) in _LOCAL

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def call(self, fn: Callable[[], T], timeout: float) -> T:
        """Run ``fn`` (blocking calls to this location) off the event loop, in a thread;
        TimeoutError after ``timeout`` seconds (the thread finishes on its own)."""
        return await asyncio.wait_for(asyncio.to_thread(fn), timeout)

    def new_token(self) -> str:
        """The random token that ends a new object's or manifest's name."""
        return layout.new_token()

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def where(self, path: str) -> str:
        """How an object is named in messages: the archive URL and the object's path."""
        relative = path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path
        return f"{self.url}/{relative}"

    @contextlib.contextmanager
    def _errors(self, what: str, path: str) -> Iterator[None]:
        try:
            yield
        except ArchiveError:
            raise
        except FileNotFoundError:
            raise ArchiveError(
                f"archive object {self.where(path)} does not exist ({what})"
            ) from None
        except Exception as exc:  # fsspec back-ends raise anything (OSError, botocore...)
            raise ArchiveError(
                f"archive {self.url}: {what} {self.where(path)} failed: {type(exc).__name__}: {exc}"
            ) from exc

    # -- writes (new names only: nothing is ever overwritten) ------------------------------

    def write_bytes(self, path: str, data: bytes) -> None:
        with self._errors("writing", path):
            if self.local:
                self._local_durable(path, lambda out: out.write(data))
            else:
                self.fs.pipe_file(path, data)

    def put_file(self, local_path: str, path: str) -> None:
        """Upload a finished local file as the object ``path``."""
        with self._errors("uploading", path):
            if self.local:

                def copy(out: IO[bytes]) -> None:
                    with open(local_path, "rb") as source:
                        shutil.copyfileobj(source, out, 1 << 20)

                self._local_durable(path, copy)
            else:
                self.fs.put_file(local_path, path)

    def _local_durable(self, path: str, write: Any) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            os.rename(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def move(self, path: str, target: str) -> None:
        """Move the object ``path`` to the new name ``target`` (setting an object aside:
        never onto a name that exists). A local directory renames it and flushes both
        directories; an object store copies it and deletes the original."""
        with self._errors("moving", path):
            if self.exists(target):
                raise ArchiveError(f"archive object {self.where(target)} exists already")
            if self.local:
                source, destination = Path(path), Path(target)
                destination.parent.mkdir(parents=True, exist_ok=True)
                os.rename(source, destination)
                for directory in {source.parent, destination.parent}:
                    fd = os.open(directory, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            else:
                self.fs.mv(path, target)

    # -- reads ------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        with self._errors("reading", path):
            data: bytes = self.fs.cat_file(path)
            return data

    def open(self, path: str) -> IO[bytes]:
        """A seekable reader of the object (Parquet reads only the parts it needs)."""
        with self._errors("opening", path):
            handle: IO[bytes] = self.fs.open(path, "rb")
            return handle

    def size(self, path: str) -> int:
        with self._errors("asking the size of", path):
            return int(self.fs.size(path))

    def list(self, directory: str) -> list[str]:
        """The names (not paths) of the objects in ``directory``; empty when it is absent."""
        with self._errors("listing", directory):
            try:
                entries = self.fs.ls(directory, detail=False, refresh=True)
            except FileNotFoundError:
                return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def exists(self, path: str) -> bool:
        with self._errors("looking for", path):
            return bool(self.fs.exists(path))


_SCHEMES: dict[str, Callable[[str, Mapping[str, Any] | None], ArchiveStore]] = {}


def register_scheme(
    scheme: str, factory: Callable[[str, Mapping[str, Any] | None], ArchiveStore]
) -> None:
    """Make :func:`open_store` use ``factory`` for URLs of ``scheme`` (the simulation's
    object store; replaces an earlier registration of the scheme)."""
    _SCHEMES[scheme] = factory


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> ArchiveStore:
    """The store of ``url``: a registered scheme's, else :class:`ArchiveStore` (fsspec)."""
    factory = _SCHEMES.get(urlsplit(url.strip()).scheme)
    if factory is not None:
        return factory(url, storage_options)
    return ArchiveStore(url, storage_options)
