"""DP ranks as Ray actors (issue 31, `dp_backend="ray"`): one local Ray cluster for the
module (nodes "a", "b", "c" and the head, "d", with one CPU each, so every rank's
placement is observable by its node's own resource; placement groups of "other jobs"
hold "c" until a scale up needs it and "d" until the second engine does), the null
executor. One engine walks through placement, a refused scale, a scale up under load, a
killed actor replaced where the room is, a lost node with no room for a replacement,
and a scale down under load; a second one, with "fail", dies naming a killed actor and
leaves nothing behind; a driver killed with SIGKILL leaves nothing either. (A scale
whose placement times out is rolled back: test_dp_ray_soak.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import pytest
from dp_helpers import (
    HANG_GUARD,
    SteadyLoad,
    check_rank_1_lost,
    client_of,
    collect,
    expected_tokens,
    load_then,
    null_config,
    tokens_of,
    wiring_of,
)

from wavecore.engine.api import Engine, open_dp_engine
from wavecore.engine.errors import EngineDeadError, ScalingRefusedError
from wavecore.engine.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.anyio

NODE_RESOURCES = ("a", "b", "c", "d")
QUICK = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}


def ray_config(**overrides: Any) -> Any:
    return null_config(transport="tcp", dp_backend="ray", **QUICK, **overrides)


def _node_args(resource: str) -> dict[str, Any]:
    return {"num_cpus": 1, "resources": {resource: 1}, "object_store_memory": 100 * 2**20}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Small and quiet: no dashboard, 100 MB object stores, CPUs given explicitly."""
    head = {**_node_args("d"), "include_dashboard": False}
    local = Cluster(initialize_head=True, head_node_args=head)
    try:
        for resource in NODE_RESOURCES[:3]:
            local.add_node(**_node_args(resource))
        ray.init(address=local.address, logging_level="WARNING", log_to_driver=False)
        local.wait_for_nodes()
        yield local
    finally:
        ray.shutdown()
        local.shutdown()


@pytest.fixture(scope="module")
def other_jobs(cluster: Cluster) -> dict[str, Any]:
    """Placement groups holding nodes "c" and "d", as other jobs' would."""
    groups = {
        node: ray.util.placement_group([{"CPU": 1, node: 1}], name=f"another job on {node}")
        for node in ("c", "d")
    }
    ray.get([group.ready() for group in groups.values()], timeout=HANG_GUARD)
    return groups


def node_resource(node: str) -> str:
    """Which of the test's nodes `RankStats.node` names ("<ip> (Ray node <id>)")."""
    for entry in ray.nodes():
        if entry["Alive"] and entry["NodeID"] in node:
            return next(name for name in NODE_RESOURCES if name in entry["Resources"])
    raise AssertionError(f"no live node in {node!r}")


async def nodes_of(engine: Engine) -> list[str]:
    return [node_resource(rank.node) for rank in (await engine.stats()).ranks]


def live_groups() -> list[str]:
    """The engines' placement groups not removed."""
    table = ray.util.placement_group_table().values()
    return sorted(
        group["name"]
        for group in table
        if group["state"] != "REMOVED" and group["name"].startswith("wavecore-")
    )


def actor_gone(actor: Any) -> bool:
    try:
        ray.get(actor.where.remote(), timeout=HANG_GUARD)
    except ray.exceptions.RayActorError:
        return True
    return False


@pytest.fixture(scope="module")
async def engine(other_jobs: dict[str, Any]) -> AsyncIterator[Engine]:
    config = ray_config(on_rank_failure="shrink", restart_ranks=True)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as opened:
            yield opened


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return int(next(line for line in status if line.startswith("PPid:")).split()[1])


