"""The machine a benchmark ran on, named in every result: figures from one CPU do not
carry over to another (a kernel tuned on an AMD EPYC ran 1.5x slower on an Intel Xeon).
The CPU's name comes from the engine's kernel choice, which keys its cache by it."""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Callable
from typing import TypeVar

from wavecore.engine.model.kernel_choice import cpu_name

__all__ = ["cpu_name", "describe", "on_a_thread_of_its_own"]

T = TypeVar("T")


def describe() -> dict[str, object]:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version()}


def on_a_thread_of_its_own(run: Callable[..., T], *args: object) -> T:
    """`run(*args)` on a new thread that ends with it, so that no OpenMP team of its
    torch work outlives it.

    torch's CPU ops share one libgomp (llama.cpp's too: the same `libgomp.so.1`), and
    each thread that starts parallel work keeps a team of its own for its lifetime.
    While more team threads exist than CPUs, libgomp's workers stop spinning between
    parallel regions and sleep at once, so every small op pays a futex wake: after a
    benchmark ran torch ops on its main thread, an engine's model thread in the same
    process ran SmolLM2's 32-decode step in 94 ms instead of 55 (2 vCPU Xeon). A
    thread's team ends with the thread.
    """
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(run(*args))
        except BaseException as error:  # re-raised on the caller's thread
            errors.append(error)

    thread = threading.Thread(target=target, name="bench-own-thread")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
