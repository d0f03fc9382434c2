"""Opening an engine: `async with open_engine(EngineConfig(...)) as engine`.

Every way of opening one yields the same `Engine` (the front end), over the core
client the configuration asks for: one rank in this process for `dp_size == 1`, rank
processes and a coordinator otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from typing import Any

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.inprocess import open_in_process
from wavecore.engine.dp.client import open_dp_client
from wavecore.engine.dp.rank_process import BuildCore
from wavecore.engine.frontend.engine import serving
from wavecore.engine.interface import Engine, EngineStats, RankStats

__all__ = [
    "Engine",
    "EngineStats",
    "RankStats",
    "open_dp_engine",
    "open_engine",
    "open_engine_core",
]


@asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None, **overrides: Any
) -> AsyncIterator[Engine]:
    """An engine for the block's lifetime: `open_engine(EngineConfig(...))` or
    `open_engine(executor="null", max_num_seqs=8)`. The model loads off the event loop;
    `dp_size > 1` starts rank processes (spawned: the embedding program needs the usual
    `if __name__ == "__main__":` guard)."""
    if config is not None and overrides:
        raise TypeError("give open_engine an EngineConfig or keyword settings, not both")
    config = config if config is not None else EngineConfig(**overrides)
    if config.dp_size > 1 or config.dp_backend == "ray":
        # On Ray even one rank is an actor in the cluster (and the engine can scale).
        async with open_dp_engine(config) as engine:
            yield engine
        return
    async with open_engine_core(
        functools.partial(EngineCore.from_config, config), config=config
    ) as engine:
        yield engine


@asynccontextmanager
async def _bare_errors() -> AsyncIterator[None]:
    """The task groups inside an engine wrap whatever crosses them in exception groups;
    a single error (the caller's own, or the engine's) is raised bare."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves: list[BaseException] = []
        pending: list[BaseException] = [group]
        while pending:
            item = pending.pop()
            if isinstance(item, BaseExceptionGroup):
                pending.extend(item.exceptions)
            else:
                leaves.append(item)
        if len(leaves) != 1:
            raise
        raise leaves[0] from None


@asynccontextmanager
async def open_engine_core(
    build_core: Callable[[], EngineCore], *, config: EngineConfig | None = None
) -> AsyncIterator[Engine]:
    """One rank in this process serving the `EngineCore` that `build_core()` returns
    (called on the model thread), for embedding a core with an executor of one's own;
    `config` gives the front end its LoRA settings (default: LoRA off)."""
    async with (
        _bare_errors(),
        open_in_process(build_core) as core,
        serving(core, config) as engine,
    ):
        yield engine


@asynccontextmanager
async def open_dp_engine(
    config: EngineConfig,
    *,
    build_core: BuildCore = EngineCore.from_config,
    rank_configs: Mapping[int, EngineConfig] | None = None,
    master: str | None = None,
    local_ranks: Collection[int] | None = None,
    on_listening: Callable[[str], None] | None = None,
) -> AsyncIterator[Engine]:
    """Rank processes behind the same front end, whatever `dp_size` (1 included).

    `build_core(config)` runs in each rank process (a picklable, module-level callable);
    `rank_configs` gives chosen ranks a configuration of their own (the startup
    handshake refuses it unless it equals `config`); `master`, `local_ranks` and
    `on_listening` let ranks run elsewhere (`wavecore rank`).
    """
    async with (
        _bare_errors(),
        open_dp_client(
            config,
            build_core=build_core,
            rank_configs=rank_configs,
            master=master,
            local_ranks=local_ranks,
            on_listening=on_listening,
        ) as core,
        serving(core, config) as engine,
    ):
        yield engine
