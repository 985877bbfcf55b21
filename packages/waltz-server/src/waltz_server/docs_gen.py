"""The generated parts of the docs, so they keep matching the code.

- ``docs/operators.md``: the tables of every config key (server, storage node,
  client) and of every built-in plugin's options, between
  ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` markers;
- ``docs/cli.md``: the reference of every ``waltz`` command, from the click tree.

::

    python -m waltz_server.docs_gen [--root REPO]           # rewrite them
    python -m waltz_server.docs_gen [--root REPO] --check   # exit 1 when they are stale

The config tables come from the schemas (``waltz_api.config.describe``) and the
plugins' own default constants; a key without a meaning (schema ``help`` or the
texts below) is an error, so a new key cannot go undocumented.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from waltz_api.config import describe
from waltz_api.errors import ConfigError

log = logging.getLogger(__name__)

BEGIN = "<!-- generated: {name} (python -m waltz_server.docs_gen) -->"
END = "<!-- end generated -->"
MIB = 1024 * 1024
_UNSET: Any = getattr(click.core, "UNSET", object())
"""click 8.2+ marks a parameter without a default with this sentinel."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One documented key: ``key`` (dotted), its type, default and meaning."""

    key: str
    type: str
    default: Any
    meaning: str
    required: bool = False


# -- formatting -------------------------------------------------------------------------


def format_default(value: Any, *, required: bool = False) -> str:
    """A default as a TOML-like literal (``8388608`` gets ``(8 MiB)``)."""
    if required:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= MIB and value % MIB == 0:
        size = value // MIB
        human = f"{size // 1024} GiB" if size % 1024 == 0 else f"{size} MiB"
        return f"`{value}` ({human})"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(format_default(v).strip("`") for v in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def type_name(hint: Any) -> str:
    """A readable type: ``int``, ``list[int]``, ``str | None``, ``table``."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return "table"
    if origin in (list, tuple, Sequence):
        args = typing.get_args(hint)
        return f"list[{type_name(args[0])}]" if args else "list"
    return str(getattr(hint, "__name__", hint)).replace("typing.", "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(rows: Iterable[Row], *, env_prefix: str | None = "WALTZ_") -> str:
    """A markdown table of ``rows``; with ``env_prefix``, a column with each key's variable."""
    header = "| key | type | default | meaning |"
    rule = "|---|---|---|---|"
    if env_prefix is not None:
        header += " environment |"
        rule += "---|"
    lines = [header, rule]
    for row in rows:
        line = (
            f"| `{row.key}` | {_cell(row.type)} | "
            f"{format_default(row.default, required=row.required)} | {_cell(row.meaning)} |"
        )
        if env_prefix is not None:
            variable = env_prefix + row.key.upper().replace(".", "__")
            if row.type == "table":
                variable += "__<OPTION>"
            line += f" `{variable}` |"
        lines.append(line)
    return "\n".join(lines) + "\n"


# -- config schemas ---------------------------------------------------------------------


def schema_rows(schema: type[Any], meanings: Mapping[str, str] | None = None) -> list[Row]:
    """Every key of a config schema (a nested dataclass), from ``describe``.

    The meaning is the field's ``help`` metadata, else ``meanings[key]``; a key
    with neither raises ConfigError (document it)."""
    meanings = meanings or {}
    rows: list[Row] = []
    for key, _type, default, help_text in describe(schema):
        field, hint = _field_of(schema, key)
        meaning = help_text or meanings.get(key, "")
        if not meaning:
            raise ConfigError(
                f"config key {key!r} of {schema.__name__} has no help text: add "
                "metadata={'help': ...} to its field",
                key=key,
            )
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        extra = []
        if "choices" in field.metadata:
            extra.append("one of " + ", ".join(f"`{c}`" for c in field.metadata["choices"]))
        if "min" in field.metadata:
            extra.append(f"at least {field.metadata['min']}")
        if "max" in field.metadata:
            extra.append(f"at most {field.metadata['max']}")
        if extra:
            meaning = f"{meaning} ({'; '.join(extra)})"
        rows.append(Row(key, type_name(hint), default, meaning, required=required))
    return rows


def _field_of(schema: type[Any], key: str) -> tuple[dataclasses.Field[Any], Any]:
    current: Any = schema
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(current)}
        hint = typing.get_type_hints(current)[part]
        if depth == len(parts) - 1:
            return fields[part], hint
        current = hint
    raise KeyError(key)  # pragma: no cover - describe() only yields existing keys


