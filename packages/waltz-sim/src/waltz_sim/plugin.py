"""The ``sim`` plugins: transport, coordination and storage engine of the simulated world.

Registered by the simulation itself when a run starts (never through an entry
point): they work only inside a simulated process, so they are not offered to users.
"""

from __future__ import annotations

from types import SimpleNamespace

from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl


@hookimpl
def waltz_transports() -> list[PluginDescriptor]:
    from waltz_sim.net import create_sim_transport

    return [
        PluginDescriptor(
            kind=PluginKind.TRANSPORT,
            name="sim",
            factory=create_sim_transport,
            description="the simulated network of `waltz simulate` (sim://NAME)",
        )
    ]


@hookimpl
def waltz_coordinators() -> list[PluginDescriptor]:
    from waltz_sim.coord import sim_coordination_factory

    return [
        PluginDescriptor(
            kind=PluginKind.COORDINATION,
            name="sim",
            factory=sim_coordination_factory,
            description="the simulated coordination service of `waltz simulate`",
            uri_schemes=("sim",),
        )
    ]


@hookimpl
def waltz_storage_engines() -> list[PluginDescriptor]:
    from waltz_sim.disk import SimStorageEngine
    from waltz_sim.fsdisk import FS_CAPABILITIES, SimFsEngine

    return [
        PluginDescriptor(
            kind=PluginKind.STORAGE,
            name="sim",
            factory=SimStorageEngine,
            description="the simulated disks of `waltz simulate`",
        ),
        PluginDescriptor(
            kind=PluginKind.STORAGE,
            name="sim-fs",
            factory=SimFsEngine,
            capabilities=FS_CAPABILITIES,
            description="the real fs engine on the simulated disks (`--storage-engine fs`)",
        ),
    ]


PLUGINS = SimpleNamespace(
    waltz_transports=waltz_transports,
    waltz_coordinators=waltz_coordinators,
    waltz_storage_engines=waltz_storage_engines,
)
"""The three hooks as one plugin object (``World`` registers it when a run starts)."""
