"""A spawned DP process ends soon after the process that started it, however that died.

Theory of operation:

The launcher reaps its coordinator and ranks on the way out of its block, but an
embedding program that is SIGKILLed (or crashes in C) runs no `finally`, and its
children would live on as orphans holding ports, memory and the ipc directory. So every
child the launcher spawns calls `exit_with_parent` first thing, which sets up two
independent watches; either one is enough, and both together cover each other's gaps:

1. The kernel's (Linux only): `prctl(PR_SET_PDEATHSIG, signal)` has the kernel send
   `signal` to this process when its parent dies. As SIGKILL it needs no cooperation
   from this process, so it works even when the interpreter is wedged (a C call holding
   the GIL, a collective that never returns). It fires when the parent *thread* that
   forked this process ends, not the parent process: the launcher and the scaler spawn
   from the event-loop thread, which lives as long as the engine (every child is reaped
   before the engine's block is left), so for us the two are the same. It is never sent
   if the parent died before the `prctl`; the second watch covers that window.
2. The portable one: the sentinel of `multiprocessing.parent_process()` is ready once
   the parent has ended. On POSIX it is the read end of the pipe the spawn machinery
   sent this process its arguments through (on Windows, the parent's process handle);
   the parent keeps the write end open for as long as it keeps the `Process` object
   (the launcher keeps every one until it has reaped it), and the kernel closes it when
   the parent dies, however it dies. A daemon thread waits for that, runs the cleanup
   and leaves with `os._exit`: the parent is gone, so nobody is left to say goodbye to,
   and an orderly shutdown could wait forever on a peer or a collective that is gone
   too; the kernel releases sockets and memory. It needs no argument of ours, so it
   also covers the ranks a scale up adds. (A child the parent forks without exec
   inherits the write end too and delays this watch until it ends as well; the
   kernel's watch is not delayed.)

A process with no cleanup (a rank: it creates nothing that outlives it) is sent SIGKILL
by the kernel. One with a cleanup (the coordinator, which removes the ipc directory) is
sent SIGTERM instead, handled by running the cleanup and then dying by SIGTERM after
all, so its exit status still says what happened. A process not started by
multiprocessing (`wavecore rank`, run from a shell) has no parent to watch and lives as
its operator decides.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import parent_process
from types import FrameType

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def exit_with_parent(*, cleanup: Callable[[], None] | None = None) -> None:
    """Make this spawned process end soon after its parent; call it first thing.

    `cleanup` (quick, idempotent, best effort: it may run twice, from two threads) runs
    before the process ends because its parent died, and when SIGTERM ends it.
    """
    parent = parent_process()
    if parent is None:
        return
    death_signal = signal.SIGKILL
    if cleanup is not None:
        death_signal = signal.SIGTERM
        # Installed before the kernel may send it, so it never finds the default action.
        signal.signal(signal.SIGTERM, _cleanup_then_die(cleanup))
    if sys.platform.startswith("linux"):
        _set_parent_death_signal(death_signal)

    def watch() -> None:
        parent.join()  # returns at end of file on the spawn pipe: the parent is gone
        if cleanup is not None:
            cleanup()
        os._exit(1)  # nobody is left to read the status

    threading.Thread(target=watch, name="wavecore-parent-watch", daemon=True).start()


def _cleanup_then_die(cleanup: Callable[[], None]) -> Callable[[int, FrameType | None], None]:
    def handle(signum: int, frame: FrameType | None) -> None:
        cleanup()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    return handle


def _set_parent_death_signal(death_signal: signal.Signals) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    # prctl is variadic: pass every argument as the unsigned long the kernel reads.
    args = (_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    if libc.prctl(*(ctypes.c_ulong(arg) for arg in args)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(error)}")
