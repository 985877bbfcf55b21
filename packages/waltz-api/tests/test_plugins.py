"""The plugin manager: entry points, explicit registration, names, duplicates, URIs."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from waltz_api import capabilities, plugins
from waltz_api.errors import DuplicatePluginError, PluginError, UnknownPluginError
from waltz_api.hookspecs import (
    CommandDescriptor,
    OptionSchema,
    PluginDescriptor,
    PluginKind,
    StorageEngineDescriptor,
    TransportDescriptor,
    hookimpl,
)
from waltz_api.plugins import PluginRegistry, get_registry, reset_registry


class FakeTransport:
    def __init__(self, options: Any = None) -> None:
        self.options = options


class OtherTransport(FakeTransport):
    pass


def transport_plugin(
    name: str, factory: type = FakeTransport, schemes: tuple[str, ...] = ()
) -> Any:
    class Plugin:
        @hookimpl
        def waltz_transports(self) -> list[PluginDescriptor]:
            return [
                PluginDescriptor(
                    kind=PluginKind.TRANSPORT,
                    name=name,
                    factory=factory,
                    capabilities=frozenset({"peer_faults"}),
                    uri_schemes=schemes,
                )
            ]

    return Plugin()


@pytest.fixture
def empty() -> PluginRegistry:
    return PluginRegistry(autoload=False)


@pytest.fixture(autouse=True)
def _fresh_global_registry() -> Iterator[None]:
    reset_registry()
    yield
    reset_registry()


# -- explicit registration ----------------------------------------------------------


def test_explicitly_registered_plugin_is_found(empty: PluginRegistry) -> None:
    empty.register(transport_plugin("fake", schemes=("fake", "fakes")), name="fake-plugin")
    assert empty.names(PluginKind.TRANSPORT) == ["fake"]
    assert empty.names("transport") == ["fake"]
    descriptor = empty.get("transport", "fake")
    assert descriptor.factory is FakeTransport
    assert descriptor.capabilities == frozenset({"peer_faults"})
    assert empty.descriptors(PluginKind.TRANSPORT) == [descriptor]
    assert empty.names(PluginKind.STORAGE) == []


def test_a_module_can_be_a_plugin(empty: PluginRegistry) -> None:
    module = types.ModuleType("waltz_test_module_plugin")

    @hookimpl
    def waltz_lock_tables() -> list[PluginDescriptor]:
        return [PluginDescriptor(kind=PluginKind.LOCK_TABLE, name="mod", factory=dict)]

    module.waltz_lock_tables = waltz_lock_tables  # type: ignore[attr-defined]
    empty.register(module)
    assert empty.get(PluginKind.LOCK_TABLE, "mod").factory is dict


def test_registering_invalidates_the_index(empty: PluginRegistry) -> None:
    assert empty.names(PluginKind.TRANSPORT) == []
    empty.register(transport_plugin("late"))
    assert empty.names(PluginKind.TRANSPORT) == ["late"]


def test_registering_the_same_name_twice_is_refused(empty: PluginRegistry) -> None:
    empty.register(transport_plugin("a"), name="same")
    with pytest.raises(PluginError, match="cannot be registered"):
        empty.register(transport_plugin("b"), name="same")
    assert empty.names(PluginKind.TRANSPORT) == ["a"]


def test_a_plugin_with_an_unknown_hook_is_refused_and_left_out(empty: PluginRegistry) -> None:
    class Typo:
        @hookimpl
        def waltz_transport(self) -> list[PluginDescriptor]:  # missing "s"
            return []

    typo = Typo()
    with pytest.raises(PluginError, match=r"unknown hook.*waltz_transports"):
        empty.register(typo, name="typo")
    assert empty.manager.get_plugin("typo") is None
    empty.register(transport_plugin("fine"))
    assert empty.names(PluginKind.TRANSPORT) == ["fine"]


# -- names, unknown names, duplicates -------------------------------------------------


def test_unknown_name_lists_the_valid_choices(empty: PluginRegistry) -> None:
    empty.register(transport_plugin("zmq", schemes=("tcp",)), name="p1")
    empty.register(transport_plugin("memory", schemes=("memory",)), name="p2")
    with pytest.raises(UnknownPluginError, match=r"unknown transport plugin 'zmqq'") as info:
        empty.get(PluginKind.TRANSPORT, "zmqq")
    assert "valid choices: memory, zmq" in str(info.value)
    assert "URI schemes: memory, tcp" in str(info.value)


def test_unknown_name_with_nothing_installed(empty: PluginRegistry) -> None:
    with pytest.raises(UnknownPluginError, match=r"valid choices: \(none installed\)"):
        empty.get(PluginKind.STORAGE, "fs")


def test_unknown_kind_lists_the_valid_kinds(empty: PluginRegistry) -> None:
    with pytest.raises(PluginError, match="unknown plugin kind 'locks'; valid kinds: storage"):
        empty.names("locks")
    with pytest.raises(PluginError, match="unknown plugin kind"):
        empty.get("locks", "x")


def test_duplicate_names_are_reported(
    empty: PluginRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    empty.register(transport_plugin("zmq", FakeTransport), name="first")
    empty.register(transport_plugin("zmq", OtherTransport), name="second")
    empty.register(transport_plugin("other"), name="third")
    with caplog.at_level(logging.ERROR, logger="waltz_api.plugins"):
        assert empty.names(PluginKind.TRANSPORT) == ["other", "zmq"]
    assert "duplicate transport plugin name 'zmq'" in caplog.text
    with pytest.raises(DuplicatePluginError, match="'zmq' is offered by several plugins") as info:
        empty.get(PluginKind.TRANSPORT, "zmq")
    message = str(info.value)
    assert "'first'" in message
    assert "'second'" in message
    assert "OtherTransport" in message
    assert "uninstall one of them" in message
    # The other names still resolve.
    assert empty.get(PluginKind.TRANSPORT, "other").factory is FakeTransport


def test_a_duplicate_uri_scheme_is_reported(empty: PluginRegistry) -> None:
    empty.register(transport_plugin("a", schemes=("tcp",)), name="first")
    empty.register(transport_plugin("b", schemes=("tcp",)), name="second")
    with pytest.raises(DuplicatePluginError, match="URI scheme 'tcp'"):
        empty.resolve(PluginKind.TRANSPORT, "tcp://127.0.0.1:5000")


# -- URIs ------------------------------------------------------------------------------


def test_uri_scheme_selects_the_plugin(empty: PluginRegistry) -> None:
    empty.register(transport_plugin("zmq", schemes=("tcp", "ipc")), name="p")
    empty.register(transport_plugin("memory", OtherTransport, schemes=("memory",)), name="m")
    assert empty.resolve("transport", "tcp://127.0.0.1:5555").name == "zmq"
    assert empty.resolve("transport", "ipc:///tmp/waltz.sock").name == "zmq"
    assert empty.resolve("transport", "memory://node-1").factory is OtherTransport
    assert empty.resolve("transport", "zmq").name == "zmq", "a plain name is a name"
    assert empty.resolve("transport", "TCP://127.0.0.1:1").name == "zmq", "schemes ignore case"
    with pytest.raises(UnknownPluginError, match="unknown transport plugin 'udp'"):
        empty.resolve("transport", "udp://127.0.0.1:1")


# -- entry points ------------------------------------------------------------------------


def test_installed_plugins_are_listed_by_name() -> None:
    registry = PluginRegistry(autoload=True)
    names = registry.names(PluginKind.LOCK_TABLE)
    assert {"memory", "hwm-array", "exact"} <= set(names)
    assert "waltz_server_locktables" not in registry.load_errors
    assert registry.get(PluginKind.LOCK_TABLE, "hwm-array").factory.__name__ == "HwmArrayLockTable"
    assert registry.get(PluginKind.LOCK_TABLE, "memory").conformance_harness is not None


def test_the_global_registry_is_built_lazily_once() -> None:
    assert plugins._registry is None
    registry = get_registry()
    assert get_registry() is registry
    assert "hwm-array" in registry.names(PluginKind.LOCK_TABLE)
    reset_registry()
    assert get_registry() is not registry


def test_importing_waltz_api_loads_no_plugin() -> None:
    """The registry is lazy: importing the API imports no plugin module."""
    script = (
        "import sys, pkgutil, importlib, waltz_api\n"
        "for m in pkgutil.walk_packages(waltz_api.__path__, 'waltz_api.'):\n"
        "    importlib.import_module(m.name)\n"
        "from waltz_api import plugins\n"
        "assert plugins._registry is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('waltz_server', 'waltz_conf')))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_autoload_can_be_switched_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("WALTZ_DISABLE_PLUGIN_AUTOLOAD", value)
    called: list[str] = []
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda **kwargs: called.append("entry_points") or [],
    )
    registry = get_registry()
    assert called == []
    for kind in PluginKind:
        assert registry.names(kind) == []
    with pytest.raises(UnknownPluginError, match=r"\(none installed\)"):
        registry.get(PluginKind.LOCK_TABLE, "hwm-array")
    registry.register(transport_plugin("explicit"))
    assert registry.names(PluginKind.TRANSPORT) == ["explicit"]


def test_autoload_stays_on_for_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALTZ_DISABLE_PLUGIN_AUTOLOAD", "0")
    assert "hwm-array" in get_registry().names(PluginKind.LOCK_TABLE)


def fake_entry_points(*entries: tuple[str, str]) -> Any:
    eps = [
        importlib.metadata.EntryPoint(name=name, value=value, group="waltz")
        for name, value in entries
    ]

    def entry_points(**kwargs: Any) -> list[importlib.metadata.EntryPoint]:
        assert kwargs == {"group": "waltz"}
        return eps

    return entry_points


def test_a_plugin_that_fails_to_import_is_skipped_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        fake_entry_points(
            ("broken", "waltz_no_such_module_for_tests.plugin"),
            ("locktables", "waltz_server.locktables.plugin"),
        ),
    )
    with caplog.at_level(logging.WARNING, logger="waltz_api.plugins"):
        registry = PluginRegistry()
    assert "skipping Waltz plugin 'broken'" in caplog.text
    assert "ModuleNotFoundError" in caplog.text
    assert isinstance(registry.load_errors["broken"], ModuleNotFoundError)
    # The healthy plugin still loaded.
    assert registry.names(PluginKind.LOCK_TABLE) == ["exact", "hwm-array"]
    # Asking for the broken one says why it is missing.
    with pytest.raises(UnknownPluginError, match="plugin 'broken' failed to load"):
        registry.get(PluginKind.LOCK_TABLE, "broken")


def test_a_plugin_raising_at_import_is_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = types.ModuleType("waltz_test_raising_plugin")
    monkeypatch.setitem(sys.modules, "waltz_test_raising_plugin", module)
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        fake_entry_points(("raising", "waltz_test_raising_plugin:missing_attribute")),
    )
    with caplog.at_level(logging.WARNING, logger="waltz_api.plugins"):
        registry = PluginRegistry()
    assert isinstance(registry.load_errors["raising"], AttributeError)
    assert "skipping Waltz plugin 'raising'" in caplog.text


def test_an_entry_point_listed_twice_loads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        fake_entry_points(
            ("locktables", "waltz_server.locktables.plugin"),
            ("locktables", "waltz_server.locktables.plugin"),
        ),
    )
    registry = PluginRegistry()
    assert registry.names(PluginKind.LOCK_TABLE) == ["exact", "hwm-array"]
    assert registry.load_errors == {}


def test_an_entry_point_with_an_unknown_hook_is_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = types.ModuleType("waltz_test_typo_plugin")

    @hookimpl
    def waltz_lock_table() -> list[PluginDescriptor]:  # missing "s"
        return []

    module.waltz_lock_table = waltz_lock_table  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "waltz_test_typo_plugin", module)
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        fake_entry_points(
            ("typo", "waltz_test_typo_plugin"),
            ("locktables", "waltz_server.locktables.plugin"),
        ),
    )
    with caplog.at_level(logging.WARNING, logger="waltz_api.plugins"):
        registry = PluginRegistry()
    assert isinstance(registry.load_errors["typo"], PluginError)
    assert "skipping Waltz plugin 'typo'" in caplog.text
    assert registry.names(PluginKind.LOCK_TABLE) == ["exact", "hwm-array"]


def test_a_hook_that_raises_skips_only_that_plugin(
    empty: PluginRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    class Failing:
        @hookimpl
        def waltz_transports(self) -> list[PluginDescriptor]:
            raise ImportError("optional dependency pyzmq is not installed")

    empty.register(Failing(), name="failing")
    empty.register(transport_plugin("fine"), name="fine")
    with caplog.at_level(logging.WARNING, logger="waltz_api.plugins"):
        assert empty.names(PluginKind.TRANSPORT) == ["fine"]
    assert "pyzmq is not installed" in caplog.text
    assert isinstance(empty.load_errors["failing"], ImportError)


@pytest.mark.parametrize(
    "returned",
    [
        [PluginDescriptor(kind=PluginKind.STORAGE, name="wrong-kind", factory=dict)],
        ["not a descriptor"],
    ],
)
def test_a_hook_returning_a_bad_value_is_skipped(empty: PluginRegistry, returned: Any) -> None:
    class Bad:
        @hookimpl
        def waltz_transports(self) -> Any:
            return returned

    empty.register(Bad(), name="bad")
    empty.register(transport_plugin("fine"), name="fine")
    assert empty.names(PluginKind.TRANSPORT) == ["fine"]
    assert "must return a list of PluginDescriptor(kind=PluginKind.TRANSPORT" in str(
        empty.load_errors["bad"]
    )


def test_an_unknown_capability_is_an_error_naming_the_valid_ones() -> None:
    with pytest.raises(PluginError, match=r"unknown capability 'bounded-memory'.*bounded_memory"):
        PluginDescriptor(
            kind=PluginKind.LOCK_TABLE,
            name="mine",
            factory=dict,
            capabilities=frozenset({"bounded-memory"}),
        )
    with pytest.raises(PluginError, match="unknown capability 'reopen'"):
        PluginDescriptor(
            kind=PluginKind.TRANSPORT, name="t", factory=dict, capabilities=frozenset({"reopen"})
        )


def test_every_builtin_plugin_declares_known_capabilities_only() -> None:
    registry = get_registry()
    for kind in PluginKind:
        for descriptor in registry.descriptors(kind):
            assert descriptor.capabilities <= capabilities.BY_KIND[kind], descriptor.name
    assert registry.names(PluginKind.LOCK_TABLE)  # the built-ins did load


# -- lazy implementations ------------------------------------------------------------------


def lazy_transport_plugin(name: str, load: Any) -> Any:
    class Plugin:
        @hookimpl
        def waltz_transports(self) -> list[PluginDescriptor]:
            return [TransportDescriptor(name=name, load=load, uri_schemes=(name,))]

    return Plugin()


def test_a_load_function_runs_once_when_the_factory_is_first_read(
    empty: PluginRegistry,
) -> None:
    calls: list[str] = []

    def load() -> Any:
        calls.append("load")
        return FakeTransport

    empty.register(lazy_transport_plugin("lazy", load), name="lazy-plugin")
    empty.register(transport_plugin("lazy", OtherTransport), name="twin")
    empty.register(lazy_transport_plugin("other", load), name="other-plugin")
    # names, descriptors, URI schemes and a duplicate's report: nothing is loaded
    assert empty.names(PluginKind.TRANSPORT) == ["lazy", "other"]
    assert [d.name for d in empty.descriptors(PluginKind.TRANSPORT)] == ["lazy", "other"]
    with pytest.raises(DuplicatePluginError, match=r"test_plugins\.test_a_load_function"):
        empty.get(PluginKind.TRANSPORT, "lazy")
    descriptor = empty.resolve(PluginKind.TRANSPORT, "other://somewhere")
    assert calls == [] and not descriptor.loaded
    assert "load" in descriptor.origin
    assert descriptor.factory is FakeTransport
    assert descriptor.factory is FakeTransport
    assert calls == ["load"] and descriptor.loaded


def test_a_failing_load_is_a_plugin_error_naming_the_plugin(empty: PluginRegistry) -> None:
    def load() -> Any:
        raise ModuleNotFoundError("No module named 'pyzmq_for_tests'")

    empty.register(lazy_transport_plugin("broken", load), name="broken-plugin")
    descriptor = empty.get(PluginKind.TRANSPORT, "broken")  # listed: its module imported
    with pytest.raises(PluginError, match=r"transport plugin 'broken' failed to load") as info:
        _ = descriptor.factory
    assert "pyzmq_for_tests" in str(info.value)
    assert "install what it needs" in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_a_descriptor_takes_a_factory_or_a_load_function_and_is_immutable() -> None:
    with pytest.raises(PluginError, match="exactly one"):
        PluginDescriptor(PluginKind.TRANSPORT, "neither")
    with pytest.raises(PluginError, match="exactly one"):
        TransportDescriptor("both", FakeTransport, load=lambda: FakeTransport)
    with pytest.raises(PluginError, match="needs a name"):
        TransportDescriptor("", FakeTransport)
    descriptor = StorageEngineDescriptor("s", load=lambda: dict)  # type: ignore[arg-type,return-value]
    assert descriptor.kind is PluginKind.STORAGE
    with pytest.raises(AttributeError, match="immutable"):
        descriptor.name = "other"  # type: ignore[misc]
    assert isinstance(descriptor, PluginDescriptor)


def test_reading_every_installed_descriptor_imports_no_implementation() -> None:
    """Every process reads every installed plugin's descriptors (`waltz --help`, a client
    starting): only the plugin modules are imported, no implementation and none of
    their dependencies (issue 16: aiohttp alone was 13% of a short client's samples),
    not even click for the commands they contribute."""
    script = (
        "import sys\n"
        "from waltz_api.plugins import get_registry\n"
        "from waltz_api.hookspecs import PluginKind\n"
        "registry = get_registry()\n"
        "found = {k: registry.names(k) for k in PluginKind}\n"
        "assert 'zmq' in found['transport'] and 'fs' in found['storage'], found\n"
        "assert not registry.load_errors, registry.load_errors\n"
        "registry.commands(), registry.option_schemas()\n"
        "heavy = ('aiohttp', 'kazoo', 'zmq', 'pytest', 'hypothesis', 'sqlite3', 'click',\n"
        "         'rich', 'prometheus_client', 'pyarrow', 'pyspark',\n"
        "         'waltz_api.wire', 'waltz_api.contracts', 'waltz_storage_fs.engine',\n"
        "         'waltz_transport_zmq.transport', 'waltz_server.locktables.hwm_array',\n"
        "         'waltz_coord_zk.coordination', 'waltz_coord_etcd.coordination',\n"
        "         'waltz_coord_local.coordination', 'waltz_conformance.harness')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(heavy))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


# -- commands and option tables ------------------------------------------------------------


def command_plugin(*paths: str) -> Any:
    class Plugin:
        @hookimpl
        def waltz_cli_commands(self) -> list[CommandDescriptor]:
            return [
                CommandDescriptor(
                    path.split()[-1], dict, f"help of {path}", group=" ".join(path.split()[:-1])
                )
                for path in paths
            ]

        @hookimpl
        def waltz_option_schemas(self) -> list[OptionSchema]:
            return [OptionSchema(f"{paths[0].replace(' ', '-')}-options", lambda: [])]

    return Plugin()


def test_commands_and_option_tables_are_collected_from_every_plugin(
    empty: PluginRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    empty.register(command_plugin("hello", "storage verify"), name="a")
    empty.register(command_plugin("hello", "bye"), name="b")
    with caplog.at_level(logging.ERROR, logger="waltz_api.plugins"):
        paths = [(c.path, c.short_help) for c in empty.commands()]
        schemas = [s.name for s in empty.option_schemas()]
    assert paths == [
        ("hello", "help of hello"),
        ("storage verify", "help of storage verify"),
        ("bye", "help of bye"),
    ]
    assert "CommandDescriptor 'hello' is offered by plugins 'a' and 'b'" in caplog.text
    assert "OptionSchema 'hello-options' is offered by plugins 'a' and 'b'" in caplog.text
    assert schemas == ["hello-options"]


def test_a_plugin_whose_command_hook_fails_is_skipped(empty: PluginRegistry) -> None:
    class Failing:
        @hookimpl
        def waltz_cli_commands(self) -> list[CommandDescriptor]:
            raise ImportError("click is not installed")

    class Bad:
        @hookimpl
        def waltz_cli_commands(self) -> Any:
            return ["not a descriptor"]

    empty.register(Failing(), name="failing")
    empty.register(Bad(), name="bad")
    empty.register(command_plugin("fine"), name="fine")
    assert [c.path for c in empty.commands()] == ["fine"]
    assert isinstance(empty.load_errors["failing"], ImportError)
    assert "must return a list of CommandDescriptor" in str(empty.load_errors["bad"])


def test_a_command_is_a_single_word_in_a_single_word_group() -> None:
    with pytest.raises(PluginError, match="single words"):
        CommandDescriptor("two words", dict, "x")  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="single words"):
        CommandDescriptor("x", dict, "x", group="a b")  # type: ignore[arg-type]
