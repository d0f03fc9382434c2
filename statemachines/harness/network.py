"""The simulated transport: one FIFO channel per (sender, receiver) pair.

Messages from one sender to one receiver arrive in the order sent (one nng
connection); channels from different senders are independent, so a receiver sees
their messages interleaved in any order, and any message may stay in flight across
any number of moves of the other parties.
"""

from __future__ import annotations

CLIENT, COORDINATOR, DUPLICATOR = "client", "coordinator", "network"
Party = int | str
Message = tuple[object, ...]
# One move of the world (``world`` rule 2): a delivery, a rank's step, a client's act.
Move = tuple[object, ...]
Pair = tuple[Party, Party]


class Network:
    """The channels in flight; a value (``copy`` and ``key``) like the rest of a world."""

    def __init__(self, channels: dict[Pair, tuple[Message, ...]] | None = None) -> None:
        self.channels: dict[Pair, tuple[Message, ...]] = channels if channels is not None else {}

    def copy(self) -> Network:
        return Network(dict(self.channels))

    def key(self) -> frozenset[tuple[Pair, tuple[Message, ...]]]:
        return frozenset(self.channels.items())

    def __bool__(self) -> bool:
        return bool(self.channels)

    def __contains__(self, pair: object) -> bool:
        return pair in self.channels

    def pairs(self) -> list[Pair]:
        return list(self.channels)

    def send(self, sender: Party, receiver: Party, message: Message) -> None:
        self.channels[sender, receiver] = (*self.channels.get((sender, receiver), ()), message)

    def pop(self, sender: Party, receiver: Party) -> Message:
        head, *rest = self.channels[sender, receiver]
        if rest:
            self.channels[sender, receiver] = tuple(rest)
        else:
            del self.channels[sender, receiver]
        return head

    def keep(self, sender: Party, receiver: Party, messages: tuple[Message, ...]) -> None:
        """Leave exactly ``messages`` in flight on one channel."""
        if messages:
            self.channels[sender, receiver] = messages
        else:
            self.channels.pop((sender, receiver), None)

    def take(self, sender: Party, receiver: Party) -> tuple[Message, ...]:
        """Remove and return everything in flight on one channel."""
        return self.channels.pop((sender, receiver), ())

    def renumbered(self, new: dict[int, int]) -> Network:
        """The channels after a shrink: rank ``old`` is now rank ``new[old]``; a rank
        missing from ``new`` has none left (its channels went with it)."""
        channels: dict[Pair, tuple[Message, ...]] = {}
        for (sender, receiver), messages in self.channels.items():
            ends = [new.get(end) if isinstance(end, int) else end for end in (sender, receiver)]
            if None not in ends:
                channels[ends[0], ends[1]] = messages  # type: ignore[index]
        return Network(channels)
