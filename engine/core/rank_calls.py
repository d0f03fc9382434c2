"""What a rank answers outside its protocol machine: weight updates and collective RPC.

Theory of operation:

1. The runner hands every `weight_messages` call here between loop iterations, so a
   forward is never running meanwhile; model-thread work (reading files, building
   weights, RPC methods) runs on the `ModelThread`, the scheduler is touched on the
   event loop.
2. A weight update is two calls (the front end's two phases): STAGE checks the source
   against the executor (`executors.weight_specs`) and builds the new weights beside
   the old ones, changing nothing; COMMIT swaps them in, relabels the weights, resets
   the prefix cache and sends running requests back to waiting, so that every token
   after the update is computed from the new weights only (their KV is recomputed,
   as after a sleep). DISCARD drops a staged update that another rank refused.
3. STAGE is refused unless the rank's machine holds a completed pause whose weights
   are awake (paused in any mode, or asleep with "weights" woken).
4. A failure is an answer, never the rank's death: nothing changed, the error names
   the file or tensor.
5. SAVE writes the weights the rank serves, under its weight version, into a
   directory (`model.weight_export`), between iterations like every call here; it is
   refused while the weights sleep.
6. The profiler (`core.rank_profiler`) starts and stops on the model thread; a start
   while it runs, or a stop while it does not, is refused.
7. LoRA calls add, remove or pin an adapter on the executor (reading and checking the
   adapter's files on the model thread) and tell the scheduler which adapters are
   pinned (they hold device slots). A refusal (`LoRAError`, naming the file or tensor)
   changes nothing; the front end then removes the adapter from the ranks that took it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.model_thread import ModelThread
from wavecore.engine.core.rank_profiler import RankProfiler
from wavecore.engine.errors import EngineError, ProfilerStateError, WeightUpdateRefusedError
from wavecore.engine.executors.rpc import remote_method
from wavecore.engine.executors.rpc_values import decode_values, encode_values
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.weight_chunks import ChunkAssembler, assemble
from wavecore.engine.weight_messages import (
    COMMIT,
    DISCARD,
    LORA_ADD,
    LORA_PIN,
    LORA_REMOVE,
    PROFILE_START,
    SAVE,
    SET_VERSION,
    STAGE,
    LoRACall,
    ProfileCall,
    RankReply,
    RpcCall,
    WeightChunk,
    WeightsCall,
)
from wavecore.statemachines import PauseState
from wavecore.statemachines.rank import RankSnapshot


class RankCalls:
    """See the module docstring; `state` reads the rank machine's snapshot."""

    def __init__(
        self,
        core: EngineCore,
        rank: int,
        model_thread: ModelThread,
        state: Callable[[], RankSnapshot],
        member: int = 0,
    ) -> None:
        self._core = core
        self._rank = rank
        self._member = member
        self._profiler = RankProfiler()
        self._thread = model_thread
        self._state = state
        self._chunks = ChunkAssembler()
        self._staged: tuple[int, object] | None = None

    async def handle(
        self, item: WeightChunk | WeightsCall | RpcCall | ProfileCall | LoRACall
    ) -> RankReply | None:
        """Perform one call; the reply to send, None for chunks and discards."""
        if isinstance(item, WeightChunk):
            self._chunks.take(item)
            return None
        if isinstance(item, RpcCall):
            return await self._rpc(item)
        if isinstance(item, ProfileCall):
            return await self._profile(item)
        if isinstance(item, LoRACall):
            return await self._lora(item)
        if item.action == STAGE:
            return await self._stage(item)
        if item.action == COMMIT:
            return await self._commit(item)
        if item.action == DISCARD:
            if self._staged is not None and self._staged[0] == item.stage_call:
                self._staged = None
            self._chunks.pop(item.stage_call)  # an update abandoned while sending
            return None
        if item.action == SET_VERSION:
            self._core.weight_version = item.version
            return self._reply(item.call_id)
        if item.action == SAVE:
            return await self._save(item)
        return self._reply(item.call_id, error=f"unknown weights action {item.action!r}")

    # -- weight updates ----------------------------------------------------------------

    async def _stage(self, call: WeightsCall) -> RankReply:
        chunks = self._chunks.pop(call.call_id)
        self._staged = None
        refusal = _refusal(self._state())
        if refusal is not None:
            return self._reply(call.call_id, error=refusal, refused=True)
        stage = getattr(self._core.executor, "stage_weights", None)
        if stage is None:
            return self._reply(
                call.call_id,
                error=f"{type(self._core.executor).__name__} cannot update its weights",
                refused=True,
            )
        path, partial = call.path, call.partial

        def build() -> object:
            from wavecore.engine.model.update_source import canonical_tensors, read_update_file

            if path is not None:
                return stage(read_update_file(path), partial=partial, origin=path)
            origin = "the update's mapping"
            return stage(
                canonical_tensors(assemble(chunks), origin), partial=partial, origin=origin
            )

        try:
            staged = await self._thread.run(build)
        except WeightUpdateRefusedError as error:
            return self._reply(call.call_id, error=str(error), refused=True)
        except EngineError as error:
            return self._reply(call.call_id, error=str(error))
        except Exception as error:  # e.g. out of memory: nothing changed, say what
            return self._reply(call.call_id, error=f"{type(error).__name__}: {error}")
        self._staged = (call.call_id, staged)
        return self._reply(call.call_id)

    async def _commit(self, call: WeightsCall) -> RankReply:
        if self._staged is None or self._staged[0] != call.stage_call:
            return self._reply(call.call_id, error="no staged update to commit")
        staged = self._staged[1]
        self._staged = None
        await self._thread.run(self._core.executor.commit_weights, staged)  # type: ignore[attr-defined]
        self._core.weight_version = call.version
        # Cached prefixes and the KV of kept requests came from the old weights.
        self._core.drop_kv_cache()
        return self._reply(call.call_id)

    async def _save(self, call: WeightsCall) -> RankReply:
        if "weights" in self._state().asleep:
            return self._reply(
                call.call_id,
                error="the weights are asleep: call wake_up(['weights']) before save_weights",
                refused=True,
            )
        save = getattr(self._core.executor, "save_weights", None)
        if save is None or call.path is None or call.max_shard_size is None:
            return self._reply(
                call.call_id,
                error=f"{type(self._core.executor).__name__} cannot save its weights",
                refused=True,
            )
        path, limit, version = call.path, call.max_shard_size, self._core.weight_version
        try:
            await self._thread.run(lambda: save(path, max_shard_size=limit, weight_version=version))
        except WeightUpdateRefusedError as error:
            return self._reply(call.call_id, error=str(error), refused=True)
        except EngineError as error:
            return self._reply(call.call_id, error=str(error))
        except Exception as error:  # e.g. a full disk: say what
            return self._reply(call.call_id, error=f"{type(error).__name__}: {error}")
        return self._reply(call.call_id)

    # -- the profiler ------------------------------------------------------------------

    async def _profile(self, call: ProfileCall) -> RankReply:
        profiler, rank, member = self._profiler, self._rank, self._member
        try:
            if call.action == PROFILE_START and call.directory is not None:
                directory = call.directory
                await self._thread.run(lambda: profiler.start(directory, rank=rank, member=member))
                return self._reply(call.call_id)
            trace = await self._thread.run(profiler.stop)
        except ProfilerStateError as error:
            return self._reply(call.call_id, error=str(error), refused=True)
        except Exception as error:  # e.g. an unwritable directory: say what
            return self._reply(call.call_id, error=f"{type(error).__name__}: {error}")
        return self._reply(call.call_id, result=encode_values(trace, "the trace's path"))

    # -- LoRA adapters -----------------------------------------------------------------

    async def _lora(self, call: LoRACall) -> RankReply:
        executor = self._core.executor
        if not getattr(executor, "lora_enabled", False):
            return self._reply(
                call.call_id,
                error=f"{type(executor).__name__} serves no LoRA adapters "
                "(start the engine with enable_lora=True and a model)",
                refused=True,
            )
        name, path = call.name, call.path
        actions: dict[str, Callable[[], None]] = {
            LORA_ADD: lambda: executor.add_lora(LoRARequest(name, path or "")),  # type: ignore[attr-defined]
            LORA_REMOVE: lambda: executor.remove_lora(name),  # type: ignore[attr-defined]
            LORA_PIN: lambda: executor.pin_lora(name),  # type: ignore[attr-defined]
        }
        action = actions.get(call.action)
        if action is None:
            return self._reply(call.call_id, error=f"unknown LoRA action {call.action!r}")
        try:
            await self._thread.run(action)
        except (EngineError, ValueError) as error:
            return self._reply(call.call_id, error=str(error))
        except Exception as error:  # e.g. out of memory: nothing changed, say what
            return self._reply(call.call_id, error=f"{type(error).__name__}: {error}")
        finally:
            self._core.scheduler.set_pinned_loras(executor.pinned_loras)  # type: ignore[attr-defined]
        return self._reply(call.call_id)

    # -- collective RPC ----------------------------------------------------------------

    async def _rpc(self, call: RpcCall) -> RankReply:
        try:
            method = remote_method(self._core.executor, call.method)
            args, kwargs = _arguments(decode_values(call.arguments, "arguments"))
        except (LookupError, ValueError) as error:
            return self._reply(call.call_id, error=str(error))
        try:
            result = await self._thread.run(lambda: method(*args, **kwargs))
            encoded = encode_values(result, f"the result of {call.method}")
        except Exception as error:  # the method's own failure is the caller's answer
            return self._reply(call.call_id, error=f"{type(error).__name__}: {error}")
        return self._reply(call.call_id, result=encoded)

    def renumber(self, rank: int) -> None:
        """A shrink gave this rank a new number: its answers carry it from now on."""
        self._rank = rank

    def _reply(
        self,
        call_id: int,
        *,
        error: str | None = None,
        refused: bool = False,
        result: bytes | None = None,
    ) -> RankReply:
        return RankReply(
            rank=self._rank, call_id=call_id, error=error, refused=refused, result=result
        )


def _refusal(state: RankSnapshot) -> str | None:
    if state.pause_state is not PauseState.PAUSED:
        return (
            "the engine is serving: call pause('keep') or pause('abort') "
            "(or sleep, then wake_up(['weights'])) before update_weights"
        )
    if "weights" in state.asleep:
        return "the weights are asleep: call wake_up(['weights']) before update_weights"
    return None


def _arguments(value: Any) -> tuple[list[Any], dict[str, Any]]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("arguments must be [args, kwargs]")
    args, kwargs = value
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("arguments must be [args, kwargs]")
    return args, kwargs