CLIENT_MEANINGS = {
    "coordination": "coordination URI (`zk://`, `etcd://`, `local://`) or a started "
    "`Coordination` the caller owns",
    "coordination_options": "coordination plugin options, passed as-is (tables below)",
    "transport": "transport plugin name",
    "transport_options": "transport plugin options, passed as-is (tables below)",
    "partitions": "the partitions to mount (unset: all); submissions to others fail",
    "max_concurrent_transactions": "transactions in flight per partition; `submit` waits beyond it",
    "data_cache_bytes": "bound of the transaction data cache (LRU)",
    "connect_timeout": "seconds to connect to a server",
    "request_timeout": "seconds to wait for an answer (a mount is re-sent after it; a data "
    "request fails after it)",
    "retry_interval": "seconds before mounting or asking again after NOT_READY, a refusal or "
    "a lost connection (doubling up to 1 s, with jitter, while attempts fail)",
    "transaction_timeout": "deadline of a submission in seconds (waiting, retries and its "
    "append in flight): then it is decided (committed, `TransactionExpiredError`, or "
    "`TransactionOutcomeUnknownError` when the server cannot be asked); unset: none",
    "prefetch_data": "fetch the data of feed items arriving together, pipelined, before the "
    "callbacks ask",
    "apply_retries": "times a transaction `apply_transaction` raised on is offered again "
    "(back-off from `retry_interval` doubling to 10 s) before `poison_policy` decides",
    "poison_policy": "`stop`: the partition stops with `PoisonTransactionError`; `skip`: the "
    "transaction goes to `WaltzClientCallbacks.dead_letter` and the feed goes on",
}


def client_rows() -> list[Row]:
    """``waltz_client.ClientConfig`` (a constructor, not a file: no environment)."""
    from waltz_client import ClientConfig

    return schema_rows(ClientConfig, CLIENT_MEANINGS)


# -- plugin options ---------------------------------------------------------------------


def zk_rows() -> list[Row]:
    from waltz_coord_zk import coordination as zk

    return [
        Row(
            "session_timeout",
            "float",
            zk.DEFAULT_SESSION_TIMEOUT,
            "seconds; a client silent this long loses its session and its ephemeral entries "
            "(a server whose session ends drops its partitions and registers again)",
        ),
        Row(
            "connect_timeout",
            "float",
            zk.DEFAULT_CONNECT_TIMEOUT,
            "seconds to reach the ensemble at start",
        ),
        *tls_rows("ZooKeeper's `secureClientPort`"),
        Row(
            "auth",
            "str",
            "",
            "`digest` (ZooKeeper's digest scheme) or `sasl` (SASL DIGEST-MD5; needs "
            "`waltz-coord-zk[sasl]`); with `username` and `password` or `password_file`",
        ),
        *login_rows(),
        Row(
            "acl",
            "str",
            "",
            "ACL of the znodes this client creates: `world-read` (default with `auth`: the "
            "cluster's identity may do anything, others only read), `private` (only the "
            "cluster's identity), `open` (default without `auth`: anyone)",
        ),
    ]


def tls_rows(port: str) -> list[Row]:
    """The TLS options of ``waltz_api.security`` (zk and etcd)."""
    return [
        Row("tls", "bool", False, f"connect over TLS ({port}); implied by any `tls_*` option"),
        Row(
            "tls_ca",
            "path",
            "",
            "PEM CA certificate(s) of the server's certificate (default: the system's)",
        ),
        Row(
            "tls_cert",
            "path",
            "",
            "this client's certificate (PEM), for a server requiring client certificates",
        ),
        Row("tls_key", "path", "", "the key of `tls_cert` (PEM)"),
        Row("tls_key_password", "str", "", "the password of an encrypted `tls_key`"),
        Row(
            "tls_check_hostname",
            "bool",
            True,
            "the server's certificate must name the host connected to",
        ),
    ]


