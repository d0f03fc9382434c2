"""LoRA deltas through the C kernel (`delta_kernel.c`): one call per fused product per
step, whatever the adapters and however their rows lie in the batch.

`NativeAdapter` is an adapter as the kernel reads it: per layer and fused product a
descriptor (`_Delta`) of its `a` (its columns padded with zeros to a multiple of 16, the
kernel's vector width) and its targets' `b` blocks, in float32, or in bfloat16 beside
a base whose kernels round to it (half the bytes a step streams; the sums stay float32),
laid out in pairs of rows where the CPU has AVX-512 BF16 (`_in_pairs`). Each
descriptor is checked against the model's shapes here, because the kernel trusts them.
`NativeRows` is one step: each row's adapter (`owner`, -1 for the base model)
and the step's adapters' tables; `add` runs the kernel on one product.

Measured against torch's products (the grouped and stacked paths of `compute.py`) in
`bench/lora.py`; the README says what each costs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from wavecore.engine.lora.adapters import PRODUCTS, Adapter, FusedDelta, fused_parts
from wavecore.engine.lora.peft_files import projection_shape
from wavecore.engine.native_build import KernelBuild, KernelSource, build

if TYPE_CHECKING:  # the model package imports this one (through its executor)
    from wavecore.engine.model.config import ModelConfig

DELTA_KERNEL = KernelSource(
    Path(__file__).with_name("delta_kernel.c"), "lora_delta", "WAVECORE_LORA_KERNEL"
)
_VECTOR = 16  # floats per vector in the kernel: `a`'s columns are padded to a multiple
_ENTRY = {product: index for index, product in enumerate(PRODUCTS)}


class _Block(ctypes.Structure):
    _fields_ = [
        ("start", ctypes.c_int32),
        ("stop", ctypes.c_int32),
        ("out_start", ctypes.c_int32),
        ("out_stop", ctypes.c_int32),
        ("b", ctypes.c_void_p),
    ]


class _Delta(ctypes.Structure):
    _fields_ = [
        ("a", ctypes.c_void_p),
        ("R", ctypes.c_int32),
        ("n_blocks", ctypes.c_int32),
        ("blocks", ctypes.POINTER(_Block)),
    ]


_ARGUMENTS = [
    ctypes.c_int32,  # rows
    ctypes.c_int32,  # in
    ctypes.c_void_p,  # x
    ctypes.c_int64,  # x's row stride
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # out's row stride
    ctypes.c_void_p,  # owner
    ctypes.c_int32,  # adapters
    ctypes.c_void_p,  # their tables
    ctypes.c_int32,  # entry: layer * 4 + product
    ctypes.c_int32,  # threads
]


def kernel_function(
    library: ctypes.CDLL, weight_dtype: torch.dtype, pairs: bool = False
) -> Callable[..., int]:
    """The library's entry point for weights in `weight_dtype` (float32 or bfloat16;
    with `pairs`, bfloat16 laid out for AVX-512 BF16's dot products: `has_pairs`)."""
    if weight_dtype == torch.float32:
        name = "wc_lora_delta_f32"
    else:
        name = "wc_lora_delta_bf16_pairs" if pairs else "wc_lora_delta_bf16"
    function = getattr(library, name)
    function.argtypes = _ARGUMENTS
    function.restype = ctypes.c_int
    return function


def has_pairs(library: ctypes.CDLL) -> bool:
    """Whether the library was built with AVX-512 BF16's dot products (this CPU has them)."""
    return bool(library.wc_lora_pairs())


def _in_pairs(matrix: torch.Tensor) -> torch.Tensor:
    """`[n, m]` as `[ceil(n / 2), m, 2]`: rows 2i and 2i + 1 side by side in every column
    (a zero row after an odd n), the layout AVX-512 BF16's dot products read."""
    if matrix.shape[0] % 2:
        matrix = torch.cat([matrix, matrix.new_zeros(1, matrix.shape[1])])
    return matrix.view(-1, 2, matrix.shape[1]).transpose(1, 2).contiguous()


