"""Prometheus metrics of one server, in a registry of its own.

Names follow the upstream engine's `vllm:` metrics under a `wavecore:` prefix. Request
figures (tokens, finish reasons, latencies) are counted by the server as the deltas go
by; the scheduler gauges are read from `engine.stats()` at each scrape, one series per
DP rank (`engine` label).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from wavecore.engine.interface import (
    STEP_MS_BUCKETS,
    STEP_TOKENS_BUCKETS,
    EngineStats,
    RankIterations,
)

# Upstream's buckets, so dashboards built for it read these alike.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _EngineCounters(Collector):
    """Counters kept by the engine (each rank's prefix cache and grammar compiles, the
    front end's structured-output requests per kind) as of the last scrape's stats:
    they count there, so they are reported as they stand rather than incremented here."""

    def __init__(self, model_name: str) -> None:
        self._model = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        queries = CounterMetricFamily(
            "wavecore:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "wavecore:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=labels
        )
        compiles = CounterMetricFamily(
            "wavecore:grammar_compiles",
            "Structured-output grammars compiled (compile-cache hits excluded).",
            labels=labels,
        )
        compile_seconds = CounterMetricFamily(
            "wavecore:grammar_compile_seconds",
            "Seconds spent compiling structured-output grammars.",
            labels=labels,
        )
        structured = CounterMetricFamily(
            "wavecore:structured_output_requests",
            "Requests with structured output, by kind.",
            labels=["model_name", "kind"],
        )
        drafts = CounterMetricFamily(
            "wavecore:spec_decode_num_drafts",
            "Decodes verified with speculative drafts.",
            labels=labels,
        )
        draft_tokens = CounterMetricFamily(
            "wavecore:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels=labels
        )
        accepted = CounterMetricFamily(
            "wavecore:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels=labels
        )
        per_position = CounterMetricFamily(
            "wavecore:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            labels=[*labels, "position"],
        )
        stats = self.stats
        for rank in stats.ranks if stats is not None else ():
            core = rank.core
            rank_labels = [self._model, str(rank.rank)]
            drafts.add_metric(rank_labels, core.spec_decode_num_drafts)
            draft_tokens.add_metric(rank_labels, core.spec_decode_num_draft_tokens)
            accepted.add_metric(rank_labels, core.spec_decode_num_accepted_tokens)
            for position, count in enumerate(core.spec_decode_accepted_per_position):
                per_position.add_metric([*rank_labels, str(position)], count)
        yield drafts
        yield draft_tokens
        yield accepted
        yield per_position
        for rank in stats.ranks if stats is not None else ():
            rank_labels = [self._model, str(rank.rank)]
            queries.add_metric(rank_labels, rank.core.prefix_cache_queries)
            hits.add_metric(rank_labels, rank.core.prefix_cache_hits)
            compiles.add_metric(rank_labels, rank.core.grammar_compiles)
            compile_seconds.add_metric(rank_labels, rank.core.grammar_compile_seconds)
        for kind, count in sorted(stats.structured_requests.items()) if stats is not None else ():
            structured.add_metric([self._model, kind], count)
        yield queries
        yield hits
        yield compiles
        yield compile_seconds
        yield structured
        yield from self._iterations(stats)

    def _iterations(self, stats: EngineStats | None) -> Iterator[Metric]:
        """The ranks' iteration details (`--log-iteration-details`), counted by the
        front end as they arrive: nothing without them."""
        if stats is None or not stats.iterations:
            return
        labels = ["model_name", "engine"]
        step_time = HistogramMetricFamily(
            "wavecore:iteration_time_seconds",
            "Time of one forward and its sampling on a rank (dummy batches included).",
            labels=labels,
        )
        step_tokens = HistogramMetricFamily(
            "wavecore:iteration_tokens",
            "Tokens one forward ran on a rank (context and generation; no dummy batch).",
            labels=labels,
        )
        dummies = CounterMetricFamily(
            "wavecore:iteration_dummy_steps",
            "Dummy batches a lockstep rank ran while its peers had work.",
            labels=labels,
        )
        for rank in stats.iterations:
            rank_labels = [self._model, str(rank.rank)]
            seconds = tuple(bound / 1e3 for bound in STEP_MS_BUCKETS)
            step_time.add_metric(
                rank_labels,
                _cumulative(seconds, rank.ms_buckets),
                sum_value=rank.elapsed_ms / 1e3,
            )
            step_tokens.add_metric(
                rank_labels,
                _cumulative(STEP_TOKENS_BUCKETS, rank.tokens_buckets),
                sum_value=_tokens(rank),
            )
            dummies.add_metric(rank_labels, rank.dummy_steps)
        yield step_time
        yield step_tokens
        yield dummies


def _cumulative(bounds: tuple[float, ...], counts: tuple[int, ...]) -> list[tuple[str, float]]:
    """Prometheus's buckets: cumulative counts per upper bound, then +Inf."""
    buckets = []
    total = 0
    for bound, count in zip((*map(str, bounds), "+Inf"), counts, strict=True):
        total += count
        buckets.append((bound, total))
    return buckets


def _tokens(rank: RankIterations) -> float:
    return rank.context_tokens + rank.generation_tokens


class _DroppedFrames(Collector):
    """Frames the engine's channels dropped as malformed or impossible (a hostile or
    broken peer), per receiving channel, as of the last scrape's stats."""

    def __init__(self, model_name: str) -> None:
        self._model = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        dropped = CounterMetricFamily(
            "wavecore:dropped_frames",
            "Frames dropped by a receiving channel as malformed or impossible.",
            labels=["model_name", "channel"],
        )
        for channel, count in sorted((self.stats.dropped_frames if self.stats else {}).items()):
            dropped.add_metric([self._model, channel], count)
        yield dropped


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model = model_name
        per_rank = ["model_name", "engine"]
        self._running = Gauge(
            "wavecore:num_requests_running",
            "Requests in model execution batches.",
            per_rank,
            registry=self.registry,
        )
        self._waiting = Gauge(
            "wavecore:num_requests_waiting",
            "Requests waiting to be processed.",
            per_rank,
            registry=self.registry,
        )
        self._kv_usage = Gauge(
            "wavecore:kv_cache_usage_perc",
            "KV-cache usage; 1 means 100 percent.",
            per_rank,
            registry=self.registry,
        )
        self._prefix_hit_rate = Gauge(
            "wavecore:prefix_cache_hit_rate",
            "Share of prompt tokens found in the prefix cache.",
            per_rank,
            registry=self.registry,
        )
        self._lora_running = Gauge(
            "wavecore:lora_requests_running",
            "Running requests under each LoRA adapter.",
            [*per_rank, "lora_name"],
            registry=self.registry,
        )
        self._prompt_tokens = Counter(
            "wavecore:prompt_tokens",
            "Prefill tokens processed.",
            ["model_name"],
            registry=self.registry,
        )
        self._generation_tokens = Counter(
            "wavecore:generation_tokens",
            "Generation tokens processed.",
            ["model_name"],
            registry=self.registry,
        )
        self._success = Counter(
            "wavecore:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._fair_queued = Gauge(
            "wavecore:http_requests_queued",
            "Engine requests the server holds back for their client's turn (fair admission).",
            ["model_name"],
            registry=self.registry,
        )
        self._client_limited = Counter(
            "wavecore:http_client_limited",
            "Calls refused with 429: their client had too much outstanding.",
            ["model_name"],
            registry=self.registry,
        )
        self._engine_counters = _EngineCounters(model_name)
        self.registry.register(self._engine_counters)
        self._dropped_frames = _DroppedFrames(model_name)
        self.registry.register(self._dropped_frames)
        self._ttft = Histogram(
            "wavecore:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self._itl = Histogram(
            "wavecore:inter_token_latency_seconds",
            "Time between two outputs of a request, per output.",
            ["model_name"],
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self._e2e = Histogram(
            "wavecore:e2e_request_latency_seconds",
            "End-to-end request latency.",
            ["model_name"],
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )

    def first_token(self, seconds: float) -> None:
        self._ttft.labels(self._model).observe(seconds)

    def next_tokens(self, seconds: float) -> None:
        self._itl.labels(self._model).observe(seconds)

    def generated(self, tokens: int) -> None:
        self._generation_tokens.labels(self._model).inc(tokens)

    def finished(self, reason: str, prompt_tokens: int, seconds: float) -> None:
        self._success.labels(self._model, reason).inc()
        self._prompt_tokens.labels(self._model).inc(prompt_tokens)
        self._e2e.labels(self._model).observe(seconds)

    def client_limited(self) -> None:
        self._client_limited.labels(self._model).inc()

    def exposition(self, stats: EngineStats | None, *, fair_queued: int = 0) -> bytes:
        """The text format, with the scheduler gauges taken from `stats` (none without)
        and the requests fair admission holds back."""
        self._fair_queued.labels(self._model).set(fair_queued)
        gauges = (
            self._running,
            self._waiting,
            self._kv_usage,
            self._prefix_hit_rate,
            self._lora_running,
        )
        for gauge in gauges:
            gauge.clear()  # a rank removed by a scale must not linger
        self._engine_counters.stats = stats
        self._dropped_frames.stats = stats
        for rank in stats.ranks if stats is not None else ():
            labels = (self._model, str(rank.rank))
            self._running.labels(*labels).set(rank.core.num_running)
            self._waiting.labels(*labels).set(rank.core.num_waiting)
            self._kv_usage.labels(*labels).set(rank.core.kv_usage)
            self._prefix_hit_rate.labels(*labels).set(rank.core.prefix_cache_hit_rate)
            for name, count in rank.core.lora_running.items():
                self._lora_running.labels(*labels, name).set(count)
        return generate_latest(self.registry)
