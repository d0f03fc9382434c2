"""A rank's grammars: compiled in worker threads, cached by spec, one matcher per request.

Theory of operation:

1. `GrammarCompiler.start(spec)` returns the request's `RequestGrammar` at once. A spec
   compiled before is served from the cache (a copy of its pristine matcher, a few
   microseconds); a new one is compiled in a worker thread, never on the event loop,
   and the request waits in the scheduler's queue, skipped by admission without holding
   back the requests behind it (`RequestGrammar.ready`).
2. The cache holds `cache_size` pristine matchers, least recently used out first.
3. `RequestGrammar.poll()` moves a finished compile into the request: its matcher, or
   the compiler's error. A compile still running after `timeout` seconds counts as
   failed (the thread cannot be stopped; its result is dropped): the request alone
   ends with that error.
4. `listener` (set by the rank's driver) is called from the worker thread after each
   compile, so an idle rank waiting only for a grammar wakes at once.
5. A matcher accepts exactly the request's output tokens, in order (the scheduler's
   update): preemption and recompute keep the outputs, so they keep the matcher too.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance

from wavecore.engine.structured.grammars import GrammarError, GrammarVocabulary
from wavecore.engine.structured_outputs import StructuredOutputs

DEFAULT_COMPILE_TIMEOUT_S = 30.0
_CACHE_SIZE = 256
# Two workers: one grammar that compiles for a long time does not hold back the rest.
_WORKERS = 2


class RequestGrammar:
    """One request's grammar: compiling, then ready (a matcher) or failed (an error)."""

    __slots__ = ("_deadline", "_future", "error", "matcher", "spec")

    def __init__(
        self,
        spec: StructuredOutputs,
        *,
        matcher: llguidance.LLMatcher | None = None,
        future: Future[llguidance.LLMatcher] | None = None,
        deadline: float = 0.0,
    ) -> None:
        self.spec = spec
        self.matcher = matcher
        self.error: str | None = None
        self._future = future
        self._deadline = deadline

    @property
    def ready(self) -> bool:
        """Compiled: the request can be scheduled."""
        return self.matcher is not None

    @property
    def compiling(self) -> bool:
        return self.matcher is None and self.error is None

    def poll(self) -> None:
        """Take a finished compile's matcher or error (rule 3)."""
        future = self._future
        if future is None or not self.compiling:
            return
        if future.done():
            self._future = None
            try:
                self.matcher = future.result()
            except GrammarError as error:
                self.error = str(error)
            except Exception as error:  # the compiler's own failure
                self.error = f"structured_outputs.{self.spec.kind}: {error}"
        elif time.monotonic() > self._deadline:
            self._future = None
            self.error = (
                f"structured_outputs.{self.spec.kind}: the grammar did not compile within "
                "the compile timeout"
            )

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return self.matcher is not None and self.matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar reached its end: nothing but EOS may follow."""
        return self.matcher is not None and self.matcher.is_stopped()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar accepts now (speculative
        drafts are cut there)."""
        return 0 if self.matcher is None else self.matcher.validate_tokens(token_ids)

    def forced_tokens(self) -> list[int]:
        """The tokens of the text the grammar forces next (a JSON schema's keys and
        punctuation, say): drafts that cost no lookup (`Scheduler._drafts`)."""
        return [] if self.matcher is None else self.matcher.compute_ff_tokens()


class GrammarCompiler:
    """Compiles the grammars of one rank's requests; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = _CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._timeout = timeout
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.listener: Callable[[], None] | None = None
        self.compile_seconds = 0.0
        self.compiles = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def start(self, spec: StructuredOutputs) -> RequestGrammar:
        with self._lock:
            pristine = self._cache.get(spec.key)
            if pristine is not None:
                self._cache.move_to_end(spec.key)
                return RequestGrammar(spec, matcher=pristine.deep_copy())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="wavecore-grammar")
        future = self._pool.submit(self._compile, spec)
        listener = self.listener
        if listener is not None:
            # Called once the future holds its result (a call from inside `_compile`
            # could wake a rank that then still finds the compile running).
            future.add_done_callback(lambda _: listener())
        return RequestGrammar(spec, future=future, deadline=time.monotonic() + self._timeout)

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        started = time.perf_counter()
        vocabulary = GrammarVocabulary.for_tokenizer(self._tokenizer, self._vocab_size)
        matcher = vocabulary.matcher(spec)
        with self._lock:
            self.compile_seconds += time.perf_counter() - started
            self.compiles += 1
            self._cache[spec.key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher.deep_copy()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
