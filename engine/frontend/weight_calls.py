"""The front end's side of weight updates, weight versions and collective RPC.

Theory of operation:

1. `update_weights` runs two phases over every rank (`core.rank_calls` is the rank's
   side). Phase 1 sends the source (a path as a path: ranks share this machine's
   file system; a mapping as `WeightChunk`s of at most the core client's
   `max_chunk_bytes`, RFC 8746 typed arrays) and STAGE; each rank checks it and builds
   the new weights beside the old. Only if every rank staged does phase 2 COMMIT them;
   otherwise every rank DISCARDs, keeps its old weights, and the error names each rank
   that refused and why.
2. Every rank's replies arrive in order with its `StepOutputs`, so the version a rank
   serves changes here exactly between the outputs of the old weights and those of
   the new: `version_of(rank)` is what stamps each delta.
3. `save_weights` asks the first rank to write the weights it serves (every rank
   serves the same: an update commits on all or none) into a directory of this
   machine's file system; it holds the update lock, so no update starts meanwhile.
4. `profile` starts or stops the torch profiler on every rank; a stop returns each
   rank's trace file.
5. `collective_rpc` sends one `RpcCall` to every rank and returns the results in rank
   order; a rank that fails or does not answer within `timeout` is named.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from wavecore.engine.errors import (
    CollectiveRpcError,
    EngineError,
    ProfilerStateError,
    RankCallError,
    WeightUpdateError,
    WeightUpdateRefusedError,
)
from wavecore.engine.executors.rpc_values import decode_values, encode_values
from wavecore.engine.weight_chunks import flat_tensors, tensor_chunks
from wavecore.engine.weight_messages import (
    COMMIT,
    DISCARD,
    PROFILE_START,
    SAVE,
    SET_VERSION,
    STAGE,
    ProfileCall,
    RankReply,
    RpcCall,
    WeightChunk,
    WeightsCall,
)

Send = Callable[[int, Any], Awaitable[None]]


@dataclass(slots=True)
class _Pending:
    waiting_for: set[int]
    done: anyio.Event = field(default_factory=anyio.Event)
    replies: dict[int, RankReply] = field(default_factory=dict)
    # A commit or relabel: the version each rank serves once it answered.
    sets_version: bool = False
    version: str | None = None


class WeightCalls:
    """Use through the front end; `check_open` raises once the engine is dead or closed."""

    def __init__(
        self,
        *,
        send: Send,
        call_ids: Iterator[int],
        max_chunk_bytes: int | None,
        check_open: Callable[[], None],
    ) -> None:
        self._send = send
        self._call_ids = call_ids
        self._max_chunk_bytes = max_chunk_bytes
        self._check_open = check_open
        self._pending: dict[int, _Pending] = {}
        self._versions: dict[int, str | None] = {}
        self.version: str | None = None
        # Whether the ranks serve weights other than the model file's.
        self.updated = False
        # One update at a time: a rank holds one staged update.
        self._update_lock = anyio.Lock()
        self.updating = False

    def version_of(self, rank: int) -> str | None:
        return self._versions.get(rank)

    # -- calls -------------------------------------------------------------------------

    async def update_weights(
        self, ranks: Sequence[int], source: object, *, version: str | None, partial: bool
    ) -> None:
        path, chunks = _prepared(source, self._max_chunk_bytes)
        async with self._update_lock:
            self.updating = True
            try:
                await self._update(ranks, path, chunks, version=version, partial=partial)
            finally:
                self.updating = False

    async def _update(
        self,
        ranks: Sequence[int],
        path: str | None,
        chunks: ChunkSource,
        *,
        version: str | None,
        partial: bool,
    ) -> None:
        stage_id = next(self._call_ids)
        try:
            for chunk in chunks(stage_id):
                for rank in ranks:
                    await self._send(rank, chunk)
            staged = await self._call(
                ranks,
                WeightsCall(call_id=stage_id, action=STAGE, path=path, partial=partial),
                call_id=stage_id,
            )
        except BaseException:
            # Cancelled or failed half way: the ranks must not keep chunks or weights.
            with anyio.CancelScope(shield=True):
                await self._discard(ranks, stage_id)
            raise
        failed = {rank: reply for rank, reply in staged.items() if reply.error is not None}
        if failed:
            await self._discard(ranks, stage_id)
            detail = "; ".join(f"rank {rank}: {reply.error}" for rank, reply in failed.items())
            kind = (
                WeightUpdateRefusedError
                if all(reply.refused for reply in failed.values())
                else WeightUpdateError
            )
            raise kind(f"update_weights failed ({detail}); every rank kept its old weights")
        commit_id = next(self._call_ids)
        # Once sent, a commit is seen through: every rank switches and reports it.
        with anyio.CancelScope(shield=True):
            committed = await self._call(
                ranks,
                WeightsCall(call_id=commit_id, action=COMMIT, version=version, stage_call=stage_id),
                call_id=commit_id,
                version=version,
            )
        _raise_errors(committed, RankCallError, "update_weights commit")
        self.version = version
        self.updated = True

    async def _discard(self, ranks: Sequence[int], stage_id: int) -> None:
        try:
            self._check_open()
        except EngineError:
            return  # the ranks are gone or going: nothing of theirs to free
        for rank in ranks:
            await self._send(
                rank, WeightsCall(call_id=next(self._call_ids), action=DISCARD, stage_call=stage_id)
            )

    async def set_weight_version(self, ranks: Sequence[int], version: str | None) -> None:
        call_id = next(self._call_ids)
        replies = await self._call(
            ranks,
            WeightsCall(call_id=call_id, action=SET_VERSION, version=version),
            call_id=call_id,
            version=version,
        )
        _raise_errors(replies, RankCallError, "set_weight_version")
        self.version = version

    async def save_weights(
        self, rank: int, directory: str | os.PathLike[str], *, max_shard_size: int
    ) -> None:
        path = _local_path(directory)
        async with self._update_lock:
            call_id = next(self._call_ids)
            message = WeightsCall(
                call_id=call_id, action=SAVE, path=path, max_shard_size=max_shard_size
            )
            replies = await self._call([rank], message, call_id=call_id)
        failed = replies[rank]
        if failed.error is not None:
            kind = WeightUpdateRefusedError if failed.refused else WeightUpdateError
            raise kind(f"save_weights failed (rank {rank}: {failed.error})")

    async def profile(
        self, ranks: Sequence[int], action: str, directory: str | os.PathLike[str] | None
    ) -> list[str]:
        """Start (`directory` given) or stop the profiler on `ranks`; a stop's result is
        each rank's trace file, in rank order."""
        path = None if directory is None else _local_path(directory)
        call_id = next(self._call_ids)
        message = ProfileCall(call_id=call_id, action=action, directory=path)
        replies = await self._call(ranks, message, call_id=call_id)
        failed = {rank: reply for rank, reply in sorted(replies.items()) if reply.error}
        if failed:
            detail = "; ".join(f"rank {rank}: {reply.error}" for rank, reply in failed.items())
            kind = (
                ProfilerStateError
                if all(reply.refused for reply in failed.values())
                else RankCallError
            )
            raise kind(f"{action}_profile failed ({detail})")
        if action == PROFILE_START:
            return []
        return [_result(f"{action}_profile", replies[rank]) for rank in ranks]

    async def reloaded(self, ranks: Sequence[int]) -> None:
        """The ranks are about to reload the model file's weights (a level-2 wake)."""
        await self.set_weight_version(ranks, None)
        self.updated = False

    async def collective_rpc(
        self,
        ranks: Sequence[int],
        method: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        limit_s: float | None,
    ) -> list[Any]:
        try:
            arguments = encode_values([list(args), dict(kwargs)], f"collective_rpc {method!r}")
        except ValueError as error:
            raise CollectiveRpcError(str(error)) from None
        call_id = next(self._call_ids)
        message = RpcCall(call_id=call_id, method=method, arguments=arguments)
        replies = await self._call(ranks, message, call_id=call_id, limit_s=limit_s, what=method)
        _raise_errors(replies, CollectiveRpcError, f"collective_rpc {method!r}")
        return [_result(method, replies[rank]) for rank in ranks]

    def next_call_id(self) -> int:
        return next(self._call_ids)

    async def call(self, ranks: Sequence[int], message: Any) -> dict[int, RankReply]:
        """Send `message` (a rank call under its own `call_id`) to `ranks`; each rank's
        reply. For the calls of other modules that ranks answer with a `RankReply`."""
        return await self._call(ranks, message, call_id=message.call_id)

    async def _call(
        self,
        ranks: Sequence[int],
        message: Any,
        *,
        call_id: int,
        version: str | None = None,
        limit_s: float | None = None,
        what: str = "",
    ) -> dict[int, RankReply]:
        pending = _Pending(
            waiting_for=set(ranks),
            sets_version=isinstance(message, WeightsCall)
            and message.action in (COMMIT, SET_VERSION),
            version=version,
        )
        self._pending[call_id] = pending
        try:
            for rank in ranks:
                await self._send(rank, message)
            with anyio.move_on_after(limit_s):
                await pending.done.wait()
        finally:
            self._pending.pop(call_id, None)
        self._check_open()
        if pending.waiting_for:
            silent = ", ".join(str(rank) for rank in sorted(pending.waiting_for))
            raise CollectiveRpcError(
                f"collective_rpc {what!r}: rank {silent} did not answer within {limit_s} s"
            )
        return pending.replies

    # -- replies -----------------------------------------------------------------------

    def on_reply(self, reply: RankReply) -> None:
        pending = self._pending.get(reply.call_id)
        if pending is None or reply.rank not in pending.waiting_for:
            return  # a call that timed out, or a duplicate
        if pending.sets_version and reply.error is None:
            self._versions[reply.rank] = pending.version
        pending.replies[reply.rank] = reply
        pending.waiting_for.discard(reply.rank)
        if not pending.waiting_for:
            pending.done.set()

    def fail_all(self) -> None:
        """The engine died or closed: wake every waiting call (it then raises why)."""
        for pending in self._pending.values():
            pending.done.set()


