"""A tokenizer with one token per UTF-8 byte, for tests and benchmarks without a model.

Ids 0-255 are the bytes; `EOS_TOKEN_ID` (256) ends a sequence and is the only special
token. It has the same surface as `Tokenizer`, so the null executor and the engine
tests run the real text path (incremental detokenization of multi-byte characters,
stop strings) without loading a vocabulary. Its chat template is a fixed
`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` when a reply is wanted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

EOS_TOKEN_ID = 256
EOS_TEXT = "<|eos|>"


class ByteTokenizer:
    @property
    def eos_token_id(self) -> int:
        return EOS_TOKEN_ID

    @property
    def bos_token_id(self) -> None:
        return None

    @property
    def vocab_size(self) -> int:
        return EOS_TOKEN_ID + 1

    @property
    def token_bytes(self) -> list[bytes]:
        """Each token's bytes, by id (what a grammar engine matches against)."""
        return [bytes([i]) for i in range(EOS_TOKEN_ID)] + [EOS_TEXT.encode()]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # There is no BOS, so `add_special_tokens` changes nothing.
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            # The common case, all bytes: one C call (bytes() refuses ids past 255).
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError:
            pass
        pieces: list[str] = []
        pending = bytearray()
        for token in ids:
            if 0 <= token < EOS_TOKEN_ID:
                pending.append(token)
            elif token == EOS_TOKEN_ID:
                if not skip_special_tokens:
                    pieces.append(pending.decode("utf-8", errors="replace"))
                    pending.clear()
                    pieces.append(EOS_TEXT)
            else:
                raise ValueError(f"token id {token} is outside the vocabulary of {self.vocab_size}")
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        turns = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        if add_generation_prompt:
            turns.append("<|assistant|>\n")
        return "".join(turns)
