"""The Coordination contract on etcd v3.

Mapping:

- a path ``/a/b`` is the key ``<root>/a/b``; parents are keys too (created
  empty by ``make_parents``), so children are the keys one level below;
- a version is the key's ``mod_revision``: the cluster-wide revision of its
  last change, which never repeats, even across delete and re-create;
- compare-and-set is a transaction comparing ``mod_revision``;
- the session is a lease kept alive in the background; ephemeral entries are
  attached to it; when the lease is lost (revoked or expired) the state goes
  LOST and a new lease (a new session id) replaces it;
- data watches watch one key, child watches watch the key prefix, both resume
  after a broken stream from the next revision, so no change is missed;
- counters are a compare-and-set loop in one transaction per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import aiohttp

from waltz_api.backoff import Backoff
from waltz_api.contracts.coordination import (
    ChildrenCallback,
    Coordination,
    DataCallback,
    SessionListener,
    SessionState,
    Versioned,
    Watch,
)
from waltz_api.coordination_support import Notifier, SessionStateTracker, check_path, seconds_option
from waltz_api.errors import (
    BadVersionError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionLostError,
)
from waltz_api.security import LOGIN_KEYS, TLS_KEYS, Login, TlsOptions
from waltz_coord_etcd.gateway import (
    GRPC_NOT_FOUND,
    JSON,
    EtcdGateway,
    EtcdRequestError,
    b64,
    prefix_end,
    unb64,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_SESSION_TIMEOUT = 10.0
DEFAULT_REQUEST_TIMEOUT = 10.0
DEFAULT_CONNECT_TIMEOUT = 2.0
MAX_CAS_ATTEMPTS = 10_000
MAX_CREATE_ATTEMPTS = 16


@dataclass(frozen=True)
class EtcdTarget:
    """Where an etcd cluster is and which key prefix is ours."""

    endpoints: tuple[str, ...]
    root: str

    @property
    def uri(self) -> str:
        hosts = ",".join(e.split("://", 1)[-1] for e in self.endpoints)
        return f"etcd://{hosts}{self.root or '/'}"


OPTION_KEYS = (
    "session_timeout",
    "request_timeout",
    "connect_timeout",
    "random",
    *TLS_KEYS,
    *LOGIN_KEYS,
)


def split_query(connect: str) -> tuple[str, dict[str, str]]:
    """``etcd://h:p/root?tls=true&username=w`` -> (``etcd://h:p/root``, its options)."""
    base, _, query = connect.partition("?")
    return base, dict(parse_qsl(query))


def parse_connect(connect: str) -> EtcdTarget:
    """Parse ``etcd://host:port[,host:port...]/root`` (the scheme is optional; a query
    of options is left to :func:`split_query`)."""
    text = split_query(connect)[0].strip()
    if text.startswith("etcd://"):
        text = text[len("etcd://") :]
    elif "://" in text:
        raise ConfigError(
            f"etcd connect string {connect!r} has the wrong scheme; "
            "use etcd://host:port[,host:port...]/root",
            key="coordination.connect",
        )
    hosts, slash, root = text.partition("/")
    endpoints: list[str] = []
    for raw_host in hosts.split(","):
        host = raw_host.strip()
        if not host:
            continue
        name, colon, port = host.rpartition(":")
        if not colon:
            name, port = host, str(DEFAULT_PORT)
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"bad etcd member address {host!r} in {connect!r}; expected host:port "
                "(for example etcd://127.0.0.1:2379/waltz)",
                key="coordination.connect",
            )
        endpoints.append(f"http://{name}:{int(port)}")
    if not endpoints:
        raise ConfigError(
            f"etcd connect string {connect!r} names no member; "
            "use etcd://host:port[,host:port...]/root",
            key="coordination.connect",
        )
    segments = [s for s in root.split("/") if s] if slash else []
    return EtcdTarget(tuple(endpoints), "".join("/" + s for s in segments))


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


class _EtcdWatch(Watch):
    def __init__(self, owner: EtcdCoordination, notifier: Notifier[Any]) -> None:
        self._owner = owner
        self.notifier = notifier
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.notifier.close()
        if self.task is not None:
            self.task.cancel()
        self._owner._watches.discard(self)

    async def wait_closed(self) -> None:
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        await self.notifier.wait_closed()


