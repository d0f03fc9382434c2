"""The one thread on which an engine runs its model.

Model steps take milliseconds to seconds; running them on the event loop would stop
the engine from taking requests, aborts and utility calls while the model works. So
the loop hands each step to this thread and awaits it. One long-lived thread, not a
pool: thread-local state (torch's inference mode, a CUDA device and stream) stays
put, and steps can never overlap. Jobs run in the order they were started, so a job
may read the result of one started before it (`ModelJob.result`): the batch queue
starts step N+1 before it awaits step N, and N+1 takes N's samples that way.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

_STOP = object()
T = TypeVar("T")


class ModelJob(Generic[T]):
    """One call queued on a `ModelThread`: `await job.wait()` for its result."""

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._fn = fn
        self._args = args
        self._done = anyio.Event()
        self._call_soon = loop_call_soon()
        self._outcome: tuple[bool, Any] | None = None
        # How long the call ran on the model thread (its wait behind earlier jobs
        # aside): a step's time in its iteration details.
        self.elapsed_s = 0.0

    def __call__(self) -> None:  # on the model thread
        started = time.perf_counter()
        try:
            self._outcome = (True, self._fn(*self._args))
        except BaseException as error:  # delivered to whoever reads the result
            self._outcome = (False, error)
        self.elapsed_s = time.perf_counter() - started
        # Without waiting for the event loop (what `from_thread.run_sync` would do): the
        # thread goes on to the next job at once, even while the loop is busy.
        self._call_soon(self._done.set)

    def result(self) -> T:
        """The result, or its error raised; only once the job ran (e.g. from a job
        started after it, on the model thread)."""
        if self._outcome is None:
            raise RuntimeError("ModelJob.result() before the job ran")
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    async def wait(self) -> T:
        """Wait for the job to end and return its result or raise its error.

        The wait is shielded from cancellation: a half-finished forward pass cannot be
        abandoned (its outputs would land in state the caller no longer owns), so a
        cancelled caller waits for the step to end, then sees the cancellation.
        """
        with anyio.CancelScope(shield=True):
            await self._done.wait()
        # Shielded waits are not checkpoints: without this a rank that steps back to
        # back would never see its cancellation while it has work.
        await anyio.lowlevel.checkpoint_if_cancelled()
        return self.result()


def loop_call_soon() -> Callable[[Callable[[], object]], object]:
    """The running event loop's thread-safe "call this soon", which returns at once.

    anyio has no public one (`from_thread.run_sync` waits for the loop), so this takes
    each backend's own: asyncio's `call_soon_threadsafe`, trio's `run_sync_soon`.
    """
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # no asyncio loop in this thread: anyio runs on trio
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


class ModelThread:
    """Use as `with ModelThread(name) as thread:`; `await thread.run(fn, *args)`."""

    def __init__(self, name: str = "wavecore-model") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def __enter__(self) -> ModelThread:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._jobs.put(_STOP)
        self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            job()

    def start(self, fn: Callable[..., T], *args: Any) -> ModelJob[T]:
        """Queue `fn(*args)` behind the jobs already started; await the job later."""
        job = ModelJob(fn, args)
        self._jobs.put(job)
        return job

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the model thread and return its result or raise its error
        (`ModelJob.wait`: cancellation waits for the job to end)."""
        return await self.start(fn, *args).wait()
