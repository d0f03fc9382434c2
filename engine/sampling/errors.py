"""Errors raised while loading tokenizers from model files."""

from __future__ import annotations


class TokenizerLoadError(ValueError):
    """The model files do not describe a tokenizer this module can build."""
