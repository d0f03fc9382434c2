"""Turning logits into tokens and tokens into text.

- `sampler.Sampler`: one token (and optional logprobs) per row of a logits batch:
  penalties and `min_tokens` (`logits_processing`), temperature, top-k/top-p/min-p
  (`truncation`), then one uniform draw a row (`row_draws`).
- `tokenizer.Tokenizer`: text to ids and back, and chat prompts, from a resolved
  model (`from_source`), a GGUF file (`gguf_tokenizer`) or a Hugging Face directory;
  `chat_template` renders templates in a sandbox. `byte_tokenizer.ByteTokenizer` is a model-free
  stand-in with the same surface.
- `detokenizer.IncrementalDetokenizer` streams one request's output as clean text
  deltas; `stop_strings.StopChecker` cuts them at the first stop string.

Modules are imported directly (`from wavecore.engine.sampling.sampler import
Sampler`), so the sampler's users never pay for the tokenizer's imports.
"""
