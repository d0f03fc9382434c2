"""Reading PEFT's adapter files: target modules as PEFT's regex, the scale (plain and
rsLoRA), and fields this runtime would compute wrongly, refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from lora_helpers import LAYERS, write_adapter
from lora_helpers import TINY_CONFIG as CONFIG

from wavecore.engine.errors import LoRAError
from wavecore.engine.lora.peft_files import read_peft_adapter


def rewrite_config(directory: Path, **fields: object) -> None:
    file = directory / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | fields))


def test_target_modules_as_a_regex_and_the_scales(tmp_path: Path) -> None:
    directory = write_adapter(tmp_path / "a", seed=1, rank=4, alpha=8, targets=("q_proj", "v_proj"))
    rewrite_config(directory, target_modules=r".*\.(q_proj|v_proj)")
    adapter = read_peft_adapter(str(directory), CONFIG, max_rank=64)
    assert sorted(adapter.modules) == [(i, t) for i in range(LAYERS) for t in ("q_proj", "v_proj")]
    assert {module.scale for module in adapter.modules.values()} == {8 / 4}
    rewrite_config(directory, use_rslora=True)
    adapter = read_peft_adapter(str(directory), CONFIG, max_rank=64)
    assert {module.scale for module in adapter.modules.values()} == {8 / math.sqrt(4)}
    rewrite_config(directory, target_modules="embed_tokens")
    with pytest.raises(LoRAError, match="matches none of this model's projections"):
        read_peft_adapter(str(directory), CONFIG, max_rank=64)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_dora", True),
        ("bias", "all"),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 8}),
        ("peft_type", "IA3"),
        ("r", 0),
    ],
)
def test_what_would_be_computed_wrong_is_refused_by_name(
    tmp_path: Path, field: str, value: object
) -> None:
    directory = write_adapter(tmp_path / "a", seed=1)
    rewrite_config(directory, **{field: value})
    with pytest.raises(LoRAError, match=field):
        read_peft_adapter(str(directory), CONFIG, max_rank=64)
