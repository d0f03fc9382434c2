"""Ranks as Ray actors (`dp_backend="ray"`), placed anywhere in a Ray cluster.

Theory of operation:

1. `open_ray_ranks(config)` connects this process to the cluster (`ray_address`; a
   connection this process made already is used as it is, one made here is closed at
   the end) and yields the `RayRanks` starter (`rank_starter`). The front end's
   sockets, the coordinator's and the lockstep store listen on this node's address as
   Ray reports it, over tcp: the ranks reach them as a headless rank (`wavecore rank`)
   does. The front end, the coordinator, the scaler and the protocol do not change.
2. Each rank gets a placement group of its own with one bundle (`_bundle`: one CPU, or
   one GPU for a model on CUDA) and an actor in it (`RankActor`), owned by this process
   (not detached). Its `run` is `rank_process.run_rank`: the rank code a spawned rank
   runs, over the same channels, at its node's niceness (`_undo_worker_niceness`). Groups that cannot all be placed within
   `startup_timeout` are removed and the start fails, naming the ranks and what the
   cluster has free (a scale is then rolled back as any failed scale).
3. `RayRank` stands in for the rank's process. A thread waits for the actor's `run`:
   it returns the rank's exit code, or Ray raises its death notice (the actor was
   killed, its process died, its node is gone). Then the thread ends the actor (the
   rank skips the interpreter's teardown, `rank_process` rule 7), removes its placement
   group, and makes the stand-in's sentinel ready: the launcher's watcher, the reaping
   and the loss path see it as they see a spawned process, and `end_report` names the
   node and Ray's reason ("actor died on node 10.0.0.5 (Ray node 3f..): The actor is
   dead because it was killed by `ray.kill`."). The heartbeats cover what Ray is slow
   to notice (a node that vanishes is declared dead only after its health checks).
4. `capacity`: the ranks placed now plus the bundles the cluster's available
   resources hold (`max_dp_size`, when set, instead): a scale up to more is refused
   before anything starts.
5. Nothing outlives the engine: the block's end kills every actor left and removes
   every placement group; a driver killed outright leaves nothing either, since Ray
   ends the actors and placement groups of an owner that died (none is detached).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread

from wavecore.channels import ChannelKey
from wavecore.engine.config import EngineConfig
from wavecore.engine.dp.capacity import DPCapacity
from wavecore.engine.dp.exit_status import describe_exit
from wavecore.engine.dp.launcher import DPStartupError
from wavecore.engine.dp.process_state import is_stopped
from wavecore.engine.dp.rank_process import BuildCore, run_rank
from wavecore.engine.errors import BackendUnavailableError

logger = logging.getLogger("wavecore.engine.dp")

# How long the engine's end waits for the actors' watch threads once every actor was
# killed (Ray's notice of a kill takes milliseconds).
_END_GRACE_S = 10.0
# How long a capacity check waits for Ray's view of available resources to catch up.
_VIEW_SETTLE_S = 3.0
_VIEW_POLL_S = 0.05


def import_ray() -> Any:
    """The `ray` module, or the error that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise BackendUnavailableError(
            "EngineConfig.dp_backend='ray' needs Ray, which is not installed: "
            "pip install wavecore[ray]"
        ) from error
    return ray


