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
- `one_at_a_time`: end to end, one request after another through the high-level API
  (`Llama.generate`, greedy, EOS not checked, as wavecore's `ignore_eos`), prefill
  included, timed like `bench/generate.py`'s rows.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from wavecore.engine.cli.latency import RequestTimer, RunSummary

NOT_INSTALLED = "llama.cpp: not installed (make bench-llamacpp)"


def open_peer(model: Path, threads: int, n_ctx: int) -> Any | None:
    """A `llama_cpp.Llama` on `model`, or None after printing why there is none."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print(NOT_INSTALLED)
        return None
    if model.suffix != ".gguf":
        print(f"llama.cpp: skipped ({model.name} is not a GGUF file)")
        return None
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
