"""Reading one LoRA adapter in PEFT's format, checked against the base model.

An adapter is a directory: `adapter_config.json` (rank `r`, `lora_alpha`,
`use_rslora`, `target_modules`) and `adapter_model.safetensors`, whose tensors are
`base_model.model.model.layers.{i}.{self_attn|mlp}.{q|k|v|o|gate|up|down}_proj.lora_{A|B}.weight`
(A `[r, in]`, B `[out, r]`). Each target's delta is `scale * x A^T B^T` with `scale =
lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA. `adapter_model.bin` (a pickle:
loading it runs code) is refused, as is everything this runtime would compute wrongly
(DoRA, biases, per-module rank or alpha patterns, extra trained modules): each with a
`LoRAError` naming the file and the field or tensor. Nothing here keeps state.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from wavecore.engine.errors import LoRAError

if TYPE_CHECKING:  # the model package imports this one (through its executor)
    from wavecore.engine.model.config import ModelConfig

# PEFT's module names of the projections this model has, and where each sits.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One target projection of one layer: `a` `[r, in]`, `b` `[out, r]`, and the
    scale its delta is multiplied by."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """An adapter as read: its rank and its modules by (layer, target)."""

    rank: int
    modules: Mapping[tuple[int, str], LoRAModule]


def projection_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """`(in, out)` features of the base projection PEFT calls `target`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size),
        "k_proj": (hidden, config.kv_size),
        "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]


def read_peft_adapter(path: str, config: ModelConfig, *, max_rank: int) -> PeftAdapter:
    """The adapter in directory `path`, checked against `config` and `max_rank`."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAError(f"LoRA adapter {path}: no such directory")
    settings = _read_config(directory / CONFIG_FILE)
    rank, alpha = settings["r"], settings["lora_alpha"]
    if rank > max_rank:
        raise LoRAError(
            f"LoRA adapter {path}: rank r={rank} is above max_lora_rank={max_rank} "
            "(start the engine with a larger max_lora_rank)"
        )
    targets = _targets(directory / CONFIG_FILE, settings["target_modules"])
    scale = alpha / math.sqrt(rank) if settings["use_rslora"] else alpha / rank
    tensors = _read_tensors(directory)
    return PeftAdapter(
        rank=rank, modules=_modules(directory / WEIGHTS_FILE, tensors, targets, rank, scale, config)
    )


def _read_config(file: Path) -> dict[str, object]:
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {file.parent}: no {CONFIG_FILE}") from None
    except OSError as error:
        raise LoRAError(f"LoRA adapter {file}: cannot read it ({error})") from None
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise LoRAError(f"LoRA adapter {file}: not valid JSON ({error})") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"LoRA adapter {file}: not a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"LoRA adapter {file}: peft_type {peft_type!r} is not 'LORA'")
    rank = settings.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA adapter {file}: r must be a positive int, got {rank!r}")
    alpha = settings.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAError(f"LoRA adapter {file}: lora_alpha must be a number, got {alpha!r}")
    rslora = settings.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAError(f"LoRA adapter {file}: use_rslora must be a bool, got {rslora!r}")
    # What this runtime would silently compute wrong is refused by name.
    unsupported = {
        "use_dora": lambda v: v is True,
        "fan_in_fan_out": lambda v: v is True,
        "bias": lambda v: v not in (None, "none"),
        "modules_to_save": lambda v: bool(v),
        "rank_pattern": lambda v: bool(v),
        "alpha_pattern": lambda v: bool(v),
    }
    for field, is_set in unsupported.items():
        if is_set(settings.get(field)):
            raise LoRAError(
                f"LoRA adapter {file}: {field}={settings[field]!r} is not supported "
                "(plain LoRA and rsLoRA on the model's projections only)"
            )
    return {
        "r": rank,
        "lora_alpha": float(alpha),
        "use_rslora": rslora,
        "target_modules": settings.get("target_modules"),
    }


def _targets(file: Path, value: object) -> frozenset[str]:
    """The configured targets, each one of `TARGETS` (a str is PEFT's regex, matched
    against the modules' full names; a list holds their last name parts)."""
    if isinstance(value, str):
        pattern = re.compile(value)
        found = {
            target
            for target in TARGETS
            if pattern.fullmatch(f"model.layers.0.{_BLOCK[target]}.{target}")
            or pattern.fullmatch(target)
        }
        if not found:
            raise LoRAError(
                f"LoRA adapter {file}: target_modules {value!r} matches none of this "
                f"model's projections ({', '.join(TARGETS)})"
            )
        return frozenset(found)
    if not isinstance(value, list | tuple) or not value:
        raise LoRAError(
            f"LoRA adapter {file}: target_modules must be a non-empty list or a regex, "
            f"got {value!r}"
        )
    unknown = [t for t in value if t not in TARGETS]
    if unknown:
        raise LoRAError(
            f"LoRA adapter {file}: target module(s) {unknown} are not projections this "
            f"model has ({', '.join(TARGETS)})"
        )
    return frozenset(value)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        if (directory / PICKLE_FILE).is_file():
            raise LoRAError(
                f"LoRA adapter {directory}: {PICKLE_FILE} is a pickle, which is refused "
                f"(loading one runs code); save the adapter as {WEIGHTS_FILE} "
                "(save_pretrained(..., safe_serialization=True))"
            )
        raise LoRAError(f"LoRA adapter {directory}: no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise LoRAError(
            f"LoRA adapter {file}: cannot read it, truncated or corrupt ({error})"
        ) from None


def _modules(
    file: Path,
    tensors: Mapping[str, torch.Tensor],
    targets: frozenset[str],
    rank: int,
    scale: float,
    config: ModelConfig,
) -> dict[tuple[int, str], LoRAModule]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.fullmatch(name)
        if match is None:
            raise LoRAError(
                f"LoRA adapter {file}: tensor {name} is not a LoRA matrix of a layer's "
                "projection (only lora_A and lora_B of q, k, v, o, gate, up, down)"
            )
        layer, block, target, side = int(match[1]), match[2], match[3], match[4]
        if target not in targets or _BLOCK.get(target) != block:
            raise LoRAError(
                f"LoRA adapter {file}: tensor {name} is for {block}.{target}, which is "
                f"not among its target modules {sorted(targets)}"
            )
        if layer >= config.num_layers:
            raise LoRAError(
                f"LoRA adapter {file}: tensor {name} is for layer {layer}; the base "
                f"model has {config.num_layers}"
            )
        if not tensor.is_floating_point():
            raise LoRAError(f"LoRA adapter {file}: tensor {name} is {tensor.dtype}, not floats")
        pairs.setdefault((layer, target), {})[side] = tensor
    modules = {}
    for (layer, target), sides in sorted(pairs.items()):
        where = f"layer {layer} {target}"
        if set(sides) != {"A", "B"}:
            missing = "lora_B" if "A" in sides else "lora_A"
            raise LoRAError(f"LoRA adapter {file}: {where} has no {missing} tensor")
        in_features, out_features = projection_shape(config, target)
        a, b = sides["A"], sides["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAError(
                f"LoRA adapter {file}: {where} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the base model needs {(rank, in_features)} and "
                f"{(out_features, rank)} (r={rank})"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"LoRA adapter {file}: {where} holds NaN or infinite values")
        modules[(layer, target)] = LoRAModule(a.float(), b.float(), scale)
    if not modules:
        raise LoRAError(f"LoRA adapter {file}: no LoRA tensors")
    return modules
