"""`KernelCache`: measured kernel plans kept on disk, so a machine measures once.

One JSON file (`$XDG_CACHE_HOME/wavecore/kernels.json`, else `~/.cache/wavecore/`)
maps a key to a plan. The key names everything the measurement depended on (the CPU
model, torch's version, the thread count, the dtype, the weight format and the
projection shapes), so a plan is reused only where it was measured.

Rules:
1. The cache is an optimization only: a file that cannot be read or parsed, or an
   entry that is not a valid plan, is ignored with a `KernelCacheWarning` (the plan
   is measured again and the file rewritten); a file that cannot be written is too.
2. Writes replace the file atomically (a temporary file renamed over it), so a reader
   never sees half a file; two processes measuring at once both write, the last wins.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

from wavecore.engine.model.kernel_plan import KernelPlan

_VERSION = 1


class KernelCacheWarning(UserWarning):
    pass


def default_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "wavecore" / "kernels.json"


class KernelCache:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else default_cache_path()

    def load(self, key: str) -> KernelPlan | None:
        """The plan stored under `key`, or None (absent, or unusable: warned)."""
        entry = self._entries().get(key)
        if entry is None:
            return None
        try:
            return KernelPlan.from_dict(entry)
        except (TypeError, ValueError) as error:
            warnings.warn(
                f"ignoring a stale entry of the kernel cache {self.path}: {error}",
                KernelCacheWarning,
                stacklevel=2,
            )
            return None

    def store(self, key: str, plan: KernelPlan) -> None:
        entries = self._entries(quiet=True)
        entries[key] = plan.as_dict()
        text = json.dumps({"version": _VERSION, "plans": entries}, indent=1, sort_keys=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(handle, "w") as file:
                file.write(text)
            os.replace(temporary, self.path)
        except OSError as error:
            warnings.warn(
                f"could not write the kernel cache {self.path}: {error}",
                KernelCacheWarning,
                stacklevel=2,
            )

    def _entries(self, *, quiet: bool = False) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            return self._ignore(f"{error}", quiet)
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            return self._ignore(f"not a version-{_VERSION} kernel cache", quiet)
        plans = data.get("plans")
        if not isinstance(plans, dict) or not all(isinstance(v, dict) for v in plans.values()):
            return self._ignore("its plans are not a mapping of mappings", quiet)
        return plans

    def _ignore(self, why: str, quiet: bool) -> dict[str, dict[str, object]]:
        if not quiet:
            warnings.warn(
                f"ignoring the kernel cache {self.path}: {why}", KernelCacheWarning, stacklevel=3
            )
        return {}
