"""Turning logits into tokens and tokens into text.

`sampler` picks each request's next token from a batch of logits (penalties, then
temperature, then top-k/top-p/min-p truncation, then a race of exponential noise);
`tokenizer` turns text into token ids and back; `detokenizer` streams text deltas as
tokens arrive and cuts the stream at stop strings. Modules are imported directly
(`from wavecore.engine.sampling.sampler import Sampler`) so that the sampler's users
never pay for the tokenizer's imports.
"""
