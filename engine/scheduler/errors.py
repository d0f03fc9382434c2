"""Errors the scheduler raises for bad input or misuse, each naming what was wrong."""

from __future__ import annotations


class DuplicateRequestError(ValueError):
    """A request id was added while a request with the same id is still live."""


class InvalidPromptError(ValueError):
    """A prompt is empty or holds something other than non-negative int token ids."""


class PromptTooLongError(ValueError):
    """A prompt can never be scheduled: it leaves no room for one output token within
    `max_model_len` or within the whole KV pool."""


class StepOrderError(RuntimeError):
    """`schedule()` and `update()` were not called alternately, or `update()` got an
    output that is not the one the last `schedule()` returned."""


class OutputMismatchError(RuntimeError):
    """The executor's `ModelOutput` does not match the batch it was given."""