async def test_ranks_start_as_actors_on_two_nodes_and_serve_exactly(engine: Engine) -> None:
    """Placed one per node; each at its raylet's niceness, not Ray's +15 for workers."""
    assert sorted(await nodes_of(engine)) == ["a", "b"]
    assert len(live_groups()) == 2
    for rank in (0, 1):
        pid = wiring_of(engine).processes[f"rank {rank}"].pid
        raylet = os.getpriority(os.PRIO_PROCESS, _parent_of(pid))
        assert os.getpriority(os.PRIO_PROCESS, pid) == raylet
    for rank in (0, 1):
        prompt = f"on ray {rank}"
        deltas = await collect(engine, prompt, SamplingParams(max_tokens=16), dp_rank=rank)
        assert tokens_of(deltas) == expected_tokens(prompt, 16)


async def test_a_scale_the_cluster_cannot_hold_is_refused_with_nothing_changed(
    engine: Engine,
) -> None:
    groups = live_groups()
    with pytest.raises(ScalingRefusedError, match=r"room for 0 more in the Ray cluster"):
        await engine.scale(3)
    assert engine.dp_size == 2
    assert live_groups() == groups
    deltas = await collect(engine, "still two", SamplingParams(max_tokens=8))
    assert tokens_of(deltas) == expected_tokens("still two", 8)


async def test_a_scale_up_places_the_new_rank_where_the_cluster_has_room_under_load(
    other_jobs: dict[str, Any], engine: Engine
) -> None:
    ray.util.remove_placement_group(other_jobs["c"])  # node "c" has room now
    with anyio.fail_after(HANG_GUARD):
        load = SteadyLoad(engine)
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run)
            await load.wait_for(4)
            await engine.scale(3)
            await load.wait_for(8)
            load.stop.set()
    assert load.started == len(load.finished)  # each one checked exact by the load
    assert engine.dp_size == 3
    assert (await nodes_of(engine))[2] == "c"


async def test_a_killed_actor_is_lost_and_replaced_on_the_node_with_room(
    engine: Engine,
) -> None:
    """Shrink: rank 1's requests end as with a local rank's loss (the cause names the
    node and Ray's reason); the survivors serve on; the restart places the replacement
    on the one node with a free CPU, the killed actor's."""
    client = client_of(engine)
    killed = wiring_of(engine).processes["rank 1"]
    node = node_resource(killed.node)
    restarted = client.restarted
    with anyio.fail_after(HANG_GUARD):
        deltas = await load_then(engine, range(3), lambda: ray.kill(killed.actor))
        check_rank_1_lost(deltas, "rank 1 lost (rank 1 died (actor died on node ")
        error = next(stream[-1].error for stream in deltas.values() if stream[-1].error)
        assert "killed by `ray.kill`" in error
        await restarted.wait()
    assert client.restarts[-1] == "restarted to 3 ranks"
    assert engine.dp_size == 3
    assert (await nodes_of(engine))[2] == node
    assert actor_gone(killed.actor)
    for rank in range(3):
        prompt = f"after the restart {rank}"
        deltas_after = await collect(engine, prompt, SamplingParams(max_tokens=8), dp_rank=rank)
        assert tokens_of(deltas_after) == expected_tokens(prompt, 8)


async def test_a_lost_node_loses_its_rank_and_no_restart_happens_without_room(
    cluster: Cluster, engine: Engine
) -> None:
    """Rank 2's node leaves the cluster: Ray's notice names it; the replacement finds no
    room (the two nodes left each hold a rank), and the engine serves on at 2."""
    client = client_of(engine)
    lost = wiring_of(engine).processes["rank 2"]
    node = next(node for node in cluster.list_all_nodes() if node.node_id == lost.node_id)
    restarted = client.restarted
    with anyio.fail_after(HANG_GUARD):
        stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=2)
        await stream.__anext__()
        await anyio.to_thread.run_sync(cluster.remove_node, node)
        deltas = [delta async for delta in stream]
        await restarted.wait()
    error = deltas[-1].error or ""
    assert deltas[-1].finish_reason == "error"
    assert error.startswith("rank 2 lost (rank 2 died (actor died on node ")
    assert "The actor died because its node has died" in error
    assert client.restarts[-1].startswith("no restart to 3 ranks: ")
    assert "room for 0 more in the Ray cluster" in client.restarts[-1]
    assert engine.dp_size == 2
    for rank in (0, 1):
        prompt = f"after the node {rank}"
        deltas_after = await collect(engine, prompt, SamplingParams(max_tokens=8), dp_rank=rank)
        assert tokens_of(deltas_after) == expected_tokens(prompt, 8)