def product_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each fused product's input and output widths: its targets' projections side by
    side (`adapters.fused_parts`)."""
    return {
        product: (
            projection_shape(config, parts[0][0])[0],
            sum(projection_shape(config, target)[1] for target, _ in parts),
        )
        for product, parts in fused_parts(config).items()
    }


class NativeAdapter:
    """One adapter's deltas as the kernel reads them: a table of `layers x 4` descriptors
    (layer by layer, `PRODUCTS` in order) over its matrices in `weight_dtype` (`pairs`:
    bfloat16 in pairs of rows, `_in_pairs`)."""

    def __init__(
        self,
        adapter: Adapter,
        shapes: dict[str, tuple[int, int]],
        weight_dtype: torch.dtype,
        pairs: bool = False,
    ) -> None:
        self.name = adapter.request.name
        self._pairs = pairs
        self._tensors: list[torch.Tensor] = []  # what the descriptors point into
        self._blocks: list[ctypes.Array[_Block]] = []
        table = (_Delta * (len(adapter.layers) * len(PRODUCTS)))()
        for layer, deltas in enumerate(adapter.layers):
            for product, entry in _ENTRY.items():
                delta: FusedDelta | None = getattr(deltas, product)
                if delta is not None:
                    fan_in, width = shapes[product]
                    table[layer * len(PRODUCTS) + entry] = self._describe(
                        delta, fan_in, width, weight_dtype, where=f"layer {layer} {product}"
                    )
        self.table = table
        self.pointer = ctypes.cast(table, ctypes.POINTER(_Delta))  # what a step passes

    def _describe(
        self, delta: FusedDelta, fan_in: int, width: int, dtype: torch.dtype, *, where: str
    ) -> _Delta:
        a = delta.a
        if a.device.type != "cpu" or a.dim() != 2 or a.shape[0] != fan_in:
            raise ValueError(f"{where}: a {tuple(a.shape)} on {a.device} is not [{fan_in}, R]")
        rank_columns = a.shape[1]
        padded = -(-rank_columns // _VECTOR) * _VECTOR
        if padded == rank_columns:
            a_kernel = a.to(dtype).contiguous()  # the adapter's own tensor where it fits
        else:
            a_kernel = torch.zeros(fan_in, padded, dtype=dtype)
            a_kernel[:, :rank_columns] = a
        if self._pairs:
            a_kernel = _in_pairs(a_kernel)
        self._tensors.append(a_kernel)
        blocks = (_Block * len(delta.blocks))()
        for number, (span, b) in enumerate(delta.blocks):
            if not (0 <= span.start < span.stop <= rank_columns) or not (
                0 <= span.out_start < span.out_stop <= width
            ):
                raise ValueError(f"{where}: block {span} outside [{rank_columns}] x [{width}]")
            shape = (span.stop - span.start, span.out_stop - span.out_start)
            if tuple(b.shape) != shape:
                raise ValueError(f"{where}: b {tuple(b.shape)} for a block of {shape}")
            b_kernel = b.to("cpu", dtype).contiguous()
            if self._pairs:
                b_kernel = _in_pairs(b_kernel)
            self._tensors.append(b_kernel)
            blocks[number] = _Block(
                span.start, span.stop, span.out_start, span.out_stop, b_kernel.data_ptr()
            )
        self._blocks.append(blocks)
        return _Delta(a_kernel.data_ptr(), padded, len(delta.blocks), blocks)


class NativeRows:
    """One step's rows for the kernel: `owner[row]` the index of the row's adapter in
    `adapters` (-1: the base model), int32, one entry per row of the step."""

    def __init__(
        self,
        function: Callable[..., int],
        shapes: dict[str, tuple[int, int]],
        adapters: Sequence[NativeAdapter],
        owner: torch.Tensor,
    ) -> None:
        self._function = function
        self._shapes = shapes  # `product_shapes`: what the descriptors were checked against
        self._adapters = tuple(adapters)  # keeps the tables alive while the step runs
        self._tables = (ctypes.POINTER(_Delta) * len(adapters))(*(a.pointer for a in adapters))
        self._owner = owner.to(torch.int32).contiguous()
        self.rows = int(owner.shape[0])
        # What each product's rows and outputs must be, and what every call passes: the
        # calls come right after large products that flushed the caches, where each
        # tensor attribute read costs microseconds, so the step reads these once.
        self._expected = {
            product: ((self.rows, fan_in), (self.rows, width))
            for product, (fan_in, width) in shapes.items()
        }
        self._step = (self._owner.data_ptr(), len(self._adapters), ctypes.addressof(self._tables))
        self._threads = torch.get_num_threads()

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, product: str) -> None:
        """`out[row] += delta(owner[row])` of `product` at `layer`, for every row."""
        x_shape, out_shape = x.shape, out.shape
        x_expected, out_expected = self._expected[product]
        if x_shape != x_expected or out_shape != out_expected:
            raise ValueError(
                f"{product}: x {tuple(x_shape)} and out {tuple(out_shape)} do not fit a step "
                f"of {self.rows} rows and the product's shape {self._shapes[product]}"
            )
        if x.dtype != torch.float32 or out.dtype != torch.float32:
            raise ValueError(f"the kernel takes float32 rows, got {x.dtype} and {out.dtype}")
        (x_row, x_column), (out_row, out_column) = x.stride(), out.stride()
        if x_column != 1 or out_column != 1:
            raise ValueError("the kernel takes rows whose elements are contiguous")
        status = self._function(
            self.rows,
            x_expected[1],
            x.data_ptr(),
            x_row,
            out.data_ptr(),
            out_row,
            *self._step,
            layer * len(PRODUCTS) + _ENTRY[product],
            self._threads,
        )
        if status != 0:
            raise MemoryError("the LoRA kernel could not allocate its row order")


def step_owner(
    num_rows: int,
    names: Sequence[str],
    runs: Sequence[tuple[str, int, int]],
    mixed: Sequence[str] = (),
    mixed_owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's index in `names` (-1: the base model), from a plan's contiguous runs
    `(name, start, end)` and its mixed decodes (rows `[0, len(mixed_owner))`, each an
    index into `mixed` or -1)."""
    index = {name: number for number, name in enumerate(names)}
    # Built as a list: a handful of small torch ops here took 0.15 ms a step.
    owner = [-1] * num_rows
    for name, start, end in runs:
        owner[start:end] = [index[name]] * (end - start)
    if mixed and mixed_owner is not None:
        to_step = [index[name] for name in mixed]
        for row, number in enumerate(mixed_owner.tolist()):
            if number >= 0:
                owner[row] = to_step[number]
    return torch.tensor(owner, dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class NativeKernel:
    """The kernel for one executor: its entry point, the adapters' weight dtype, and the
    model's product shapes."""

    function: Callable[..., int]
    weight_dtype: torch.dtype
    config: ModelConfig
    pairs: bool = False  # bfloat16 weights through AVX-512 BF16's dot products
    shapes: dict[str, tuple[int, int]] = field(init=False)  # `product_shapes`, once

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", product_shapes(self.config))

    def adapter(self, adapter: Adapter) -> NativeAdapter:
        return NativeAdapter(adapter, self.shapes, self.weight_dtype, self.pairs)

    def rows(self, adapters: Sequence[NativeAdapter], owner: torch.Tensor) -> NativeRows:
        return NativeRows(self.function, self.shapes, adapters, owner)

    def describe(self) -> str:
        if self.weight_dtype == torch.float32:
            return "native kernel, float32 adapter weights"
        if self.pairs:
            return "native kernel, bfloat16 adapter weights and rows (AVX-512 BF16)"
        return "native kernel, bfloat16 adapter weights"


def delta_kernel() -> KernelBuild:
    """The LoRA kernel's library for this process (`native_build.build`)."""
    return build(DELTA_KERNEL)


def native_kernel(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype
) -> tuple[NativeKernel | None, str]:
    """The kernel for an executor computing `dtype` on `device`, or None; with what runs
    the deltas, in words (for `path_report`)."""
    if device.type != "cpu" or dtype != torch.float32:
        return None, f"torch products (the kernel takes float32 on a CPU, not {dtype} on {device})"
    built = delta_kernel()
    if built.library is None:
        return None, f"torch products ({built.reason})"
    pairs = weight_dtype == torch.bfloat16 and has_pairs(built.library)
    function = kernel_function(built.library, weight_dtype, pairs)
    kernel = NativeKernel(function, weight_dtype, config, pairs)
    return kernel, kernel.describe()
