"""The machine a benchmark ran on, named in every result: figures from one CPU do not
carry over to another (a kernel tuned on an AMD EPYC ran 1.5x slower on an Intel Xeon).
The CPU's name comes from the engine's kernel choice, which keys its cache by it."""

from __future__ import annotations

import os
import platform

from wavecore.engine.model.kernel_choice import cpu_name

__all__ = ["cpu_name", "describe"]


def describe() -> dict[str, object]:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version()}