def login_rows() -> list[Row]:
    return [
        Row("username", "str", "", "the cluster's identity on the coordination service"),
        Row(
            "password",
            "str",
            "",
            "its password (prefer `password_file`: URIs show up in process lists)",
        ),
        Row("password_file", "path", "", "a file holding the password (one line)"),
    ]


ETCD_CONNECT_TIMEOUT = 2.0
"""The etcd plugin's connect_timeout default (a literal in its code; the docs test
checks it against a constructed client)."""


def etcd_rows() -> list[Row]:
    from waltz_coord_etcd import coordination as etcd

    return [
        Row(
            "session_timeout",
            "float",
            etcd.DEFAULT_SESSION_TIMEOUT,
            "seconds, the lease TTL (whole seconds, rounded up); ephemeral keys carry the lease",
        ),
        Row(
            "request_timeout",
            "float",
            etcd.DEFAULT_REQUEST_TIMEOUT,
            "seconds per operation, failover to another member included",
        ),
        Row(
            "connect_timeout",
            "float",
            ETCD_CONNECT_TIMEOUT,
            "seconds per connection attempt to one member",
        ),
    ]


def local_rows() -> list[Row]:
    from waltz_coord_local import coordination as local

    return [
        Row(
            "root",
            "str",
            "/",
            "path prefix of every entry (also the URI's `?root=`; the option wins)",
        ),
        Row(
            "session_timeout",
            "float",
            local.DEFAULT_SESSION_TIMEOUT,
            "seconds; a process that stops renewing loses its session and ephemeral entries",
        ),
        Row(
            "poll_interval",
            "float",
            local.DEFAULT_POLL_INTERVAL,
            "seconds between polls of the SQLite file for watches",
        ),
        Row(
            "busy_timeout",
            "float",
            local.DEFAULT_BUSY_TIMEOUT,
            "seconds to wait for the SQLite write lock",
        ),
    ]


ZMQ_MEANINGS = {
    "max_frame_size": "largest frame sent or accepted, bytes (also `ZMQ_MAXMSGSIZE`)",
    "heartbeat_interval": "seconds without sending after which a heartbeat is sent; the "
    "watchdog period",
    "heartbeat_timeout": "seconds of silence after which the peer is reported dead; must "
    "exceed the interval",
    "window_frames": "frames a peer may send beyond what this side's application consumed, "
    "and the most this side keeps in flight to a peer (1..2^24)",
    "window_bytes": "bytes a peer may send beyond what this side's application consumed, "
    "and the most this side keeps in flight to a peer (1..2^40)",
    "coalesce": "pack small frames sent in one loop iteration into one ZeroMQ message",
    "high_water_mark": "`ZMQ_SNDHWM`/`ZMQ_RCVHWM`; 0: automatic (`2 * window_frames + "
    "4096`); else must exceed `2 * window_frames`",
    "reconnect_interval": "seconds, `ZMQ_RECONNECT_IVL`",
    "reconnect_interval_max": "seconds, `ZMQ_RECONNECT_IVL_MAX`",
    "linger": "seconds a closed socket may spend sending its last messages",
    "io_threads": "ZeroMQ I/O threads of the transport's context",
    "security": '`"auto"` (curve when keys are given, else plaintext on loopback and ipc '
    'only), `"plaintext"` (anywhere, deliberately), `"curve"`',
    "curve_server_key": "listener: path of this process's `NAME.key_secret` "
    "(`waltz keys generate`)",
    "curve_authorized_keys": "listener: a directory of the allowed clients' `NAME.key` files, "
    "one such file or Z85 key, or a list of them",
    "curve_server_public_key": "connecting side: the server's `NAME.key` file or its Z85 "
    "public key",
    "curve_client_key": "connecting side: path of this process's own `NAME.key_secret`",
}


def zmq_rows() -> list[Row]:
    from waltz_transport_zmq import options as zmq_options

    defaults: Mapping[str, Any] = zmq_options._DEFAULTS
    _same_keys("zmq transport", defaults, ZMQ_MEANINGS)
    return [
        Row(key, _zmq_type(key, value), value, ZMQ_MEANINGS[key]) for key, value in defaults.items()
    ]


