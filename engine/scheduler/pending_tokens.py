"""A request's token list as a step scheduled ahead (the batch queue) will see it.

With `async_scheduling` the scheduler picks step N+1 while step N runs, so a request
that samples in N runs, in N+1, a token nobody knows yet: the sample of N. Its chunk
then carries a one-element list holding `PLACEHOLDER`, filled in on the model thread
right before N+1's forward (`SchedulerOutput.resolve_placeholders`), and, as its
`all_token_ids`, a `PendingTokens`: the request's known tokens followed by that slot.

Why a view and not the scheduler's own list: the event loop appends N's sample to that
list (N's update) while N+1's forward may already read it, so its length would depend
on timing; the view has a fixed length and reads only indices the list already held
when the step was scheduled (the list only grows, and a freed request keeps its list).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import overload

# What a placeholder slot holds until it is resolved; not a token id, so a forward that
# ran on an unresolved slot would fail the model's vocabulary checks instead of
# silently computing with a wrong token.
PLACEHOLDER = -1


class PendingTokens(Sequence[int]):
    """`known[:length - 1]`, then `last[0]`; see the module docstring."""

    __slots__ = ("_known", "_last", "_length")

    def __init__(self, known: list[int], length: int, last: list[int]) -> None:
        self._known = known
        self._length = length
        self._last = last

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        length = self._length
        if isinstance(index, slice):
            return [*self._known[: length - 1], *self._last][index]
        position = index + length if index < 0 else index
        if not 0 <= position < length:
            raise IndexError(f"token index {index} out of range for {length} tokens")
        return self._last[0] if position == length - 1 else self._known[position]

    def __iter__(self) -> Iterator[int]:
        yield from islice(self._known, self._length - 1)
        yield self._last[0]

    def __repr__(self) -> str:
        return f"PendingTokens({list(self)!r})"
