"""The machine a benchmark ran on, named in every result: figures from one CPU do not
carry over to another (a kernel tuned on an AMD EPYC ran 1.5x slower on an Intel Xeon)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it, or the architecture if unknown."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def describe() -> dict[str, object]:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version()}
