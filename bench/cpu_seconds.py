"""Where a measured run's CPU time went, from /proc (Linux): the CPU seconds of named
groups of processes, of this process's other descendants (a local Ray's raylet, GCS,
agents and idle workers; multiprocessing's resource tracker), of everything else on
the machine (other users' work: the load a figure was taken under), and the CPU
seconds nobody used (idle). On a small shared machine a throughput figure means
little without them: a run that lost to another user's burst shows it here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _process_stat(pid: int) -> tuple[int, float] | None:
    """The parent pid and the CPU seconds (user + system) of `pid`, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    fields = text[text.rindex(b")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def _machine_seconds() -> tuple[float, float]:
    """Busy and idle CPU seconds since boot, summed over every CPU."""
    with open("/proc/stat") as file:
        values = [int(value) for value in file.readline().split()[1:]]
    idle = values[3] + values[4]  # idle and iowait
    return (sum(values) - idle) * _TICK_S, idle * _TICK_S


@dataclass(frozen=True, slots=True)
class _Snapshot:
    processes: dict[int, tuple[int, float]]  # pid: (parent pid, CPU seconds)
    busy_s: float
    idle_s: float

    @classmethod
    def take(cls) -> _Snapshot:
        processes = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := _process_stat(int(entry))) is not None:
                processes[int(entry)] = stat
        busy, idle = _machine_seconds()
        return cls(processes, busy, idle)


class CPUSeconds:
    """`start()`, run, `stop()`: CPU seconds by group over that span (module docstring).

    `groups` names the processes of interest (e.g. "front end": [this pid], "ranks":
    [their pids]); a pid in no group that descends from this process counts as
    "other descendants", any other as "rest of the machine". Threads are counted
    within their process; processes that began and ended within the span are seen only
    in the machine's busy time, so "rest of the machine" is that total less the rest.
    """

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self._groups = {name: set(pids) for name, pids in groups.items()}
        self._before: _Snapshot | None = None

    def start(self) -> None:
        self._before = _Snapshot.take()

    def stop(self) -> dict[str, float]:
        if self._before is None:
            raise RuntimeError("CPUSeconds.stop() before start()")
        before, after = self._before, _Snapshot.take()
        descendants = _descendants(os.getpid(), after.processes)
        spent: dict[str, float] = {name: 0.0 for name in self._groups}
        spent["other descendants"] = 0.0
        for pid, (_, seconds) in after.processes.items():
            used = seconds - before.processes.get(pid, (0, 0.0))[1]
            group = next((name for name, pids in self._groups.items() if pid in pids), None)
            if group is not None:
                spent[group] += used
            elif pid in descendants:
                spent["other descendants"] += used
        busy = after.busy_s - before.busy_s
        spent["rest of the machine"] = max(0.0, busy - sum(spent.values()))
        spent["idle"] = after.idle_s - before.idle_s
        return spent


def _descendants(root: int, processes: Mapping[int, tuple[int, float]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_until_quiet(*, busy_below: float, window_s: float = 0.5, timeout_s: float) -> bool:
    """Wait until the machine's CPUs were busy less than `busy_below` (a fraction) over
    one `window_s` window; False if that did not happen within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy_before, idle_before = _machine_seconds()
        time.sleep(window_s)
        busy_after, idle_after = _machine_seconds()
        busy = busy_after - busy_before
        if busy < busy_below * (busy + idle_after - idle_before):
            return True
        if time.monotonic() > deadline:
            return False
