"""Whether a local process is stopped (SIGSTOP, SIGTSTP, a debugger), read from /proc.

A stopped rank is alive, so no watcher reports it; its peers only see a collective that
never completes, and give up after `collective_timeout` with an error that can name
only themselves. The client then looks for the rank that is actually stopped, to name
the cause rather than the symptom.
"""

from __future__ import annotations

from multiprocessing.process import BaseProcess
from typing import Protocol, runtime_checkable


@runtime_checkable
class KnowsIfStopped(Protocol):
    """A stand-in for a process (a rank elsewhere) that says itself whether it is stopped."""

    def is_stopped(self) -> bool: ...


def process_is_stopped(process: BaseProcess) -> bool:
    """Whether this started process, or a stand-in for one, is stopped."""
    if isinstance(process, KnowsIfStopped):
        return process.is_stopped()
    return process.pid is not None and is_stopped(process.pid)


def is_stopped(pid: int) -> bool:
    """True when `pid` is in state T (stopped by a signal) or t (stopped by a tracer);
    False when it runs, or where /proc cannot tell (another OS, a process gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read()
    except OSError:
        return False
    # The command name, in parentheses, may hold spaces; the state follows it.
    after_name = fields.rpartition(")")[2].split()
    return bool(after_name) and after_name[0] in ("T", "t")
