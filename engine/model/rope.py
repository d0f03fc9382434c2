"""Rotary position embedding: one precomputed cos/sin table, read by position.

Angles are computed exactly as Hugging Face Llama does (float32 inverse frequencies
times float32 positions), in the half-split layout, so logits agree with the
reference to float32 rounding. Llama 3 frequency scaling comes either from the config
(`rope_scaling == "llama3"`) or, in GGUF files, as a tensor of per-frequency divisors.
"""

from __future__ import annotations

import math

import torch

from wavecore.engine.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, rope_freqs: torch.Tensor | None) -> torch.Tensor:
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.to(torch.float32)
    if config.rope_scaling == "llama3":
        inv_freq = _llama3_scaled(inv_freq, config)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = config.rope_scaling_factor
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    original = config.rope_original_context_length
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, blended, scaled)


class RotaryTable:
    """cos and sin of every (position, frequency) up to `max_positions`."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        *,
        rope_freqs: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        inv_freq = inverse_frequencies(config, rope_freqs)
        positions = torch.arange(max_positions, dtype=torch.float32)
        if config.rope_scaling == "linear":
            positions = positions / config.rope_scaling_factor
        angles = positions[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        # Full-width tables: the half-split rotation of x = (a, b) is
        # x * (cos, cos) + (b, a) * (-sin, sin), three ops per layer instead of eight.
        self.cos = torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype)
        self.signed_sin = torch.cat([-sin, sin], dim=-1).to(device=device, dtype=dtype)
        self.half = config.head_dim // 2

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[tokens, 1, head_dim]` for `positions`; shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[tokens, heads, head_dim]` by `lookup`'s angles; returns a new tensor."""
        return torch.addcmul(x * cos, x.roll(self.half, dims=-1), signed_sin)