async def test_a_scale_down_under_load_removes_the_leaving_actor_and_group(
    engine: Engine,
) -> None:
    leaving = [wiring_of(engine).processes["rank 1"]]
    with anyio.fail_after(HANG_GUARD):
        load = SteadyLoad(engine)
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run)
            await load.wait_for(4)
            await engine.scale(1)
            await load.wait_for(4)
            load.stop.set()
    assert load.started == len(load.finished)
    assert engine.dp_size == 1
    assert len(live_groups()) == 1
    assert all(actor_gone(rank.actor) for rank in leaving)


async def test_with_fail_a_killed_actor_ends_the_engine_named_and_nothing_outlives_it(
    other_jobs: dict[str, Any], engine: Engine
) -> None:
    """A second engine beside the first (one rank left), on the two free CPUs (node "d"
    is given up for it). Its close leaves no actor or placement group."""
    ray.util.remove_placement_group(other_jobs["d"])
    before = live_groups()
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(ray_config(on_rank_failure="fail")) as failing:
            ranks = wiring_of(failing).processes
            actors = [ranks[f"rank {rank}"].actor for rank in (0, 1)]
            assert len(live_groups()) == len(before) + 2
            stream = failing.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=0)
            await stream.__anext__()
            ray.kill(actors[1])
            with pytest.raises(EngineDeadError, match=r"^rank 1 died \(actor died on node "):
                async for _ in stream:
                    pass
    assert live_groups() == before
    assert all(actor_gone(actor) for actor in actors)


# A driver of its own: it opens a Ray engine in the test's cluster (connecting through
# `ray_address`), says where its actors are, and waits to be killed.
_DRIVER = """
import sys

import anyio
import ray

from wavecore.engine.api import open_dp_engine
from wavecore.engine.config import EngineConfig


async def main() -> None:
    config = EngineConfig(
        executor="null", dp_size=2, transport="tcp", dp_backend="ray", ray_address=sys.argv[1]
    )
    async with open_dp_engine(config) as engine:
        ranks = engine.core_client.wiring.processes.values()
        names = [rank.name for rank in ranks if hasattr(rank, "actor")]
        print(ray.get_runtime_context().namespace, *names, flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main)
"""


def _actor_named(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


async def test_a_driver_killed_with_sigkill_leaves_no_actor_or_placement_group(
    cluster: Cluster, engine: Engine
) -> None:
    """Ray ends what a dead owner owned: the actors are not detached."""
    before = live_groups()
    with anyio.fail_after(HANG_GUARD):
        driver = await anyio.open_process(
            [sys.executable, "-c", _DRIVER, cluster.address], stderr=subprocess.DEVNULL
        )
        assert driver.stdout is not None
        line = b""
        async for chunk in driver.stdout:
            line += chunk
            if line.endswith(b"\n"):
                break
        namespace, *names = line.decode().split()
        assert len(names) == 2 and all(_actor_named(name, namespace) for name in names)
        assert len(live_groups()) == len(before) + 2
        driver.send_signal(signal.SIGKILL)
        await driver.wait()

        # Ray's cleanup of the dead driver's job has no event to wait on: polled.
        def gone() -> bool:
            return live_groups() == before and not any(
                _actor_named(name, namespace) for name in names
            )

        await anyio.to_thread.run_sync(_poll_until, gone, abandon_on_cancel=True)


def _poll_until(done: Callable[[], bool]) -> None:
    while not done():
        time.sleep(0.1)
