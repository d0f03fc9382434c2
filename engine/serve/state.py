"""What every route shares: the engine once it is ready, whether it died, how many
requests wait for their first token (load shedding), the fair admission of clients'
requests, and which are in flight (so a shutdown past its timeout can abort them)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from wavecore.engine.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    LoRAError,
    ScalingFailedError,
    UnknownLoRAError,
    UnknownRequestError,
)
from wavecore.engine.frontend.engine import FrontEnd
from wavecore.engine.frontend.input_processor import InputProcessor
from wavecore.engine.interface import Engine
from wavecore.engine.serve.errors import APIError
from wavecore.engine.serve.fairness import FairAdmission
from wavecore.engine.serve.metrics import ServerMetrics
from wavecore.engine.serve.options import ServeOptions


class ReadyEngine:
    """The engine with the tokenizer behind it: the server validates and tokenizes a
    request before it answers 200 (a streamed response cannot turn into a 400 later),
    and reads token text for logprobs and echo."""

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine, FrontEnd):
            raise TypeError(f"the server needs the engine open_engine returns, got {engine!r}")
        self.engine: Engine = engine
        self.tokenizer = engine.core_client.tokenizer
        self.inputs = InputProcessor(self.tokenizer, max_model_len=engine.max_model_len)

    def lora_names(self) -> list[str]:
        """The LoRA adapters loaded: a request's `model` may name one."""
        return self.engine.lora_names()  # type: ignore[attr-defined]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)  # type: ignore[attr-defined]

    def text_of(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))  # type: ignore[attr-defined]


class ServerState:
    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.metrics = ServerMetrics(options.model_name)
        self.started = int(time.time())
        self._ready: ReadyEngine | None = None
        self.dead: EngineDeadError | None = None
        self.waiting = 0
        self.in_flight: set[str] = set()
        self.fair = FairAdmission(
            self._capacity,
            per_client=options.max_inflight_per_client,
            queue_per_client=options.max_queued_per_client,
        )
        self._max_num_seqs = 1

    def set_ready(self, engine: Engine, *, max_num_seqs: int) -> None:
        """`max_num_seqs`: the sequences one rank runs at once (with the dp size, what
        fair admission lets into the engine by default)."""
        self._ready = ReadyEngine(engine)
        self._max_num_seqs = max_num_seqs

    def _capacity(self) -> int:
        """Engine requests admitted at once: `--max-inflight`, else what the engine runs
        at once at its current dp size (a scale changes it)."""
        if self.options.max_inflight is not None:
            return self.options.max_inflight
        dp_size = self._ready.engine.dp_size if self._ready is not None else 1
        return self._max_num_seqs * dp_size

    def serving(self) -> ReadyEngine | None:
        """The engine if it is loaded and alive."""
        return self._ready if self.dead is None else None

    def ready(self) -> ReadyEngine:
        """The engine, or the error a request gets while there is none to serve it."""
        if self.dead is not None:
            raise self._dead_response(self.dead)
        if self._ready is None:
            raise APIError(
                503,
                "the model is still loading; retry shortly",
                code="not_ready",
                headers={"Retry-After": "1"},
            )
        return self._ready

    def died(self, error: EngineDeadError) -> APIError:
        """Remember the death (every later request and /health fail with it)."""
        self.dead = error
        return self._dead_response(error)

    @staticmethod
    def _dead_response(error: EngineDeadError) -> APIError:
        return APIError(500, f"the engine died: {error}", code="engine_dead")

    def error_of(self, error: EngineError) -> APIError:
        """The response an engine error becomes: the caller's fault (400), a call the
        engine's state refuses (409, e.g. resume during a pause), or the server's."""
        if isinstance(error, EngineDeadError):
            return self.died(error)
        if isinstance(error, EngineClosedError):
            return APIError(503, "the server is shutting down", code="shutting_down")
        if isinstance(error, UnknownLoRAError):
            return APIError(404, str(error), code="lora_not_found")
        if isinstance(error, LoRAError):
            return APIError(400, str(error), code="invalid_lora")
        if isinstance(error, InvalidRequestError):
            return APIError(400, str(error), code="invalid_value")
        if isinstance(error, ScalingFailedError):
            return APIError(500, str(error), code="scaling_failed")
        return APIError(409, str(error), code=type(error).__name__)

    def admit(self, count: int) -> None:
        """Shed load: refuse a request while `max_waiting` requests already wait."""
        limit = self.options.max_waiting
        if limit is not None and self.waiting >= limit:
            raise APIError(
                503,
                f"the server is overloaded: {self.waiting} requests are waiting "
                f"(--max-waiting {limit}); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.waiting += count

    async def abort_in_flight(self) -> int:
        """Abort every request still running; they end with finish reason "abort". Those
        still waiting for their client's turn never start (503, shutting down)."""
        self.fair.close()
        if self._ready is None:
            return 0
        aborted = 0
        for request_id in sorted(self.in_flight):
            try:
                await self._ready.engine.abort(request_id)
            except UnknownRequestError:
                continue  # it finished meanwhile
            except EngineError:
                break  # dead or closed: its requests have already ended
            aborted += 1
        return aborted
