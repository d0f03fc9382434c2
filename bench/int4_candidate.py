"""4-bit weights as a batch-1 candidate: torch's CPU int4 weight-packed product against
the float32 and bf16 products on SmolLM2-135M's projection shapes, one row, same run.

Issue 27 asks for batch-1 decode at llama.cpp's speed, which the bytes allow only with
about 4 bits per weight, read by a maintained kernel. torch's CPU build ships one:
`aten._weight_int4pack_mm_for_cpu` (weights packed by
`_convert_weight_to_int4pack_for_cpu`, groups of 32 with a scale and a zero each, as
torchao's int4 weight-only quantization uses it). This measures it before any engine
work: per shape, the median time of one 1-row product on one thread (the engine's
threads share two cores with nothing else then, so a single thread isolates the
kernel), alternating kernels each round, and the share of the memory roof each
reaches for its own bytes (the roof: this machine's streaming rate, measured in the
same run as in `bench/model.py`; a weight that fits in the caches, as all but the LM
head do, is read faster than that, so only the LM head's share says how near the roof
a kernel streams). The int4 error against the dequantized weights is printed too (it
must be rounding only). The kernel is timed twice: with float32 activations, and
with bfloat16 ones (its vectorized path, the one the engine's "woq" kernel takes).

Prints a table, writes bench/results/int4_candidate.json.
Usage: python bench/int4_candidate.py [--rounds N] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import describe

RESULTS = Path(__file__).resolve().parent / "results" / "int4_candidate.json"
# SmolLM2-135M: fused qkv, o, fused gate-up, down, the LM head (in, out).
SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
GROUP = 32


def median_us(call: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def stream_gbps() -> float:
    """One thread's rate streaming a 256 MiB float32 matrix through a vector product."""
    matrix = torch.randn(256 * 2**20 // 4 // 4096, 4096)
    vector = torch.randn(4096)
    seconds = median_us(lambda: matrix @ vector, 5) / 1e6
    return matrix.numel() * 4 / seconds / 1e9


def int4_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of `GROUP`: the packed weight, torch's scales-and-zeros
    (`w = (q - 8) * scale + zero`), and the dequantized weight they stand for."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-6) / 15
    codes = ((groups - low) / scale).round().clamp(0, 15)
    dequantized = (codes * scale + low).reshape(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).reshape(out_features, in_features), 1
    )
    zero = low + 8 * scale
    scales_and_zeros = torch.stack(
        [scale.reshape(out_features, -1).t(), zero.reshape(out_features, -1).t()], dim=-1
    ).contiguous()
    return packed, scales_and_zeros, dequantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    machine = describe()
    roof = stream_gbps()
    print(
        f"4-bit candidate, one row, one thread ({machine['cpu']}; streaming roof {roof:.1f} GB/s)"
    )
    print(f"{'shape':<8} {'in x out':>12} {'f32 us':>8} {'bf16 us':>8} {'int4 us':>8} {'int4/f32':>8} {'int4 bf16-in us':>15} {'/f32':>6} {'f32 roof':>8} {'int4 roof':>9} {'bf16-in roof':>12} {'int4 err':>9}")  # fmt: skip
    rows = []
    for name, (in_features, out_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features) * 0.05
        row = torch.randn(1, in_features)
        packed, scales_and_zeros, dequantized = int4_weights(weight)
        weight_bf16, row_bf16 = weight.to(torch.bfloat16), row.to(torch.bfloat16)

        def int4(row=row, packed=packed, scales=scales_and_zeros) -> torch.Tensor:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(row, packed, GROUP, scales)

        # The same product with bfloat16 activations (and scales): the kernel's
        # vectorized path, which the engine's "woq" kernel takes.
        scales_bf16 = scales_and_zeros.to(torch.bfloat16)

        def int4_bf16_in(row=row_bf16, packed=packed, scales=scales_bf16) -> torch.Tensor:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(row, packed, GROUP, scales)

        error = (int4() - row @ dequantized.t()).abs().max().item()
        float32_us = median_us(lambda: F.linear(row, weight), args.rounds)  # noqa: B023
        bf16_us = median_us(lambda: F.linear(row_bf16, weight_bf16), args.rounds)  # noqa: B023
        int4_us = median_us(int4, args.rounds)
        int4_bf16_in_us = median_us(int4_bf16_in, args.rounds)
        elements = in_features * out_features
        result = {
            "shape": name,
            "in_features": in_features,
            "out_features": out_features,
            "float32_us": float32_us,
            "bf16_us": bf16_us,
            "int4_us": int4_us,
            "int4_bf16_in_us": int4_bf16_in_us,
            "float32_roof_share": elements * 4 / (float32_us / 1e6) / 1e9 / roof,
            "int4_roof_share": elements / 2 / (int4_us / 1e6) / 1e9 / roof,
            "int4_bf16_in_roof_share": elements / 2 / (int4_bf16_in_us / 1e6) / 1e9 / roof,
            "int4_max_error": error,
        }
        rows.append(result)
        print(
            f"{name:<8} {in_features:>5} x {out_features:<5} {float32_us:>8.0f} {bf16_us:>8.0f} "
            f"{int4_us:>8.0f} {int4_us / float32_us:>7.1f}x {int4_bf16_in_us:>15.0f} "
            f"{int4_bf16_in_us / float32_us:>5.2f}x {result['float32_roof_share']:>8.0%} "
            f"{result['int4_roof_share']:>9.0%} {result['int4_bf16_in_roof_share']:>12.0%} "
            f"{error:>9.1e}"
        )
    args.output.parent.mkdir(exist_ok=True)
    args.output.write_text(
        json.dumps({"machine": machine, "stream_gbps": roof, "rows": rows}, indent=2) + "\n"
    )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