class RankActor:
    """One rank in a Ray worker process (made a Ray actor class by `RayRanks`)."""

    def where(self) -> tuple[int, str, str]:
        """This worker's pid, node address and Ray node id."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return os.getpid(), ray.util.get_node_ip_address(), node_id

    def run(
        self,
        handshake_address: str,
        rank: int,
        config: EngineConfig,
        build_core: BuildCore,
        channel_key: ChannelKey,
    ) -> int:
        _undo_worker_niceness()
        # Judges its front end as a headless rank does: an owner that cannot reach it any
        # more (a partition) is no reason to serve on.
        return run_rank(
            handshake_address, rank, config, build_core, channel_key, judges_front_end=True
        )


def _undo_worker_niceness() -> None:
    """Ray starts its workers at niceness +15 (`worker_niceness`, for background tasks):
    a rank would lose the CPU to every other process of its node, the front end's and
    the coordinator's included (bench/dp.py measured Ray at 0.54x the local launcher's
    tokens/s on a busy 2-vCPU machine). The rank takes the raylet's niceness back, for
    this thread and the threads it starts (the model thread, gloo's); where it may not
    (not root), it says how to start the nodes instead."""
    try:
        wanted = os.getpriority(os.PRIO_PROCESS, os.getppid())
        if os.getpriority(os.PRIO_PROCESS, 0) > wanted:
            os.setpriority(os.PRIO_PROCESS, 0, wanted)
    except OSError:
        logger.warning(
            "this rank runs at Ray's worker niceness (+15): start the Ray nodes with "
            "RAY_worker_niceness=0 to give it the same share of the CPU as its node's "
            "other processes"
        )


class RayRank:
    """A rank actor standing in for a rank process (module docstring, rule 3)."""

    def __init__(
        self,
        ray: Any,
        *,
        name: str,
        actor: Any,
        group: Any,
        run: Any,
        where: tuple[int, str, str],
        local_ip: str,
    ) -> None:
        self._ray = ray
        self.actor = actor
        self._group = group
        self.pid, self.node_ip, self.node_id = where
        # The actor's name in Ray (its placement group's too).
        self.name = name
        self._local = self.node_ip == local_ip
        self.exitcode: int | None = None
        self._report = "still running"
        self._ended = threading.Event()
        # Ready (end of file) once the write end closes: a sentinel the watcher's
        # `multiprocessing.connection.wait` takes as it takes a process's.
        self.sentinel, self._ending = os.pipe()
        self._thread = threading.Thread(
            target=self._wait, args=(run,), name=f"{self.name}-watch", daemon=True
        )
        self._thread.start()

    @property
    def node(self) -> str:
        return f"{self.node_ip} (Ray node {self.node_id})"

    def _wait(self, run: Any) -> None:
        ray = self._ray
        try:
            self.exitcode = ray.get(run)
            self._report = f"{describe_exit(self.exitcode)} on node {self.node}"
        except ray.exceptions.RayActorError as error:
            self._report = f"actor died on node {self.node}: {_reason(error)}"
        except Exception as error:  # the rank's own code raised (a bug, not a death)
            self._report = f"actor failed on node {self.node}: {type(error).__name__}: {error}"
        finally:
            self._end_actor()
            self._ended.set()
            os.close(self._ending)

    def _end_actor(self) -> None:
        """Kill the actor and remove its placement group (both idempotent)."""
        with contextlib.suppress(Exception):  # Ray gone already: so is the actor
            self._ray.kill(self.actor, no_restart=True)
        with contextlib.suppress(Exception):
            self._ray.util.remove_placement_group(self._group)

    def end_report(self) -> str:
        return self._report

    def is_stopped(self) -> bool:
        """A stopped actor's process can be seen only from its own machine."""
        return self._local and is_stopped(self.pid)

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def terminate(self) -> None:
        self._end_actor()

    def kill(self) -> None:
        self._end_actor()

    def close(self) -> None:
        """Release the sentinel (once the rank ended and nothing waits on it)."""
        with contextlib.suppress(OSError):
            os.close(self.sentinel)


class RayRanks:
    """The `RankStarter` of `dp_backend="ray"`; see the module docstring."""

    def __init__(self, ray: Any, config: EngineConfig) -> None:
        self._ray = ray
        self._actor_class = ray.remote(RankActor)
        self.host: str = ray.util.get_node_ip_address()
        self._bundle = _bundle(config, ray.cluster_resources())
        self._ranks: list[RayRank] = []
        self._groups: list[Any] = []

    async def start(
        self,
        handshake_address: str,
        configs: Mapping[int, EngineConfig],
        build_core: BuildCore,
        channel_key: ChannelKey,
    ) -> dict[int, Any]:
        # Blocking Ray calls, bounded by the startup timeout; never abandoned, so that
        # what a failure leaves is always removed.
        return await anyio.to_thread.run_sync(
            self._start, handshake_address, configs, build_core, channel_key
        )

    def _start(
        self,
        handshake_address: str,
        configs: Mapping[int, EngineConfig],
        build_core: BuildCore,
        channel_key: ChannelKey,
    ) -> dict[int, Any]:
        if not configs:
            return {}  # every rank joins by hand (`wavecore rank`)
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        timeout = max(config.startup_timeout for config in configs.values())
        tag = uuid.uuid4().hex[:8]
        names = {rank: f"wavecore-rank{rank}-{tag}" for rank in configs}
        groups = {rank: placement_group([self._bundle], name=names[rank]) for rank in configs}
        self._groups.extend(groups.values())
        _, unplaced = ray.wait(
            [group.ready() for group in groups.values()],
            num_returns=len(groups),
            timeout=timeout,
        )
        if unplaced:
            free = _describe(ray.available_resources())
            self._remove(groups.values(), ())
            raise DPStartupError(
                f"ranks {sorted(configs)} could not be placed in the Ray cluster within "
                f"{timeout:g} s (each needs {_describe(self._bundle)}; free: {free})"
            )
        actors = {
            rank: self._actor_class.options(
                name=names[rank],  # its placement group's: both show in Ray's listings
                num_cpus=self._bundle.get("CPU", 0),
                num_gpus=self._bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=0
                ),
            ).remote()
            for rank, group in groups.items()
        }
        try:
            wheres = ray.get([actor.where.remote() for actor in actors.values()], timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            self._remove(groups.values(), actors.values())
            raise DPStartupError(
                f"the actors of ranks {sorted(configs)} did not start: {_reason(error)}"
            ) from None
        started = {}
        for (rank, actor), where in zip(actors.items(), wheres, strict=True):
            run = actor.run.remote(handshake_address, rank, configs[rank], build_core, channel_key)
            started[rank] = RayRank(
                ray,
                name=names[rank],
                actor=actor,
                group=groups[rank],
                run=run,
                where=where,
                local_ip=self.host,
            )
        self._ranks.extend(started.values())
        return started

    def _remove(self, groups: Any, actors: Any) -> None:
        for actor in actors:
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)
        for group in groups:
            with contextlib.suppress(Exception):
                self._ray.util.remove_placement_group(group)

    def capacity(self, config: EngineConfig) -> DPCapacity:
        if config.max_dp_size is not None:
            return DPCapacity(max_dp_size=config.max_dp_size, reason="EngineConfig.max_dp_size")
        placed = sum(rank.is_alive() for rank in self._ranks)
        room, available = self._room()
        return DPCapacity(
            max_dp_size=placed + room,
            reason=f"{placed} placed and room for {room} more in the Ray cluster, each "
            f"{_describe(self._bundle)} (free: {_describe(available)})",
        )

    def _room(self) -> tuple[int, dict[str, float]]:
        """How many more bundles the cluster's available resources hold, and those
        resources. Ray's view of them lags a placement group's removal (by a report
        interval, moments): while it shows less room than the cluster's resources less
        what live placement groups hold, it is read again, for `_VIEW_SETTLE_S` at most
        (the whole time where tasks outside placement groups hold resources too)."""
        ray = self._ray
        settle_by = time.monotonic() + _VIEW_SETTLE_S
        while True:
            available = ray.available_resources()
            room = self._bundles_in(available)
            if room >= self._bundles_in(self._unreserved()) or time.monotonic() > settle_by:
                return room, available
            time.sleep(_VIEW_POLL_S)

    def _unreserved(self) -> dict[str, float]:
        """The cluster's resources less what its live placement groups reserve."""
        left = dict(self._ray.cluster_resources())
        for group in self._ray.util.placement_group_table().values():
            if group["state"] == "REMOVED":
                continue
            for bundle in group["bundles"].values():
                for name, amount in bundle.items():
                    left[name] = left.get(name, 0.0) - amount
        return left

    def _bundles_in(self, resources: Mapping[str, float]) -> int:
        return max(
            0,
            min(
                math.floor(resources.get(name, 0.0) / amount)
                for name, amount in self._bundle.items()
            ),
        )

    async def close(self) -> None:
        """Kill every actor left and remove every placement group (rule 5)."""

        def end_all() -> None:
            self._remove(self._groups, [rank.actor for rank in self._ranks])
            for rank in self._ranks:
                rank.join(_END_GRACE_S)
                rank.close()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(end_all)


