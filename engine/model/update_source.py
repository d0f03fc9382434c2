"""Reading the tensors of a weight update: a file, a directory or a mapping.

A source is a safetensors file, a directory of `*.safetensors` files (an HF-style
checkpoint; its `config.json` is not needed), a GGUF file (dequantized to float32 as at
load), or a mapping of names to `torch.Tensor`s. Hugging Face names
(`model.layers.0.self_attn.q_proj.weight`) become canonical ones (`layers.0.q`, see
`model.source`); any other name is kept as it is, so that the executor's check names
what it does not hold. Safetensors keep their dtype until the executor converts them.
Every failure is a `WeightUpdateError` naming the file (and tensor).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from wavecore.engine.errors import WeightUpdateError
from wavecore.engine.model.errors import ModelLoadError
from wavecore.engine.model.gguf_format import GGUF_MAGIC, read_magic
from wavecore.engine.model.hf_directory import canonical_tensor_name


def canonical_tensors(tensors: Mapping[str, Any], origin: str) -> dict[str, torch.Tensor]:
    """A mapping's tensors under canonical names; refuses values that are not tensors."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise WeightUpdateError(f"{origin}: tensor names must be str, got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise WeightUpdateError(
                f"{origin}: {key!r} is a {type(value).__name__}, not a torch.Tensor"
            )
        name = canonical_tensor_name(key) or key
        if name in out:
            raise WeightUpdateError(f"{origin}: tensor {name!r} is given twice (as {key!r})")
        out[name] = value
    return out


def read_update_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, a directory of them, or a GGUF file."""
    location = Path(path).expanduser()
    if location.is_dir():
        files = sorted(location.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"{location}: no *.safetensors files in this directory")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            for name, tensor in _read_safetensors(file).items():
                if name in tensors:
                    raise WeightUpdateError(f"{file}: tensor {name!r} is also in another file")
                tensors[name] = tensor
        return tensors
    if not location.is_file():
        raise WeightUpdateError(f"{location}: no such weight file or directory")
    try:
        magic = read_magic(location)
    except OSError as error:
        raise WeightUpdateError(f"{location}: cannot be read ({error})") from error
    if magic == GGUF_MAGIC:
        return _read_gguf(location)
    return _read_safetensors(location)


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            raw = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, RuntimeError) as error:
        raise WeightUpdateError(f"{file}: not a readable safetensors file ({error})") from error
    return canonical_tensors(raw, str(file))


def _read_gguf(file: Path) -> dict[str, torch.Tensor]:
    from wavecore.engine.model.gguf_file import read_gguf

    try:
        tensors = read_gguf(file).load_tensors()
    except ModelLoadError as error:
        raise WeightUpdateError(str(error)) from error
    # Derived from the configuration at load, never trained: not part of an update.
    tensors.pop("rope_freqs", None)
    return tensors
