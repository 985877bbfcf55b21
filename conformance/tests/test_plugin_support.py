"""Plugin test support: capability names are checked (a misspelt requirement or
declaration is an error, never a test that skips forever), and every plugin names its
harness in its ``conformance`` module."""

from __future__ import annotations

import importlib

import pytest

from waltz_api.capabilities import BY_KIND, RECOVERY_CASES
from waltz_api.errors import PluginError
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_conformance.harness import Harness, requires


def test_a_misspelt_requirement_is_an_error_when_the_suite_is_defined() -> None:
    with pytest.raises(PluginError, match=r"unknown capability .recovery-cases.*recovery_cases"):
        requires("recovery-cases")
    assert requires(RECOVERY_CASES) is not None


def test_a_harness_declaring_an_unknown_capability_is_an_error() -> None:
    with pytest.raises(PluginError, match="'durable' declared by the harness 'mine'"):
        Harness(name="mine", capabilities=frozenset({"durable", "reopen"}))
    assert Harness(name="mine", capabilities=frozenset({"reopen"})).capabilities == {"reopen"}


def test_every_requirement_of_the_suites_is_a_known_capability() -> None:
    """Importing every suite checks its requirements (requires raises at definition)."""
    import waltz_conformance.suites.coordination
    import waltz_conformance.suites.locktable
    import waltz_conformance.suites.storage
    import waltz_conformance.suites.system
    import waltz_conformance.suites.transport  # noqa: F401

    assert set(BY_KIND) == {"storage", "coordination", "transport", "lock_table", "system"}


@pytest.mark.parametrize("kind", list(PluginKind), ids=str)
def test_every_installed_plugin_names_its_harness_in_its_conformance_module(
    kind: PluginKind,
) -> None:
    """The convention: a plugin package ships ``<package>/conformance.py`` with its
    harness and names it in its descriptor; every one of them resolves."""
    descriptors = get_registry().descriptors(kind)
    assert descriptors, f"no {kind} plugin installed"
    for descriptor in descriptors:
        assert descriptor.conformance_harness, f"{descriptor.name} ships no harness"
        module_name, _, attribute = descriptor.conformance_harness.partition(":")
        assert module_name.rsplit(".", 1)[-1] == "conformance", descriptor.conformance_harness
        assert callable(getattr(importlib.import_module(module_name), attribute))
