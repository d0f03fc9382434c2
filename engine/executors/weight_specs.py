"""Checking a weight update against what an executor holds, before anything changes.

An executor that can take new weights while serving (`UpdatableExecutor`) states the
tensors it holds as `{name: shape}` under canonical names (`model.source` lists the
model's). `check_update` refuses, naming the tensor and where it came from, any name
the executor does not hold, any shape that differs, any non-floating dtype and, unless
the update is `partial`, any tensor left out. Executors convert floating dtypes to
their own; torch is not imported here (the tensors bring their own dtype objects).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from wavecore.engine.errors import WeightUpdateError


class UpdatableExecutor(Protocol):
    """What an executor offers for `update_weights`; runs on the model thread.

    `stage_weights` checks and prepares everything (the slow part) and changes nothing
    the executor serves with; `commit_weights` swaps the staged weights in and cannot
    fail; a staged update that is never committed is simply dropped.
    """

    def weight_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def stage_weights(
        self, tensors: Mapping[str, Any], *, partial: bool, origin: str
    ) -> object: ...

    def commit_weights(self, staged: object) -> None: ...


def check_update(
    tensors: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]],
    *,
    partial: bool,
    origin: str,
) -> None:
    """Raise `WeightUpdateError` for the first thing wrong with `tensors` (see above)."""
    if not tensors:
        raise WeightUpdateError(f"{origin}: holds no tensors")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise WeightUpdateError(
            f"{origin}: tensor {extra[0]!r} is not a weight of the loaded model"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    if not partial:
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise WeightUpdateError(
                f"{origin}: tensor {missing[0]!r} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + "; pass partial=True to update a subset"
            )
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        if shape != expected[name]:
            raise WeightUpdateError(
                f"{origin}: tensor {name!r} has shape {shape}, the model's is {expected[name]}"
            )
        if not tensor.dtype.is_floating_point:
            raise WeightUpdateError(
                f"{origin}: tensor {name!r} has dtype {tensor.dtype}, expected a floating dtype"
            )