class EtcdCoordination(Coordination):
    """A Coordination client of an etcd v3 cluster (>= 3.4), rooted at a key prefix.

    Options (or URI query parameters; the options win): ``session_timeout``
    (seconds, the lease TTL; default 10), ``request_timeout`` (seconds per operation
    including failover; default 10), ``connect_timeout`` (seconds per connection
    attempt; default 2), TLS and a login (:mod:`waltz_api.security`: ``tls``,
    ``tls_ca``, ``tls_cert``, ``tls_key``, ``username``, ``password_file``...).
    """

    def __init__(self, connect: str, options: Mapping[str, Any] | None = None) -> None:
        options = {**split_query(connect)[1], **dict(options or {})}
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown etcd coordination option(s) {', '.join(unknown)}; valid: "
                f"{', '.join(k for k in OPTION_KEYS if k != 'random')}",
                key=f"coordination.{unknown[0]}",
            )
        self.target = parse_connect(connect)
        tls = TlsOptions.from_options(options)
        self.login = Login.from_options(options)
        self._session_timeout = seconds_option(options, "session_timeout", DEFAULT_SESSION_TIMEOUT)
        request_timeout = seconds_option(options, "request_timeout", DEFAULT_REQUEST_TIMEOUT)
        connect_timeout = seconds_option(options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        self._gateway = EtcdGateway(
            list(self.target.endpoints),
            request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            tls=None if tls is None else tls.context(),
            login=self.login,
        )
        self._root = self.target.root
        # Not started yet: LOST until the session begins; listeners are called inline.
        self._session = SessionStateTracker(
            None,
            SessionState.LOST,
            inline=True,
            describe=lambda: f"etcd session {self._lease_id:x}",
        )
        self._lease_id = 0
        self._ttl = max(1, math.ceil(self._session_timeout))
        self._last_renewal = 0.0
        self._keepalive_task: asyncio.Task[None] | None = None
        self._revoke_task: asyncio.Task[None] | None = None
        self._watches: set[_EtcdWatch] = set()
        self._started = False
        self._closing = False
        # Back-off jitter only; injectable (options["random"]) for simulations.
        self._random: random.Random = options.get("random") or random.Random()

    # -- session -----------------------------------------------------------------

    async def start(self) -> None:
        if self._closing:
            raise CoordinationError("this etcd client was closed; start a new one")
        if self._started:
            return
        try:
            await self._gateway.open()
            await self._grant_lease()
            # one read of the whole prefix: a missing login or a role that does not
            # cover the cluster's keys fails here, not at the first write
            prefix = self._children_prefix("/")
            await self._range(prefix, range_end=b64(prefix_end(prefix)), limit="1", keys_only=True)
        except CoordinationUnavailableError as exc:
            await self._gateway.close()
            hint = await self._gateway.diagnose()
            if hint:
                raise CoordinationUnavailableError(f"{exc}; {hint}") from None
            raise
        except BaseException:
            await self._gateway.close()
            raise
        self._started = True
        self._session.set_state(SessionState.CONNECTED)
        self._keepalive_task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name="waltz-etcd-keepalive"
        )
        log.info(
            "etcd session %x opened on %s (lease TTL %ss)",
            self._lease_id,
            self.target.uri,
            self._ttl,
        )

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        for task in (self._keepalive_task, self._revoke_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for watch in list(self._watches):
            watch.cancel()
            await watch.wait_closed()
        if self._started and self._lease_id and self._session.state is not SessionState.LOST:
            try:
                await self._gateway.call(
                    "lease/revoke", {"ID": str(self._lease_id)}, idempotent=True, timeout=3.0
                )
            except CoordinationError as exc:
                log.warning(
                    "could not revoke etcd lease %x on close (%s); its ephemeral entries "
                    "expire within %ss",
                    self._lease_id,
                    exc,
                    self._ttl,
                )
        await self._gateway.close()
        self._session.close(final=SessionState.LOST)  # closed on purpose: no notification

    @property
    def session_state(self) -> SessionState:
        return self._session.state

    @property
    def session_id(self) -> int:
        return self._lease_id

    @property
    def lease_ttl(self) -> int:
        """The TTL (seconds) etcd granted to the session's lease."""
        return self._ttl

    def add_session_listener(self, listener: SessionListener) -> None:
        self._session.add_listener(listener)

    async def _grant_lease(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await self._gateway.call(
            # Safe to retry: a lease granted by a lost attempt holds no key and expires.
            "lease/grant",
            {"TTL": str(math.ceil(self._session_timeout))},
            idempotent=True,
        )
        self._lease_id = int(answer["ID"])
        self._ttl = int(answer.get("TTL", self._ttl))
        self._last_renewal = started

    def _lose_session(self, reason: str, *, revoke: bool = False) -> None:
        """The lease is gone (revoked, or expired unrenewed): LOST, for good.

        A LOST client stays lost (the contract): its watches stop and every
        later operation raises SessionLostError; the owner starts a new client."""
        if self._closing or self._session.state is SessionState.LOST:
            return
        log.warning(
            "etcd session (lease %x) is lost (%s); its ephemeral entries are gone",
            self._lease_id,
            reason,
        )
        self._session.set_state(SessionState.LOST)
        for watch in list(self._watches):
            watch.cancel()
        if revoke:
            self._revoke_task = asyncio.get_running_loop().create_task(
                self._revoke_when_reachable(self._lease_id), name="waltz-etcd-revoke-lost"
            )

    async def _revoke_when_reachable(self, lease: int) -> None:
        """Make a locally decided LOST true on the server: revoke the lease as soon as
        etcd answers, so its ephemeral entries do not outlive what we told our user
        (etcd extends leases across a leader change or outage)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10 * max(self._ttl, 1)
        while loop.time() < deadline:
            try:
                await self._gateway.call(
                    "lease/revoke", {"ID": str(lease)}, idempotent=True, timeout=2.0
                )
                log.info("revoked the lost etcd lease %x", lease)
                return
            except EtcdRequestError as exc:
                if exc.code == GRPC_NOT_FOUND:
                    return  # already expired or revoked
            except CoordinationError:
                pass
            await asyncio.sleep(0.5)

    async def _keepalive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        lease = self._lease_id
        while not self._closing and self._session.state is not SessionState.LOST:
            # Renew often (cheap: no raft write) so an unreachable cluster shows as
            # SUSPENDED within seconds even with a long TTL.
            await asyncio.sleep(min(self._ttl / 3, 1.0))
            sent = loop.time()
            try:
                answer = await self._gateway.call(
                    "lease/keepalive",
                    {"ID": str(lease)},
                    idempotent=True,
                    timeout=max(min(self._ttl / 3, 2.0), 1.0),
                )
            except Exception as exc:  # any failure to renew counts, never ends the loop
                if not isinstance(exc, CoordinationError):
                    log.exception("etcd keepalive of lease %x failed unexpectedly", lease)
                log.debug("etcd keepalive of lease %x failed: %s", lease, exc)
                if self._session.state is SessionState.CONNECTED:
                    self._session.set_state(SessionState.SUSPENDED)
                if loop.time() - self._last_renewal > self._ttl:
                    self._lose_session(
                        f"not renewed for more than its TTL of {self._ttl}s", revoke=True
                    )
                continue
            if int(answer.get("TTL", 0)) <= 0:
                self._lose_session("etcd no longer knows the lease")
            else:
                self._last_renewal = sent
                self._session.set_state(SessionState.CONNECTED)

    # -- keys ----------------------------------------------------------------------

    def _key(self, path: str) -> bytes:
        check_path(path)
        return (self._root + ("" if path == "/" else path)).encode()

    def _children_prefix(self, path: str) -> bytes:
        return self._key(path) + b"/"

    def _require_started(self) -> None:
        if not self._started or self._closing:
            raise CoordinationError(
                "the etcd coordination client is not started or was closed; start a new one"
            )
        if self._session.state is SessionState.LOST:
            raise SessionLostError(
                f"the etcd session (lease {self._lease_id:x}) was lost and its ephemeral "
                "entries are gone; close this client and start a new one"
            )

    async def _txn(self, compare: list[JSON], success: list[JSON], failure: list[JSON]) -> JSON:
        return await self._gateway.call(
            "kv/txn",
            {"compare": compare, "success": success, "failure": failure},
            idempotent=False,
        )

    async def _range(self, key: bytes, **extra: Any) -> JSON:
        return await self._gateway.call("kv/range", {"key": b64(key), **extra}, idempotent=True)

    # -- operations --------------------------------------------------------------

    async def get(self, path: str) -> Versioned | None:
        self._require_started()
        if check_path(path) == "/":
            return None
        answer = await self._range(self._key(path))
        return _versioned(answer.get("kvs"))

    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, make_parents: bool = True
    ) -> int:
        self._require_started()
        if check_path(path) == "/":
            raise NodeExistsError("the root always exists")
        key = self._key(path)
        parent = _parent(path)
        for _ in range(MAX_CREATE_ATTEMPTS):
            lease = self._lease_id
            compare: list[JSON] = [_cmp(key, "CREATE", "EQUAL", create_revision="0")]
            failure: list[JSON] = [{"request_range": {"key": b64(key)}}]
            if parent != "/":
                parent_key = self._key(parent)
                compare.append(_cmp(parent_key, "CREATE", "GREATER", create_revision="0"))
                compare.append(_cmp(parent_key, "LEASE", "EQUAL", lease="0"))
                failure.append({"request_range": {"key": b64(parent_key)}})
            put: JSON = {"key": b64(key), "value": b64(value)}
            if ephemeral:
                put["lease"] = str(lease)
            try:
                answer = await self._txn(compare, [{"request_put": put}], failure)
            except EtcdRequestError as exc:
                if ephemeral and exc.code == GRPC_NOT_FOUND and "lease" in str(exc):
                    self._lose_session("etcd no longer knows the lease")
                    raise SessionLostError(
                        f"cannot create ephemeral {path!r}: the session (lease {lease:x}) "
                        "was lost; close this client and start a new one"
                    ) from exc
                raise
            if answer.get("succeeded"):
                return int(answer["header"]["revision"])
            responses = answer.get("responses", [])
            if _range_kvs(responses, 0):
                raise NodeExistsError(f"{path!r} already exists")
            parent_kvs = _range_kvs(responses, 1)
            if parent_kvs:
                if int(parent_kvs[0].get("lease", 0)):
                    raise CoordinationError(
                        f"cannot create {path!r}: its parent {parent!r} is ephemeral, "
                        "and an ephemeral entry can have no children"
                    )
                continue  # the parent appeared concurrently: try again
            if not make_parents:
                raise NoNodeError(
                    f"cannot create {path!r}: its parent {parent!r} does not exist "
                    "(create it first, or pass make_parents=True)"
                )
            with contextlib.suppress(NodeExistsError):
                await self.create(parent, b"", make_parents=True)
        raise CoordinationError(
            f"create of {path!r} kept conflicting with concurrent changes of its parent"
        )

    async def set(self, path: str, value: bytes, *, expected_version: int | None = None) -> int:
        self._require_started()
        if check_path(path) == "/":
            raise CoordinationError("the root holds no value; set a path below it")
        key = self._key(path)
        # An absent key has mod_revision 0: require existence in every case.
        compare = [_cmp(key, "CREATE", "GREATER", create_revision="0")]
        if expected_version is not None:
            compare.append(_cmp(key, "MOD", "EQUAL", mod_revision=str(int(expected_version))))
        put = {"key": b64(key), "value": b64(value), "ignore_lease": True}
        answer = await self._txn(
            compare, [{"request_put": put}], [{"request_range": {"key": b64(key)}}]
        )
        if answer.get("succeeded"):
            return int(answer["header"]["revision"])
        current = _range_kvs(answer.get("responses", []), 0)
        if not current:
            raise NoNodeError(f"cannot set {path!r}: it does not exist (create it first)")
        raise BadVersionError(
            f"compare-and-set of {path!r} lost: expected version {expected_version}, "
            f"current version {int(current[0].get('mod_revision', 0))}; read it again"
        )

    async def delete(
        self, path: str, *, expected_version: int | None = None, recursive: bool = False
    ) -> None:
        self._require_started()
        if check_path(path) == "/":
            raise CoordinationError("the root cannot be deleted; delete the paths below it")
        key = self._key(path)
        prefix = key + b"/"
        compare = [_cmp(key, "CREATE", "GREATER", create_revision="0")]
        if expected_version is not None:
            compare.append(_cmp(key, "MOD", "EQUAL", mod_revision=str(int(expected_version))))
        success: list[JSON] = [{"request_delete_range": {"key": b64(key)}}]
        if recursive:
            success.append(
                {"request_delete_range": {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}}
            )
        else:
            compare.append(
                {
                    **_cmp(prefix, "CREATE", "EQUAL", create_revision="0"),
                    "range_end": b64(prefix_end(prefix)),
                }
            )
        failure: list[JSON] = [
            {"request_range": {"key": b64(key)}},
            {
                "request_range": {
                    "key": b64(prefix),
                    "range_end": b64(prefix_end(prefix)),
                    "count_only": True,
                }
            },
        ]
        answer = await self._txn(compare, success, failure)
        if answer.get("succeeded"):
            return
        responses = answer.get("responses", [])
        current = _range_kvs(responses, 0)
        if not current:
            if expected_version is not None:
                raise NoNodeError(f"cannot delete {path!r} at version {expected_version}: absent")
            return
        if expected_version is not None and int(current[0].get("mod_revision", 0)) != int(
            expected_version
        ):
            raise BadVersionError(
                f"versioned delete of {path!r} lost: expected version {expected_version}, "
                f"current version {int(current[0].get('mod_revision', 0))}"
            )
        raise NotEmptyError(
            f"cannot delete {path!r}: it has children (delete them, or pass recursive=True)"
        )

    async def children(self, path: str) -> list[str]:
        self._require_started()
        check_path(path)
        names, _ = await self._list_children(path)
        return names

    async def _list_children(self, path: str) -> tuple[list[str], int]:
        prefix = self._children_prefix(path)
        answer = await self._range(prefix, range_end=b64(prefix_end(prefix)), keys_only=True)
        names = sorted(
            rel
            for rel in (
                unb64(kv.get("key"))[len(prefix) :].decode() for kv in answer.get("kvs", [])
            )
            if rel and "/" not in rel
        )
        return names, int(answer["header"]["revision"])

    async def increment(self, path: str) -> int:
        self._require_started()
        if check_path(path) == "/":
            raise CoordinationError("the root cannot be a counter")
        key = self._key(path)
        current = await self.get(path)
        for attempt in range(MAX_CAS_ATTEMPTS):
            if current is None:
                try:
                    await self.create(path, b"1")
                    return 1
                except NodeExistsError:
                    current = await self.get(path)
                    continue
            value = _counter_value(path, current.value) + 1
            answer = await self._txn(
                [_cmp(key, "MOD", "EQUAL", mod_revision=str(current.version))],
                [{"request_put": {"key": b64(key), "value": b64(str(value))}}],
                [{"request_range": {"key": b64(key)}}],
            )
            if answer.get("succeeded"):
                return value
            current = _versioned(_range_kvs(answer.get("responses", []), 0))
            if attempt > 2:
                await asyncio.sleep(self._random.uniform(0, min(0.001 * attempt, 0.05)))
        raise CoordinationError(
            f"increment of {path!r} lost {MAX_CAS_ATTEMPTS} compare-and-set races in a row"
        )

    # -- watches -------------------------------------------------------------------

    async def watch(self, path: str, callback: DataCallback) -> Watch:
        self._require_started()
        check_path(path)
        key = self._key(path)
        notifier: Notifier[Versioned | None] = Notifier(callback, f"data of {path}")
        handle = _EtcdWatch(self, notifier)
        if path == "/":  # the root never holds a value
            await notifier.deliver_initial(None, 0)
            return handle
        answer = await self._range(key)
        state, revision = _versioned(answer.get("kvs")), int(answer["header"]["revision"])
        self._watches.add(handle)
        await notifier.deliver_initial(state, revision)

        def apply(events: list[JSON]) -> None:
            for event in events:
                kv = event.get("kv", {})
                revision = int(kv.get("mod_revision", 0))
                if event.get("type") == "DELETE":
                    notifier.offer(None, revision)
                else:
                    notifier.offer(Versioned(unb64(kv.get("value")), revision), revision)

        async def resync() -> int:
            answer = await self._range(key)
            revision = int(answer["header"]["revision"])
            notifier.offer(_versioned(answer.get("kvs")), revision)
            return revision

        handle.task = asyncio.get_running_loop().create_task(
            self._watch_loop(key, None, revision + 1, apply, resync),
            name=f"waltz-etcd-watch {path}",
        )
        return handle

    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        self._require_started()
        check_path(path)
        prefix = self._children_prefix(path)
        notifier: Notifier[list[str]] = Notifier(callback, f"children of {path}")
        names, revision = await self._list_children(path)
        current = set(names)
        handle = _EtcdWatch(self, notifier)
        self._watches.add(handle)
        await notifier.deliver_initial(names, revision)

        def apply(events: list[JSON]) -> None:
            for event in events:
                kv = event.get("kv", {})
                rel = unb64(kv.get("key"))[len(prefix) :].decode()
                if not rel or "/" in rel:
                    continue
                if event.get("type") == "DELETE":
                    current.discard(rel)
                else:
                    current.add(rel)
                notifier.offer(sorted(current), int(kv.get("mod_revision", 0)))

        async def resync() -> int:
            names, revision = await self._list_children(path)
            current.clear()
            current.update(names)
            notifier.offer(names, revision)
            return revision

        handle.task = asyncio.get_running_loop().create_task(
            self._watch_loop(prefix, prefix_end(prefix), revision + 1, apply, resync),
            name=f"waltz-etcd-watch-children {path}",
        )
        return handle

    async def _watch_loop(
        self,
        key: bytes,
        range_end: bytes | None,
        start_revision: int,
        apply: Callable[[list[JSON]], None],
        resync: Callable[[], Any],
    ) -> None:
        next_revision = start_revision
        retry = Backoff(0.05, 1.0, self._random)
        while not self._closing:
            request: JSON = {"key": b64(key), "start_revision": str(next_revision)}
            if range_end is not None:
                request["range_end"] = b64(range_end)
            try:
                async for message in self._gateway.stream(
                    "watch",
                    {"create_request": request},
                    # Cancel the stream when its member loses the leader (etcd's
                    # require-leader metadata), so we resume on a healthy member.
                    headers={"Grpc-Metadata-hasleader": "true"},
                ):
                    retry.reset()
                    if int(message.get("compact_revision", 0)) > 0:
                        log.warning("etcd watch on %r fell behind a compaction; re-reading", key)
                        next_revision = int(await resync()) + 1
                        break
                    if message.get("canceled"):
                        break
                    events = message.get("events") or []
                    if events:
                        apply(events)
                        next_revision = (
                            max(int(e.get("kv", {}).get("mod_revision", 0)) for e in events) + 1
                        )
            except asyncio.CancelledError:
                raise
            except (CoordinationError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("etcd watch stream on %r broke (%s); resuming", key, exc)
            except Exception:  # never let a watch die silently: log, then resume
                log.exception("etcd watch stream on %r failed unexpectedly; resuming", key)
            await retry.sleep()


def _cmp(key: bytes, target: str, result: str, **field: str) -> JSON:
    return {"key": b64(key), "target": target, "result": result, **field}


def _range_kvs(responses: list[JSON], index: int) -> list[JSON]:
    if index >= len(responses):
        return []
    kvs = responses[index].get("response_range", {}).get("kvs")
    return list(kvs or [])


def _versioned(kvs: list[JSON] | None) -> Versioned | None:
    if not kvs:
        return None
    kv = kvs[0]
    return Versioned(unb64(kv.get("value")), int(kv.get("mod_revision", 0)))


def _counter_value(path: str, raw: bytes) -> int:
    try:
        return int(raw.decode("ascii")) if raw else 0
    except (UnicodeDecodeError, ValueError) as exc:
        raise CoordinationError(
            f"{path!r} holds {raw[:40]!r}, which is not a counter (a decimal integer)"
        ) from exc
