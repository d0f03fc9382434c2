"""`KernelPlan`: which matrix kernel a projection product uses, by the number of rows.

A product `x @ W` is classed by the rows of `x` (tokens in the pass, or sampling rows
for the LM head); each class has one kernel:

| class | rows | typical step |
|---|---|---|
| decode | 1 | one sequence decoding |
| small | 2-8 | a few decodes |
| large | 9-128 | many decodes |
| prefill | over 128 | prompt chunks |

Kernels (`linear.Projection` runs them):
- "blas": `x @ W` on a plain `[in, out]` matrix, torch's BLAS (MKL on x86 builds);
- "onednn": oneDNN's linear on the matrix reordered once into its blocked layout;
- "onednn-bf16": oneDNN's linear on the matrix rounded to bfloat16 (AMX or AVX-512
  BF16 CPUs only), float32 in and out;
- "fbgemm": fbgemm's int8 dynamic linear (`int8_linear.Int8Projection`), the only
  kernel of int8 weights; it is named in plans so reports say what ran;
- "woq": torch's CPU weight-only products, 4 bits where the weights are 4-bit groups
  (a GGUF's Q4_1 blocks), else 8 bits per channel, bfloat16 activations
  (`woq_linear.WeightOnlyProjection`);
- "woq-vnni": the same weights, multiplied by activations rounded to int8 per group
  of 32 through AVX-512 VNNI dot products, a C kernel built on the machine
  (`vnni_linear.VnniProjection`; CPUs with AVX-512 VNNI only).

With `weights="auto"` one plan may mix all six (`kernel_choice.py`): each class runs
the fastest within the accuracy budget (`quality.py`), so the plan names the dtype that ran too.

`WAVECORE_KERNELS` forces kernels instead of measuring them (tests, benchmarks): one
name for every class ("blas"), or `class=kernel` pairs ("decode=blas,large=onednn");
classes it does not name are measured as usual.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Literal

Kernel = Literal["blas", "onednn", "onednn-bf16", "fbgemm", "woq", "woq-vnni"]
KERNELS: tuple[Kernel, ...] = ("blas", "onednn", "onednn-bf16", "fbgemm", "woq", "woq-vnni")
SHAPE_CLASSES = ("decode", "small", "large", "prefill")
# The last row count of each class but the open-ended prefill.
# "small" ends at 8: the weight-only kernel, which reads the weights again for each
# row, led oneDNN's bfloat16 by 9% at 8 rows and trailed it by 20% at 16 (SmolLM2 on
# the README's Xeon), and a class is measured at its last row count.
_LAST_ROWS = {"decode": 1, "small": 8, "large": 128}
FORCE_ENV = "WAVECORE_KERNELS"


def shape_class(rows: int) -> str:
    for name, last in _LAST_ROWS.items():
        if rows <= last:
            return name
    return "prefill"


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelPlan:
    decode: Kernel
    small: Kernel
    large: Kernel
    prefill: Kernel

    @classmethod
    def uniform(cls, kernel: Kernel) -> KernelPlan:
        return cls(decode=kernel, small=kernel, large=kernel, prefill=kernel)

    @classmethod
    def from_dict(cls, kernels: dict[str, object]) -> KernelPlan:
        """From `{class: kernel}` naming every class; a ValueError names what is wrong."""
        if sorted(kernels) != sorted(SHAPE_CLASSES):
            raise ValueError(f"a kernel plan names {list(SHAPE_CLASSES)}, got {sorted(kernels)}")
        for name, kernel in kernels.items():
            if kernel not in KERNELS:
                raise ValueError(f"unknown kernel {kernel!r} for {name}; known: {list(KERNELS)}")
        return cls(**kernels)  # type: ignore[arg-type]

    def for_rows(self, rows: int) -> Kernel:
        # Inline the common case: this runs for every product of every step.
        if rows == 1:
            return self.decode
        return getattr(self, shape_class(rows))

    def as_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def uses(self, kernel: Kernel) -> bool:
        return kernel in self.as_dict().values()


def forced_kernels(value: str | None = None) -> dict[str, Kernel]:
    """The classes `WAVECORE_KERNELS` (or `value`) forces, with their kernels; a
    ValueError for a malformed setting (it is an explicit request, so never ignored)."""
    text = (os.environ.get(FORCE_ENV, "") if value is None else value).strip()
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(SHAPE_CLASSES, _kernel(text))
    forced: dict[str, Kernel] = {}
    for pair in text.split(","):
        name, _, kernel = (part.strip() for part in pair.partition("="))
        if name not in SHAPE_CLASSES:
            raise ValueError(
                f"{FORCE_ENV}: unknown shape class {name!r}; known: {list(SHAPE_CLASSES)}"
            )
        forced[name] = _kernel(kernel)
    return forced


def _kernel(name: str) -> Kernel:
    if name not in KERNELS:
        raise ValueError(f"{FORCE_ENV}: unknown kernel {name!r}; known: {list(KERNELS)}")
    return name  # type: ignore[return-value]
