"""llama.cpp as a bench-only peer: the same GGUF as wavecore, the same thread count, the
same prompts (token ids) and token counts, in the same run.

llama-cpp-python is not a dependency of wavecore (it builds from source, about 20
minutes on 2 cores); `make bench-llamacpp` installs it and runs the benchmarks that
include it. Where it is not importable, `open_peer` prints one line saying so and the
benchmark skips the column.

llama.cpp runs the GGUF's weights as stored (SmolLM2's Q4_1 blocks, about 85 MB read
per token), wavecore dequantizes them to float32 (538 MB) or requantizes them to int8.

- `decode_tok_s`: batch-1 greedy decode, measured as `bench/model.py` measures
  wavecore: the prompt is evaluated (prefill) and one token decoded untimed, then each
  of `steps` decode steps is timed on its own (one token evaluated and the next
  sampled greedily, Python overhead included, as wavecore's step includes its
  sampler) and the rate is 1 / the median step time.
- `batched_decode_tok_s`: greedy decode of several sequences in one KV cache, one
  token of each per `llama_decode` call (llama.cpp's own batched decoding, as its
  `llama-batched-bench` does it), measured as `bench/model.py` measures wavecore's
  batched decode: every prompt evaluated first, one step untimed, then `steps` steps
  timed (the argmax of each sequence's logits included), the rate the sequences
  divided by the median step time.
- `batched_generate`: end to end, every prompt's sequence in one cache (prompts
  evaluated one by one, then all sequences decoding together), timed like
  `bench/generate.py`'s rows.
- `one_at_a_time`: end to end, one request after another through the high-level API
  (`Llama.generate`, greedy, EOS not checked, as wavecore's `ignore_eos`), prefill
  included, timed like `bench/generate.py`'s rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from wavecore.engine.cli.latency import RequestTimer, RunSummary

NOT_INSTALLED = "llama.cpp: not installed (make bench-llamacpp)"


def importable(model: Path) -> bool:
    """Whether llama.cpp is installed and can run `model`; if not, prints why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(NOT_INSTALLED)
        return False
    if model.suffix != ".gguf":
        print(f"llama.cpp: skipped ({model.name} is not a GGUF file)")
        return False
    return True


def open_peer(model: Path, threads: int, n_ctx: int) -> Any | None:
    """A `llama_cpp.Llama` on `model`, or None after printing why there is none."""
    if not importable(model):
        return None
    from llama_cpp import Llama

    return Llama(
        model_path=str(model),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_batch=min(n_ctx, 512),
        seed=0,
        verbose=False,
    )


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def _greedy(llama: Any, prompt: list[int]) -> Any:
    # repeat_penalty=1.0: llama-cpp-python's default (1.1) would change greedy tokens.
    return llama.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)


def decode_tok_s(llama: Any, prompt: list[int], steps: int) -> float:
    """Batch-1 decode tokens/s: 1 / the median of `steps` step times (see the module)."""
    llama.reset()  # no prefix reuse from an earlier call
    tokens = _greedy(llama, prompt)
    next(tokens)  # prefill and first token
    next(tokens)  # warm-up decode step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        next(tokens)
        times.append(time.perf_counter() - start)
    tokens.close()
    return 1 / statistics.median(times)


def one_at_a_time(llama: Any, prompts: list[list[int]], new_tokens: int) -> RunSummary:
    """`new_tokens` greedy tokens for each prompt in turn, prefill included."""
    llama.reset()
    timers: list[RequestTimer] = []
    start = time.perf_counter()
    for prompt in prompts:
        timer = RequestTimer()
        timers.append(timer)
        tokens = _greedy(llama, prompt)
        for _ in range(new_tokens):
            next(tokens)
            timer.tokens_arrived(1)
        tokens.close()
    seconds = time.perf_counter() - start
    return RunSummary.of(
        timers,
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=new_tokens * len(prompts),
        seconds=seconds,
    )


