"""Paged KV cache bookkeeping: which block ids each request holds, and which can be reused.

The pool has `num_blocks` blocks with ids in `[0, num_blocks)`, each holding the KV of
`block_size` consecutive token positions. Nothing is reserved implicitly (an executor
that needs a scratch block keeps it outside this pool).

Every mutation comes as a query-then-commit pair, so the scheduler can ask before it
acts and a refused request leaves nothing half done:

- `lookup_prefix` / `can_allocate` / `allocate`: give a new request its first blocks,
  reusing cached blocks for the longest cached prefix of its tokens.
- `can_append` / `append`: grow a running request's table to cover more positions.
- `free`: give a request's blocks back (reference counts drop; a block is reusable
  once nobody references it).

Prefix caching. Once the KV of a FULL block has been computed, `cache_full_blocks`
registers it under a chained key `(parent_hash, tokens)`, where `parent_hash` is the
hash of the previous block's key (0 for the first block). A key therefore names the
whole prefix up to the end of its block, and the dict compares keys by value, so a
hash collision can at worst confuse two prefixes whose parent hashes collide (2^-64).
Blocks are registered only after their KV exists, so a same-step lookup never shares
a block whose KV is still being written.

A block that nobody references but that holds a cached prefix stays in an LRU of
"cached free" blocks: it counts as free, is handed out again on a prefix hit, and is
evicted (its key dropped) only when plain free blocks run out. `free` releases a
table tail first, so a request's last blocks are evicted before its shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Key of one cached block: (hash of the parent block's key, this block's tokens).
BlockKey = tuple[int, tuple[int, ...]]


class BlockPoolExhaustedError(RuntimeError):
    """A commit asked for more free blocks than exist (its query was skipped or stale)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHit:
    """The longest cached prefix of a token list: its blocks and their chained hashes."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    num_tokens: int
    # Length of the token list that was looked up, for the hit rate.
    num_queried_tokens: int


class BlockManager:
    """Reference-counted KV blocks with an LRU prefix cache. See the module docstring."""

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._key_to_block: dict[BlockKey, int] = {}
        # Unreferenced blocks holding nothing worth keeping; popped from the end.
        self._plain_free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks holding a cached prefix, least recently freed first.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._lookup_tokens = 0
        self._hit_tokens = 0
        # The same, since start and never reset: monotonic counters for monitoring.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Tokens found cached over tokens looked up, since start or the last reset."""
        return self._hit_tokens / self._lookup_tokens if self._lookup_tokens else 0.0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered in the prefix cache."""
        return self._block_keys[block_id] is not None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, token_ids: list[int], root: int = 0) -> PrefixHit:
        """The longest cached run of full blocks at the start of `token_ids`.

        At least one token is always left uncached, because the model must run a
        token to produce the logits of the next one. Pure; `allocate` counts the
        lookup in the hit rate, so a refused admission retried later counts once.
        """
        num_tokens = len(token_ids)
        size = self.block_size
        block_ids: list[int] = []
        block_hashes: list[int] = []
        if self.enable_prefix_caching:
            parent = root
            for start in range(0, (num_tokens - 1) // size * size, size):
                key = (parent, tuple(token_ids[start : start + size]))
                block_id = self._key_to_block.get(key)
                if block_id is None:
                    break
                parent = hash(key)
                block_ids.append(block_id)
                block_hashes.append(parent)
        return PrefixHit(
            block_ids=tuple(block_ids),
            block_hashes=tuple(block_hashes),
            num_tokens=len(block_ids) * size,
            num_queried_tokens=num_tokens,
        )

    def can_allocate(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether `allocate(hit, num_tokens)` would succeed now."""
        return self._blocks_to_take(hit, num_tokens) <= self.num_free_blocks

    def can_append(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether `append(block_table, num_tokens)` would succeed now."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        return missing <= 0 or missing <= len(self._plain_free) + len(self._cached_free)

    # -- commits -------------------------------------------------------------------

    def allocate(self, hit: PrefixHit, num_tokens: int) -> list[int]:
        """A new block table covering positions `[0, num_tokens)`, sharing `hit`'s blocks."""
        if num_tokens < hit.num_tokens:
            raise ValueError(
                f"num_tokens ({num_tokens}) is below the prefix hit ({hit.num_tokens})"
            )
        if not self.can_allocate(hit, num_tokens):
            raise BlockPoolExhaustedError(
                f"{self._blocks_to_take(hit, num_tokens)} blocks needed, {self.num_free_blocks} free"
            )
        ref_counts = self._ref_counts
        for block_id in hit.block_ids:
            if ref_counts[block_id] == 0:
                del self._cached_free[block_id]
            ref_counts[block_id] += 1
        table = list(hit.block_ids)
        self._take_new(table, self.blocks_needed(num_tokens) - len(table))
        if self.enable_prefix_caching:
            self._lookup_tokens += hit.num_queried_tokens
            self._hit_tokens += hit.num_tokens
            self.prefix_cache_queries += hit.num_queried_tokens
            self.prefix_cache_hits += hit.num_tokens
        return table

    def append(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place to cover positions `[0, num_tokens)`."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return
        if missing > self.num_free_blocks:
            raise BlockPoolExhaustedError(f"{missing} blocks needed, {self.num_free_blocks} free")
        self._take_new(block_table, missing)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block of `block_table`, tail first."""
        ref_counts = self._ref_counts
        keys = self._block_keys
        for block_id in reversed(block_table):
            count = ref_counts[block_id] - 1
            if count < 0:
                raise ValueError(f"block {block_id} freed more often than it was allocated")
            ref_counts[block_id] = count
            if count == 0:
                if keys[block_id] is None:
                    self._plain_free.append(block_id)
                else:
                    self._cached_free[block_id] = None

    def cache_full_blocks(
        self,
        block_table: list[int],
        block_hashes: list[int],
        token_ids: list[int],
        num_computed_tokens: int,
        root: int = 0,
    ) -> None:
        """Register the full blocks whose KV is now computed, extending `block_hashes`.

        `block_hashes` holds the chained hash of each already registered block of this
        request; it is extended in place. When another block already holds the same
        prefix (two requests computed it at once), this one stays unregistered.
        """
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        parent = block_hashes[-1] if block_hashes else root
        for index in range(len(block_hashes), num_computed_tokens // size):
            start = index * size
            key = (parent, tuple(token_ids[start : start + size]))
            block_id = block_table[index]
            if key not in self._key_to_block and self._block_keys[block_id] is None:
                self._key_to_block[key] = block_id
                self._block_keys[block_id] = key
            parent = hash(key)
            block_hashes.append(parent)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay allocated but are no longer shared."""
        for block_id in self._cached_free:
            self._plain_free.append(block_id)
        self._cached_free.clear()
        self._key_to_block.clear()
        self._block_keys = [None] * self.num_blocks
        self._lookup_tokens = 0
        self._hit_tokens = 0

    # -- internals -----------------------------------------------------------------

    def _blocks_to_take(self, hit: PrefixHit, num_tokens: int) -> int:
        # A hit block nobody references leaves the free pool when it is reused.
        revived = sum(1 for block_id in hit.block_ids if self._ref_counts[block_id] == 0)
        return self.blocks_needed(num_tokens) - len(hit.block_ids) + revived

    def _take_new(self, table: list[int], count: int) -> None:
        plain = self._plain_free
        cached = self._cached_free
        ref_counts = self._ref_counts
        for _ in range(count):
            if plain:
                block_id = plain.pop()
            else:
                block_id, _ = cached.popitem(last=False)
                key = self._block_keys[block_id]
                self._block_keys[block_id] = None
                del self._key_to_block[key]
            ref_counts[block_id] = 1
            table.append(block_id)
