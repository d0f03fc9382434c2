"""Errors of the model runtime: loading a model and running a batch on it."""

from __future__ import annotations

from wavecore.engine.errors import EngineError


class ModelLoadError(EngineError):
    """A model could not be found or read: the message names the file and the problem."""


class InvalidBatchError(EngineError, ValueError):
    """A batch broke the executor's contract; it was refused before any KV write."""


class CompileDecodeError(ModelLoadError):
    """`compile_decode=True`, but torch.compile could not compile the decode step (no C++
    compiler, or inductor failed): the message says which."""
