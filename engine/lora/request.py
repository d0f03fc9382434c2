"""`LoRARequest`: an adapter by name and the directory it loads from (PEFT's format).

Plain data, shared by the front end (which keeps the engine's set of adapters) and the
ranks (which load them), so neither imports the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter `name` (what requests and `/v1/models` call it) and `path`, a
    directory with `adapter_config.json` and `adapter_model.safetensors` as PEFT's
    `save_pretrained` writes them."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise ValueError(
                f"LoRARequest.name must be a non-empty str without surrounding spaces, "
                f"got {self.name!r}"
            )
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LoRARequest.path must be a directory path, got {self.path!r}")
        # The ranks share this machine's file system: they read the path as it is here.
        object.__setattr__(self, "path", os.path.abspath(os.path.expanduser(self.path)))
