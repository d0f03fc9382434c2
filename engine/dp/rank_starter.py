"""Who starts a DP engine's ranks: the one thing the two DP backends do differently.

The launcher (startup) and the scaler (a scale up, a restart) ask a `RankStarter` for
ranks and get back, per rank, a started process, or a stand-in with the same surface
(`sentinel`, `is_alive`, `exitcode`, `join`, `terminate`, `kill`, `pid`); everything
after that (the handshake, the watcher, the reaping, losses and shrinks) is the same
for both. `LocalRanks` spawns processes on this machine (`dp_backend="mp"`);
`ray_launcher.RayRanks` starts Ray actors anywhere in a cluster (`dp_backend="ray"`).
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Mapping
from multiprocessing.process import BaseProcess
from typing import Protocol, runtime_checkable

from wavecore.channels import ChannelKey
from wavecore.engine.config import EngineConfig
from wavecore.engine.dp.capacity import DPCapacity, dp_capacity
from wavecore.engine.dp.rank_process import BuildCore, rank_main


class RankStarter(Protocol):
    @property
    def host(self) -> str:
        """The address the front end's sockets listen on: one every rank can reach."""
        ...

    async def start(
        self,
        handshake_address: str,
        configs: Mapping[int, EngineConfig],
        build_core: BuildCore,
        channel_key: ChannelKey,
    ) -> dict[int, BaseProcess]:
        """Start these ranks (each with its configuration, all with the engine's channel
        key) dialing the handshake at `handshake_address`; their processes (or stand-ins), started, by rank. Raises
        `DPStartupError` when they cannot be started (nothing of them is left then)."""
        ...

    def capacity(self, config: EngineConfig) -> DPCapacity:
        """The most ranks the engine may have (blocking: run it in a worker thread)."""
        ...


@runtime_checkable
class RunsElsewhere(Protocol):
    """A stand-in for a rank process on a node of a cluster, which it names."""

    @property
    def node(self) -> str: ...


def node_of(process: BaseProcess | None) -> str:
    """Where a rank runs: its node, "<hostname> (local)" for a process spawned here,
    "headless" for a rank started elsewhere by hand (`wavecore rank`)."""
    if process is None:
        return "headless"
    if isinstance(process, RunsElsewhere):
        return process.node
    return f"{socket.gethostname()} (local)"


class LocalRanks:
    """Rank processes spawned on this machine (`launcher` says why spawn, never fork)."""

    host = "127.0.0.1"

    async def start(
        self,
        handshake_address: str,
        configs: Mapping[int, EngineConfig],
        build_core: BuildCore,
        channel_key: ChannelKey,
    ) -> dict[int, BaseProcess]:
        context = multiprocessing.get_context("spawn")
        processes: dict[int, BaseProcess] = {}
        for rank, config in configs.items():
            processes[rank] = context.Process(
                target=rank_main,
                args=(handshake_address, rank, config, build_core, channel_key),
                name=f"wavecore-dp-rank{rank}",
                daemon=True,
            )
        for process in processes.values():
            process.start()
        return processes

    def capacity(self, config: EngineConfig) -> DPCapacity:
        return dp_capacity(config)
