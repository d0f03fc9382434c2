"""update_weights on the default model (SmolLM2-135M, 538 MB of float32 weights).

For one rank in this process and for dp 2 (rank processes on this machine): a full
update from the model's GGUF file (each rank reads the path itself), a full update
from an in-memory mapping (in process: the tensors themselves; dp 2: 16 MiB RFC 8746
chunks over the channels to every rank), and a partial one (the last layer's down
projection). Also the RL loop's step end to end: pause(keep) with a request in flight,
update from memory, resume, the request's next token. Prints a table and writes
bench/results/weights.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import torch

from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.interface import Engine
from wavecore.engine.model import default_model_path, resolve_model_source
from wavecore.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "weights.json"


async def timed(engine: Engine, source: object, **options: object) -> float:
    start = time.perf_counter()
    await engine.update_weights(source, **options)  # type: ignore[arg-type]
    return time.perf_counter() - start


async def measure(dp_size: int, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    config = EngineConfig(
        device="cpu", kv_cache_memory=64 * 2**20, max_model_len=256, dp_size=dp_size
    )
    last = resolve_model_source(None).config.num_layers - 1
    down = f"layers.{last}.down"
    async with open_engine(config) as engine:
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        stream = engine.generate("The capital of France is", params)
        await stream.__anext__()
        start = time.perf_counter()
        await engine.pause("keep")
        await engine.update_weights(tensors, version="B")
        await engine.resume()
        await stream.__anext__()
        cycle = time.perf_counter() - start
        await stream.aclose()
        await engine.pause("abort")
        figures = {
            "file_s": await timed(engine, default_model_path()),
            "memory_s": await timed(engine, tensors),
            "partial_s": await timed(engine, {down: tensors[down] * 1.5}, partial=True),
            "pause_update_resume_next_token_s": cycle,
        }
        await engine.resume()
    return figures


async def main() -> None:
    tensors = resolve_model_source(None).load_tensors()
    megabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    results = {"megabytes": megabytes}
    print(
        f"{'ranks':>5} {'file s':>8} {'memory s':>9} {'MB/s':>7} {'partial s':>10} {'cycle s':>8}"
    )
    for dp_size in (1, 2):
        figures = await measure(dp_size, tensors)
        figures["memory_mb_per_s"] = megabytes / figures["memory_s"]
        results[f"dp{dp_size}"] = figures  # type: ignore[assignment]
        print(
            f"{dp_size:>5} {figures['file_s']:>8.2f} {figures['memory_s']:>9.2f} "
            f"{figures['memory_mb_per_s']:>7.0f} {figures['partial_s']:>10.3f} "
            f"{figures['pause_update_resume_next_token_s']:>8.2f}"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    anyio.run(main)
