"""How many DP ranks this machine can hold: the bound a scale is checked against first.

A scale that asks for more ranks than the machine can run does not fail cleanly later:
it spawns every process, each loads its model, and the commit then waits on ranks that
cannot keep up (issue 15: `scale(100)` on 2 cores spawned 98 processes and took the
engine down 133 s later). So the target size is checked before anything starts, against
`EngineConfig.max_dp_size`, or, when that is None, against the smaller of two bounds:

- CPU: `RANKS_PER_CORE` ranks per core this process may run on. A rank is a busy loop
  (forward, vote, outputs); lockstep ranks step in waves paced by the slowest, so ranks
  beyond the cores only time-slice. A few per core still pay off with the null executor
  (bench/dp.py: dp 4 on 2 vCPU streams about as much as dp 2), more do not.
- Memory: MemAvailable divided by what one rank needs: its process (Python, torch and the
  channels, `RANK_PROCESS_BYTES`, measured as a null rank's resident set, 236 MB), the
  model's weights (parameters x 4 bytes: float32, the widest dtype the executor uses, so
  the bound errs on the safe side) and its KV cache (`kv_cache_memory`; a fraction is
  of the memory available, for every rank), and with a draft model its weights and its
  KV cache (as many blocks as the target's, `engine/model/draft_model.py`). A
  null-executor rank holds neither.

The bound is on the engine's whole size, as if every rank ran here (a scale spawns its
new ranks here); an engine with ranks on other machines too (`wavecore rank`) sets
`max_dp_size` itself. On Ray (`dp_backend="ray"`) the cluster's free resources bound it
instead (`ray_launcher`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from wavecore.engine.config import EngineConfig

RANKS_PER_CORE = 4
RANK_PROCESS_BYTES = 256 * 2**20
_WEIGHT_BYTES_PER_PARAMETER = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class DPCapacity:
    """The most ranks allowed, and why, in words a refusal can quote."""

    max_dp_size: int
    reason: str


def dp_capacity(config: EngineConfig) -> DPCapacity:
    """The limit for `config`: its `max_dp_size`, else the machine's (module docstring)."""
    if config.max_dp_size is not None:
        return DPCapacity(max_dp_size=config.max_dp_size, reason="EngineConfig.max_dp_size")
    cores = _usable_cores()
    by_cpu = DPCapacity(
        max_dp_size=RANKS_PER_CORE * cores,
        reason=f"{RANKS_PER_CORE} ranks per CPU core, {cores} cores",
    )
    available = _available_memory()
    per_rank = rank_memory_bytes(config, available)
    by_memory = DPCapacity(
        max_dp_size=max(1, available // per_rank),
        reason=f"{_mib(available)} MiB available, {_mib(per_rank)} MiB per rank",
    )
    return min(by_cpu, by_memory, key=lambda capacity: capacity.max_dp_size)


def rank_memory_bytes(config: EngineConfig, available: int) -> int:
    """What one rank process holds: process, weights and KV cache (module docstring)."""
    if config.executor == "null":
        return RANK_PROCESS_BYTES  # no weights, and no KV cache to allocate
    kv = config.kv_cache_memory
    kv_bytes = int(kv * available) if isinstance(kv, float) else kv
    total = RANK_PROCESS_BYTES + _weight_bytes(config.model) + kv_bytes
    if config.draft_model is not None:
        total += _weight_bytes(config.draft_model) + _draft_kv_bytes(config, kv_bytes)
    return total


def _weight_bytes(model: str | None) -> int:
    from wavecore.engine.model.resolve import resolve_model_source

    parameters = resolve_model_source(model).config.num_parameters
    return parameters * _WEIGHT_BYTES_PER_PARAMETER


def _draft_kv_bytes(config: EngineConfig, kv_bytes: int) -> int:
    """The draft's KV cache: the target's block count, in the draft's block size."""
    import torch

    from wavecore.engine.model.kv_cache import bytes_per_block
    from wavecore.engine.model.resolve import resolve_model_source

    def block(model: str | None) -> int:
        source = resolve_model_source(model)
        return bytes_per_block(source.config, config.block_size, torch.float32)

    return kv_bytes // block(config.model) * block(config.draft_model)


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _available_memory() -> int:
    import torch

    from wavecore.engine.model.kv_cache import available_memory

    return available_memory(torch.device("cpu"))


def _mib(count: int) -> int:
    return count // 2**20
