"""Errors every executor raises alike (the model's and the null one)."""

from __future__ import annotations

from wavecore.engine.errors import EngineError


class ExecutorAsleepError(EngineError):
    """The executor was asked to run while its weights or KV cache are released."""


class ExecutorClosedError(EngineError):
    """The executor was used after `close()`."""
