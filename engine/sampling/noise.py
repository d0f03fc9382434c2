"""Exponential noise for the sampling race, seeded per request or shared.

Sampling from `probs` is done as `argmax(probs / E)` with `E` i.i.d. Exponential(1):
the token whose exponential "arrival time" scaled by its probability comes first
wins, which picks token `i` with probability `probs[i]`. It needs no cumulative sums
and no `multinomial`, and all the randomness sits in `E`, so a seeded request only
needs its own row of noise to be reproducible.

A seeded request's row comes from a fresh generator seeded with a 64-bit mix of
(seed, position), position being the number of outputs so far. Its noise, and hence
its token, therefore depends only on the seed, the position, the vocabulary size and
the device, never on which other requests share the batch. Unseeded rows draw from
one generator per device owned by the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    # SplitMix64's finaliser: a cheap bijective mix, so nearby (seed, position) pairs
    # give unrelated generator seeds.
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def row_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded request's draw at `position` (63 bits)."""
    return _splitmix64(_splitmix64(seed) ^ position) >> 1


class NoiseSource:
    """Fills rows of exponential noise; holds the generators for unseeded requests."""

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._shared[device] = generator
        return generator

    def exponential(
        self,
        shape: tuple[int, int],
        seeds: Sequence[int | None],
        positions: Sequence[int],
        device: torch.device,
    ) -> torch.Tensor:
        """`shape[0]` rows of Exponential(1) noise; row `i` reproducible if `seeds[i]` is set."""
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        if len(unseeded) == shape[0]:
            noise.exponential_(generator=self._shared_generator(device))
        elif unseeded:
            shared = torch.empty((len(unseeded), shape[1]), dtype=torch.float32, device=device)
            shared.exponential_(generator=self._shared_generator(device))
            noise[unseeded] = shared
        for i, seed in enumerate(seeds):
            if seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(row_seed(seed, positions[i]))
                noise[i].exponential_(generator=generator)
        # exponential_ may return exactly 0; dividing by it would let a token of zero
        # probability win (0 / 0), so the smallest normal float stands in.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)
