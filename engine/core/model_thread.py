"""The one thread on which an engine runs its model.

Model steps take milliseconds to seconds; running them on the event loop would stop
the engine from taking requests, aborts and utility calls while the model works. So
the loop hands each step to this thread and awaits it. One long-lived thread, not a
pool: thread-local state (torch's inference mode, a CUDA device and stream) stays
put, and steps can never overlap.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

_STOP = object()
T = TypeVar("T")


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

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the model thread and return its result or raise its error.

        The wait is shielded from cancellation: a half-finished forward pass cannot be
        abandoned (its outputs would land in state the caller no longer owns), so a
        cancelled caller waits for the step to end, then sees the cancellation.
        """
        done = anyio.Event()
        token = anyio.lowlevel.current_token()
        outcome: list[Any] = []

        def job() -> None:
            try:
                outcome.append((True, fn(*args)))
            except BaseException as error:  # delivered to the awaiting task below
                outcome.append((False, error))
            anyio.from_thread.run_sync(done.set, token=token)

        self._jobs.put(job)
        with anyio.CancelScope(shield=True):
            await done.wait()
        # Shielded waits are not checkpoints: without this a rank that steps back to
        # back would never see its cancellation while it has work.
        await anyio.lowlevel.checkpoint_if_cancelled()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value