def _result(method: str, reply: RankReply) -> Any:
    try:
        if reply.result is None:
            raise ValueError("no result")
        return decode_values(reply.result, "result")
    except ValueError as error:
        raise CollectiveRpcError(
            f"collective_rpc {method!r}: rank {reply.rank} sent a bad result ({error})"
        ) from None


def _raise_errors(replies: dict[int, RankReply], kind: type[Exception], what: str) -> None:
    failed = [(rank, reply.error) for rank, reply in sorted(replies.items()) if reply.error]
    if failed:
        raise kind(f"{what} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))


ChunkSource = Callable[[int], Iterator[WeightChunk]]


def _local_path(path: str | os.PathLike[str]) -> str:
    """A path as the ranks read it: absolute, on this machine's file system."""
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def _prepared(source: object, max_chunk_bytes: int | None) -> tuple[str | None, ChunkSource]:
    """The path to send, or the chunks of a mapping (checked before anything is sent)."""
    if isinstance(source, str | os.PathLike):
        return _local_path(source), lambda _: iter(())
    if not isinstance(source, Mapping):
        raise WeightUpdateError(
            "update_weights takes a safetensors or GGUF file, a directory of safetensors "
            f"files, or a mapping of names to torch.Tensor; got a {type(source).__name__}"
        )
    flats = flat_tensors(source)
    return None, lambda call_id: tensor_chunks(call_id, flats, max_chunk_bytes)