@contextmanager
def batched_context(model: Path, threads: int, sequences: int, n_ctx: int) -> Iterator[Any]:
    """A llama.cpp model and context holding `sequences` sequences, `n_ctx` tokens of
    cache in all (the high-level `Llama` allows one sequence per context)."""
    import llama_cpp
    from llama_cpp import _internals

    model_params = llama_cpp.llama_model_default_params()
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = params.n_ubatch = min(n_ctx, 512)
    params.n_seq_max = sequences
    # llama.cpp's default: each sequence its own stretch of the cache. A unified cache
    # has every token attend over all sequences' cells, masked: on the Xeon of the
    # README, 64 sequences after 128-token prompts decoded 134 tokens/s unified against
    # 403 apart (after 512-token prompts 34 against 136).
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = threads
    llama_model = _internals.LlamaModel(path_model=str(model), params=model_params, verbose=False)
    try:
        context = _internals.LlamaContext(model=llama_model, params=params, verbose=False)
        try:
            yield context
        finally:
            context.close()
    finally:
        llama_model.close()


class _Batched:
    """Greedy decoding of several sequences through one llama.cpp context."""

    def __init__(self, context: Any, prompts: list[list[int]]) -> None:
        import llama_cpp

        self.context, self.prompts = context, prompts
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context.ctx), True)
        self.vocab = context.model.n_vocab()
        self.batch = llama_cpp.llama_batch_init(max(len(prompts), *map(len, prompts)), 0, 1)

    def close(self) -> None:
        import llama_cpp

        llama_cpp.llama_batch_free(self.batch)

    def _decode(self, entries: list[tuple[int, int, int]], *, every_row: bool) -> None:
        """One `llama_decode` of `(token, position, sequence)` entries, logits for each
        with `every_row`, else for the last only (a prompt needs no more: logits for all
        its rows would cost llama.cpp its whole vocabulary per prompt token)."""
        import llama_cpp

        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, sequence) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, position
            batch.seq_id[i][0], batch.n_seq_id[i] = sequence, 1
            batch.logits[i] = every_row or i == len(entries) - 1
        if llama_cpp.llama_decode(self.context.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (is the context large enough?)")

    def _argmax(self, row: int) -> int:
        import llama_cpp
        import numpy as np

        logits = llama_cpp.llama_get_logits_ith(self.context.ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def prefill(self, sequence: int) -> int:
        """Evaluate one prompt into its sequence; its first token."""
        prompt = self.prompts[sequence]
        entries = [(token, position, sequence) for position, token in enumerate(prompt)]
        self._decode(entries, every_row=False)
        return self._argmax(len(prompt) - 1)

    def step(self, tokens: list[int], positions: list[int]) -> list[int]:
        """Every sequence's token at its position in one call; each one's next token."""
        self._decode([(token, positions[s], s) for s, token in enumerate(tokens)], every_row=True)
        return [self._argmax(s) for s in range(len(tokens))]


def batched_decode_tok_s(context: Any, prompts: list[list[int]], steps: int) -> float:
    """Greedy decode tokens/s of `prompts` decoding together (see the module)."""
    decoder = _Batched(context, prompts)
    try:
        following = [decoder.prefill(s) for s in range(len(prompts))]
        positions = [len(prompt) for prompt in prompts]
        times = []
        for step in range(steps + 1):
            start = time.perf_counter()
            following = decoder.step(following, positions)
            if step:  # the first step is the warm-up
                times.append(time.perf_counter() - start)
            positions = [p + 1 for p in positions]
        return len(prompts) / statistics.median(times)
    finally:
        decoder.close()


def batched_generate(context: Any, prompts: list[list[int]], new_tokens: int) -> RunSummary:
    """`new_tokens` greedy tokens for every prompt, the sequences decoding together after
    their prompts are evaluated one by one (prefill included in the time)."""
    decoder = _Batched(context, prompts)
    try:
        timers = [RequestTimer() for _ in prompts]
        start = time.perf_counter()
        following = []
        for sequence, timer in enumerate(timers):
            following.append(decoder.prefill(sequence))
            timer.tokens_arrived(1)
        positions = [len(prompt) for prompt in prompts]
        for _ in range(new_tokens - 1):
            following = decoder.step(following, positions)
            for timer in timers:
                timer.tokens_arrived(1)
            positions = [p + 1 for p in positions]
        seconds = time.perf_counter() - start
    finally:
        decoder.close()
    return RunSummary.of(
        timers,
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=new_tokens * len(prompts),
        seconds=seconds,
    )
