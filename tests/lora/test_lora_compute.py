"""A run of one adapter's rows (the slice path: one `x @ a` per fused product, one `b`
product per target) adds each target's delta, computed here from PEFT's matrices, to that target's own output columns
and nothing elsewhere. The stacked path of decodes that mix adapters
(`compute.MixedDecodes`, target by target, `adapters.StackedDelta`) gives each row the
delta its own adapter's slice path gives it, for adapters of different ranks and
targets, and base rows nothing."""

from __future__ import annotations

from pathlib import Path

import torch
from lora_helpers import TINY_CONFIG, write_adapter

from wavecore.engine.lora.adapters import PRODUCTS, StackedAdapters, build_adapter
from wavecore.engine.lora.compute import LoRARows, MixedDecodes, add_lora
from wavecore.engine.lora.peft_files import read_peft_adapter
from wavecore.engine.lora.request import LoRARequest

# Ranks and targets that differ, so each product's blocks come from some adapters only.
ADAPTERS = {
    "every": {"rank": 4},
    "q-and-v": {"rank": 2, "targets": ("q_proj", "v_proj"), "rslora": True},
    "gate-and-down": {"rank": 3, "targets": ("gate_proj", "down_proj")},
}

Q, KV, INTER = TINY_CONFIG.q_size, TINY_CONFIG.kv_size, TINY_CONFIG.intermediate_size
# Each fused product's input width and targets with their first output column.
FUSED = {
    "qkv": (TINY_CONFIG.hidden_size, (("q_proj", 0), ("k_proj", Q), ("v_proj", Q + KV))),
    "o": (Q, (("o_proj", 0),)),
    "gate_up": (TINY_CONFIG.hidden_size, (("gate_proj", 0), ("up_proj", INTER))),
    "down": (INTER, (("down_proj", 0),)),
}
WIDTH = {"qkv": Q + 2 * KV, "o": TINY_CONFIG.hidden_size, "gate_up": 2 * INTER}
WIDTH["down"] = TINY_CONFIG.hidden_size


def test_a_run_adds_each_targets_delta_to_its_own_columns(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    for seed, name in enumerate(("every", "q-and-v", "gate-and-down")):
        directory = write_adapter(tmp_path / name, seed=seed, **ADAPTERS[name])  # type: ignore[arg-type]
        peft = read_peft_adapter(str(directory), TINY_CONFIG, max_rank=8)
        adapter = build_adapter(LoRARequest(name, str(directory)), peft, TINY_CONFIG)
        # One row and several, between rows of the base model.
        for run in (1, 5):
            rows = LoRARows(((adapter, 2, 2 + run),))
            for layer in range(TINY_CONFIG.num_layers):
                for product, (fan_in, targets) in FUSED.items():
                    x = torch.randn(run + 4, fan_in, generator=gen)
                    got = torch.zeros(run + 4, WIDTH[product])
                    add_lora(got, x, rows, layer, product)
                    expected = torch.zeros_like(got)
                    for target, column in targets:
                        module = peft.modules.get((layer, target))
                        if module is not None:
                            delta = module.scale * (x[2 : 2 + run] @ module.a.t()) @ module.b.t()
                            expected[2 : 2 + run, column : column + delta.shape[1]] = delta
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mixed_rows_get_their_own_adapters_delta(tmp_path: Path) -> None:
    adapters = []
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        directory = write_adapter(tmp_path / name, seed=seed, **settings)  # type: ignore[arg-type]
        peft = read_peft_adapter(str(directory), TINY_CONFIG, max_rank=8)
        adapters.append(build_adapter(LoRARequest(name, str(directory)), peft, TINY_CONFIG))
    owner = torch.tensor([2, -1, 0, 1, 0, 2, -1, 1, 1])  # rows interleaved, two of the base
    mixed = LoRARows((), MixedDecodes(StackedAdapters(adapters), owner))
    inputs = {"qkv": TINY_CONFIG.hidden_size, "o": TINY_CONFIG.q_size}
    inputs |= {"gate_up": TINY_CONFIG.hidden_size, "down": TINY_CONFIG.intermediate_size}
    outputs = {
        "qkv": TINY_CONFIG.q_size + 2 * TINY_CONFIG.kv_size,
        "o": TINY_CONFIG.hidden_size,
        "gate_up": 2 * TINY_CONFIG.intermediate_size,
        "down": TINY_CONFIG.hidden_size,
    }
    gen = torch.Generator().manual_seed(0)
    for layer in range(TINY_CONFIG.num_layers):
        for product in PRODUCTS:
            x = torch.randn(len(owner), inputs[product], generator=gen)
            got = torch.zeros(len(owner), outputs[product])
            add_lora(got, x, mixed, layer, product)
            expected = torch.zeros_like(got)
            for row, number in enumerate(owner.tolist()):
                if number >= 0:
                    alone = LoRARows(((adapters[number], row, row + 1),))
                    add_lora(expected, x, alone, layer, product)
            assert expected.abs().sum() > 0  # some adapter targets every product
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