def _zmq_type(key: str, value: Any) -> str:
    if key.startswith("curve_"):
        return "str | list[str]" if key == "curve_authorized_keys" else "str"
    return type(value).__name__


FS_MEANINGS = {
    "segment_size": "bytes; a new segment file starts once the current one reaches it",
    "index_checkpoint_interval": "records between flushes of the index file",
    "read_threads": "threads reading segments for range reads",
    "verify_on_open": "1: start-up recovery checks every record, not only those after each "
    "index's last flushed checkpoint (damage anywhere becomes a hole repaired from a peer)",
}


def fs_rows() -> list[Row]:
    from waltz_storage_fs.engine import FsOptions

    fields = {f.name: f for f in dataclasses.fields(FsOptions)}
    _same_keys("fs storage", fields, FS_MEANINGS)
    return [
        Row(name, type_name(f.type), f.default, FS_MEANINGS[name]) for name, f in fields.items()
    ]


def hwm_array_rows() -> list[Row]:
    from waltz_server.locktables import hwm_array

    _same_keys("hwm-array lock table", dict.fromkeys(hwm_array._OPTIONS), {"size": ""})
    return [
        Row(
            "size",
            "int",
            hwm_array.DEFAULT_SIZE,
            f"slots of high-water marks (1 to {hwm_array.MAX_SIZE}); more slots, fewer "
            "false lock failures, more memory (8 bytes a slot)",
        )
    ]


def exact_rows() -> list[Row]:
    from waltz_server.locktables import exact

    _same_keys("exact lock table", dict.fromkeys(exact._OPTIONS), {})
    return []


def _same_keys(what: str, code: Mapping[str, Any], documented: Mapping[str, Any]) -> None:
    if set(code) != set(documented):
        missing = sorted(set(code) - set(documented))
        extra = sorted(set(documented) - set(code))
        raise ConfigError(
            f"the {what} options changed: undocumented {missing}, gone {extra}; update "
            "waltz_server.docs_gen"
        )


# -- the sections of docs/operators.md ----------------------------------------------------


def _server_section() -> str:
    from waltz_server.server.config import ServerNodeConfig

    return table(schema_rows(ServerNodeConfig))


def _storage_section() -> str:
    from waltz_server.storage_node.config import StorageNodeConfig

    return table(schema_rows(StorageNodeConfig))


def _options(rows: list[Row]) -> str:
    if not rows:
        return "No options (an option given is refused).\n"
    return table(rows, env_prefix=None)


SECTIONS: dict[str, Callable[[], str]] = {
    "server-config": _server_section,
    "storage-config": _storage_section,
    "client-config": lambda: table(client_rows(), env_prefix=None),
    "zk-options": lambda: _options(zk_rows()),
    "etcd-options": lambda: _options(etcd_rows()),
    "local-options": lambda: _options(local_rows()),
    "zmq-options": lambda: _options(zmq_rows()),
    "fs-options": lambda: _options(fs_rows()),
    "hwm-array-options": lambda: _options(hwm_array_rows()),
    "exact-options": lambda: _options(exact_rows()),
}


def fill_sections(text: str, sections: Mapping[str, Callable[[], str]] = SECTIONS) -> str:
    """``text`` with every generated region replaced; every section must have a region."""
    for name, make in sections.items():
        begin = BEGIN.format(name=name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(END), re.DOTALL)
        if not pattern.search(text):
            raise ConfigError(f"the docs have no region {begin!r} ... {END!r}")
        replacement = f"{begin}\n{make()}{END}"
        text = pattern.sub(lambda _match: replacement, text, count=1)  # noqa: B023 - used at once
    return text


# -- the CLI reference --------------------------------------------------------------------


def _help_text(command: click.Command) -> str:
    text = inspect.cleandoc(command.help or command.short_help or "")
    lines = [line for line in text.splitlines() if line.strip() != "\b"]
    return "\n".join(line.rstrip() for line in lines)


def _param_names(param: click.Parameter) -> str:
    if isinstance(param, click.Option):
        names = [*param.opts, *param.secondary_opts]
        if param.is_flag and param.secondary_opts:
            names = ["/".join(param.opts + param.secondary_opts)]
        return ", ".join(f"`{n}`" for n in names)
    return f"`{(param.human_readable_name or '').upper()}`"


