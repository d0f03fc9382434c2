"""LoRA adapters on SmolLM2-135M against peft on transformers (the session's reference
model, copied): two adapters built by peft from a fixed seed (every projection at rank
8; q and v at rank 4 with rsLoRA), saved by peft in its format, loaded by wavecore, and
run in one mixed batch with the base model; every greedy continuation equals peft's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from model_test_helpers import GreedyRunner

from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.model import ModelExecutor
from wavecore.engine.sampling.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.model,
    # peft asks transformers a deprecated question (`is_gradient_checkpointing`).
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Q: What is 12 times 12?\nA:",
]
NEW_TOKENS = 12
ADAPTERS = {
    "everything": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    },
    "attention": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "use_rslora": True,
    },
}


@pytest.fixture(scope="module")
def peft_outputs(
    hf_reference, smollm_executor: ModelExecutor, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Path], list[list[int]], dict[tuple[int, str | None], list[int]]]:
    """The adapters' directories, the prompts, and peft's greedy tokens per (prompt,
    adapter); the base model's under None."""
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("peft")
    model = None
    generator = torch.Generator().manual_seed(0)
    for name, settings in ADAPTERS.items():
        config = peft.LoraConfig(lora_dropout=0.0, **settings)
        if model is None:
            model = peft.get_peft_model(copy.deepcopy(hf_reference), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        with torch.no_grad():
            for key, parameter in model.named_parameters():
                if f".{name}." not in key:
                    continue
                if "lora_A" in key:  # a random direction per input feature
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
                    parameter /= parameter.shape[1] ** 0.5
                elif "lora_B" in key:  # large enough to change the continuation
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    # Adapters not named "default" get a folder each; the embeddings are not trained.
    model.save_pretrained(str(root), save_embedding_layers=False)
    directories = {name: root / name for name in ADAPTERS}
    tokenizer = Tokenizer.from_source(smollm_executor.source)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    device = next(model.parameters()).device
    outputs = {}
    model.eval()
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=device)
            for name in (None, *ADAPTERS):
                if name is None:
                    with model.disable_adapter():
                        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
                else:
                    model.set_adapter(name)
                    tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
                outputs[(index, name)] = tokens[0, len(prompt) :].tolist()
    return directories, prompts, outputs


def test_mixed_adapters_in_one_batch_equal_peft(smollm_executor: ModelExecutor, peft_outputs):
    directories, prompts, expected = peft_outputs
    for index in range(len(prompts)):  # each adapter changes what the base model says
        assert len({tuple(expected[(index, name)]) for name in (None, *ADAPTERS)}) == 3
    for name, directory in directories.items():
        smollm_executor.add_lora(LoRARequest(name, str(directory)))
    try:
        runner = GreedyRunner(smollm_executor)
        requests = {
            (index, name): runner.add(prompt, NEW_TOKENS, lora=name)
            for index, prompt in enumerate(prompts)
            for name in (None, *ADAPTERS)
        }
        runner.run(list(requests.values()))
    finally:
        for name in directories:
            smollm_executor.remove_lora(name)
    assert {key: request.output for key, request in requests.items()} == expected