def _bundle(config: EngineConfig, cluster: Mapping[str, float]) -> dict[str, float]:
    """What one rank reserves: a GPU where its model runs on CUDA (asked for, or "auto"
    on a cluster that has GPUs), else a CPU."""
    on_gpu = config.executor == "model" and (
        config.device == "cuda" or (config.device == "auto" and cluster.get("GPU", 0) > 0)
    )
    return {"GPU": 1.0} if on_gpu else {"CPU": 1.0}


def _describe(resources: Mapping[str, float]) -> str:
    shown = {name: amount for name, amount in resources.items() if name in ("CPU", "GPU")}
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(shown.items())) or "nothing"


def _reason(error: BaseException) -> str:
    """Ray's own words for an actor's end, without its boilerplate and id lines."""
    lines = [line.strip() for line in str(error).splitlines()]
    said = [
        line
        for line in lines
        if line
        and not line.startswith(("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:"))
        and line != "The actor died unexpectedly before finishing this task."
    ]
    return " ".join(said) or (lines[0] if lines else type(error).__name__)


@asynccontextmanager
async def open_ray_ranks(config: EngineConfig) -> AsyncIterator[RayRanks]:
    """The Ray starter for the block's lifetime (module docstring, rules 1 and 5)."""
    ray = import_ray()
    connected_here = not ray.is_initialized()
    if connected_here:
        await anyio.to_thread.run_sync(
            lambda: ray.init(address=config.ray_address, include_dashboard=False)
        )
    try:
        ranks = RayRanks(ray, config)
        try:
            yield ranks
        finally:
            await ranks.close()
    finally:
        if connected_here:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ray.shutdown)