def _param_type(param: click.Parameter) -> str:
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    kind = param.type
    if isinstance(kind, click.Choice):
        return " \\| ".join(str(c) for c in kind.choices)
    name = str(kind.name)
    if isinstance(kind, click.IntRange | click.FloatRange):
        name = f"{name} {kind._describe_range()}"
    elif param.metavar:
        name = param.metavar
    if param.multiple:
        name += ", repeatable"
    if getattr(param, "nargs", 1) == -1:
        name += " ..."
    return name


def _param_default(param: click.Parameter) -> str:
    if param.required:
        return "required"
    default = param.default
    if default is None or default is _UNSET or (param.multiple and not default):
        return ""
    if callable(default):
        return "computed"
    if isinstance(param, click.Option) and param.is_flag:
        return "on" if default is True else ""
    return f"`{default}`"


def _param_help(param: click.Parameter) -> str:
    text = getattr(param, "help", None) or ""
    envvar = getattr(param, "envvar", None)
    if envvar:
        names = [envvar] if isinstance(envvar, str) else list(envvar)
        text = f"{text} (env: {', '.join(f'`{n}`' for n in names)})".strip()
    return _cell(text)


def command_reference(group: click.Command, prog: str = "waltz") -> str:
    """Markdown for ``group`` and every subcommand below it, depth first, sorted by name."""
    out: list[str] = []

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(command, info_name=path[-1], parent=parent)
        name = " ".join(path)
        out.append(f"{'#' * min(len(path) + 1, 4)} `{name}`\n")
        usage = " ".join(command.collect_usage_pieces(ctx))
        out.append(f"```\n{name} {usage}\n```\n")
        help_text = _help_text(command)
        if help_text:
            out.append(help_text + "\n")
        params = [
            p
            for p in command.get_params(ctx)
            if not getattr(p, "hidden", False) and "--help" not in getattr(p, "opts", ())
        ]
        if params:
            out.append("| parameter | type | default | meaning |")
            out.append("|---|---|---|---|")
            for param in params:
                out.append(
                    f"| {_param_names(param)} | {_cell(_param_type(param))} | "
                    f"{_param_default(param)} | {_param_help(param)} |"
                )
            out.append("")
        if isinstance(command, click.Group):
            for sub_name in sorted(command.commands):
                sub = command.commands[sub_name]
                if not getattr(sub, "hidden", False):
                    walk(sub, [*path, sub_name], ctx)

    walk(group, [prog], None)
    return "\n".join(out).rstrip("\n") + "\n"


def command_names(group: click.Command, prog: str = "waltz") -> list[str]:
    """Every command path below ``group`` (``waltz storage list``...), sorted."""
    names: list[str] = []

    def walk(command: click.Command, path: list[str]) -> None:
        names.append(" ".join(path))
        if isinstance(command, click.Group):
            for sub_name in sorted(command.commands):
                walk(command.commands[sub_name], [*path, sub_name])

    walk(group, [prog])
    return names


CLI_INTRO = """\
# `waltz` command reference

Generated from the click command tree by `python -m waltz_server.docs_gen`
(`packages/waltz-server/tests/test_docs.py` fails when it is stale). Every
command exits 0 on success, 1 with one `error: ...` line on stderr on any
error, and 2 on a usage error. `waltz -v` logs at INFO, `-vv` at DEBUG;
`--help` on any command prints its usage.

"""


def cli_markdown() -> str:
    from waltz_server.cli import main

    return CLI_INTRO + command_reference(main)


# -- files ----------------------------------------------------------------------------------


def generated_files(root: Path) -> dict[Path, str]:
    """Each generated file under ``root`` and the text it should have."""
    operators = root / "docs" / "operators.md"
    return {
        operators: fill_sections(operators.read_text(encoding="utf-8")),
        root / "docs" / "cli.md": cli_markdown(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m waltz_server.docs_gen", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root")
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stale = []
    for path, text in generated_files(args.root).items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            log.info("wrote %s", path)
    if args.check and stale:
        for path in stale:
            log.error("stale: %s (run python -m waltz_server.docs_gen)", path)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
