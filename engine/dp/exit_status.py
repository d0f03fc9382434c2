"""How a DP process ended, collected reliably and said plainly.

A process's sentinel is ready as soon as its file descriptors are closed, which the
kernel does a moment before the exit status can be collected: reading `exitcode` right
then gives None. `wait_for_exits` therefore joins every process whose sentinel it saw,
so its status is known. Collecting a status is a `waitpid` and then an assignment, so
of two threads joining one process at once, the loser's join may return before the
winner's assignment, with the status still None: the joins made here take turns.

multiprocessing reports a process killed by a signal as the negative signal number;
`describe_exit` names the signal instead ("killed by SIGKILL"). A rank started by
someone else (a Ray actor, `ray_launcher`) stands in for a process and says itself how
it ended, and where (`ReportsItsEnd`); `describe_end` reads either.
"""

from __future__ import annotations

import multiprocessing.connection
import signal
import threading
from collections.abc import Iterable
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, runtime_checkable

_COLLECTING = threading.Lock()


def describe_exit(exitcode: int | None) -> str:
    """How an exit status reads: "exited with code 3", "killed by SIGKILL"."""
    if exitcode is None:
        return "exit status not collected"
    if exitcode < 0:
        return f"killed by {_signal_name(-exitcode)}"
    return f"exited with code {exitcode}"


@runtime_checkable
class ReportsItsEnd(Protocol):
    """A stand-in for a process whose end is not an exit status of this machine's."""

    def end_report(self) -> str:
        """How and where it ended, for a cause ("rank 1 died (<this>)")."""
        ...


def describe_end(process: BaseProcess) -> str:
    """How this ended process (or stand-in for one) ended."""
    if isinstance(process, ReportsItsEnd):
        return process.end_report()
    return describe_exit(process.exitcode)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def wait_for_exits(processes: Iterable[BaseProcess], *others: Any) -> list[BaseProcess]:
    """Block until one of `processes` ends or one of `others` (waitable objects, e.g. a
    wake-up socket) is ready; return the processes that ended, joined. Blocking: run it
    in a worker thread."""
    by_sentinel = {process.sentinel: process for process in processes}
    ready = multiprocessing.connection.wait([*by_sentinel, *others])
    ended = [by_sentinel[handle] for handle in ready if handle in by_sentinel]
    with _COLLECTING:
        for process in ended:
            process.join()  # the sentinel says it is exiting: its status is moments away
    return ended
