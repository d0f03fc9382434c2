"""The torch profiler on one rank (`Engine.start_profile` / `stop_profile`): upstream's
`profile(start or stop)` on every worker.

It is started and stopped on the rank's model thread, where the forwards run, between
loop iterations (`core.rank_calls`); CPU activity always, CUDA too where the rank has
a GPU. Stopping writes one Chrome trace JSON file, which Perfetto and chrome://tracing
load, named by the time the profile started, the rank's number and its member id
(`RankAssignment.member`, which a shrink does not renumber) and its pid.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from wavecore.engine.errors import ProfilerStateError


class RankProfiler:
    def __init__(self) -> None:
        self._profile: Any = None
        self._trace: Path | None = None

    def start(self, directory: str, *, rank: int, member: int) -> None:
        """Start profiling; its trace goes into `directory` (made if missing)."""
        if self._profile is not None:
            raise ProfilerStateError(f"the profiler already runs, into {self._trace}")
        import torch
        from torch.profiler import ProfilerActivity, profile

        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"wavecore-{stamp}-rank{rank}-member{member}-pid{os.getpid()}.trace.json"
        started = profile(activities=activities)
        started.start()
        self._profile, self._trace = started, folder / name

    def stop(self) -> str:
        """Stop profiling and write the trace; its path."""
        if self._profile is None or self._trace is None:
            raise ProfilerStateError("the profiler is not running: call start_profile first")
        running, trace = self._profile, self._trace
        self._profile = self._trace = None
        running.stop()
        running.export_chrome_trace(str(trace))
        return str(trace)
