"""The model runtime below the scheduler: Llama-family weights, paged KV cache, executor.

Entry points: `load_executor(model, device=..., kv_cache_memory=..., block_size=...)`
builds a `ModelExecutor` (the engine's `Executor`); `resolve_model_source(model)` opens
a model's metadata alone (for the tokenizer: `ModelSource.gguf_metadata`,
`tokenizer_json`, `eos_token_id`, `chat_template`, `context_length`).
"""

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.errors import InvalidBatchError, ModelLoadError
from wavecore.engine.model.executor import ModelExecutor, load_executor
from wavecore.engine.model.resolve import (
    DEFAULT_MODEL_INSTALL,
    default_model_path,
    resolve_model_source,
)
from wavecore.engine.model.source import ModelSource

__all__ = [
    "DEFAULT_MODEL_INSTALL",
    "InvalidBatchError",
    "ModelConfig",
    "ModelExecutor",
    "ModelLoadError",
    "ModelSource",
    "default_model_path",
    "load_executor",
    "resolve_model_source",
]
