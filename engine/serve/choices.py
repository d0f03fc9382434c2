"""Running the choices of one request on the engine.

A request becomes one `Choice` per prompt and per `n`, each tokenized and validated
before anything runs (a bad prompt is a 400 before a 200 was sent). Each choice runs
in a task of its own that first waits for its client's turn (`fairness`), then owns its
`engine.generate` iterator, so cancelling the task (the client went away, the response
is done) takes it out of the fair queue, or leaves the iterator in that same task,
which aborts the request on its rank. Tasks report `ChoiceEvent`s into one stream.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import ObjectSendStream

from wavecore.engine.errors import EngineError, InvalidRequestError, PromptTooLongError
from wavecore.engine.outputs import CompletionDelta
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.serve.errors import APIError
from wavecore.engine.serve.fairness import AdmissionClosedError
from wavecore.engine.serve.parsing import GenerationCall
from wavecore.engine.serve.state import ReadyEngine, ServerState

_MAX_SEED = 2**63
_SHUTTING_DOWN = APIError(503, "the server is shutting down", code="shutting_down")


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    index: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # The prompt's text, for `echo`; "" when not echoed.
    echo: str
    # Whether this choice reports its prompt's tokens in `usage` (the first of its `n`).
    counts_prompt: bool
    # The LoRA adapter the request's `model` named (None: the base model).
    lora: str | None = None


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """One delta of choice `index`, or the error that ended it."""

    index: int
    delta: CompletionDelta | None = None
    error: APIError | None = None


def prepare_choices(ready: ReadyEngine, call: GenerationCall, call_id: str) -> list[Choice]:
    """Every choice of `call`, validated and tokenized, or the 400 the first bad prompt
    gets."""
    param = "prompt" if call.kind == "completion" else "messages"
    choices: list[Choice] = []
    for number, prompt in enumerate(call.prompts):
        try:
            prepared = ready.inputs.prepare(call_id, prompt, call.params)
        except PromptTooLongError as error:
            raise APIError(400, str(error), param=param, code="context_length_exceeded") from None
        except InvalidRequestError as error:
            raise APIError(400, str(error), param=param, code="invalid_value") from None
        tokens = prepared.prompt_token_ids
        params = call.params
        if call.max_tokens is None:
            # A chat without a limit may use the rest of the context.
            params = dataclasses.replace(
                params, max_tokens=ready.inputs.max_model_len - len(tokens)
            )
        echo = _echo_text(ready, prompt, tokens) if call.echo else ""
        for sample in range(call.n):
            index = number * call.n + sample
            choices.append(
                Choice(
                    index=index,
                    request_id=f"{call_id}-{index}",
                    prompt_token_ids=tokens,
                    params=_seeded(params, sample),
                    echo=echo,
                    counts_prompt=sample == 0,
                    lora=call.lora,
                )
            )
    return choices


def _echo_text(ready: ReadyEngine, prompt: object, tokens: Sequence[int]) -> str:
    return prompt if isinstance(prompt, str) else ready.text_of(tokens)


def _seeded(params: SamplingParams, sample: int) -> SamplingParams:
    """Choice `sample` of `n`: a seeded request's choices must differ, and each must be
    reproducible, so each gets the seed plus its number."""
    if params.seed is None or sample == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + sample) % _MAX_SEED)


async def run_choices(
    state: ServerState,
    ready: ReadyEngine,
    client: str,
    choices: Sequence[Choice],
    events: ObjectSendStream,
) -> None:
    """Run every choice of `client`'s call as fair admission lets them in, reporting into
    `events` (closed when all ended). The choices were reserved (`FairAdmission.reserve`)."""
    async with events, anyio.create_task_group() as tg:
        for choice in choices:
            tg.start_soon(_run_choice, state, ready, client, choice, events.clone())


@dataclass(slots=True)
class _Progress:
    """One choice's clock, and whether it still waits for its first token."""

    start: float
    last: float
    waiting: bool = True


async def _run_choice(
    state: ServerState,
    ready: ReadyEngine,
    client: str,
    choice: Choice,
    events: ObjectSendStream,
) -> None:
    now = time.perf_counter()
    progress = _Progress(start=now, last=now)
    try:
        async with events:
            try:
                async with state.fair.slot(client):
                    await _generate_choice(state, ready, choice, events, progress)
            except AdmissionClosedError:
                await events.send(ChoiceEvent(choice.index, error=_SHUTTING_DOWN))
    finally:
        # Still waiting: for its turn (cancelled in the fair queue) or its first token.
        if progress.waiting:
            state.waiting -= 1


async def _generate_choice(
    state: ServerState,
    ready: ReadyEngine,
    choice: Choice,
    events: ObjectSendStream,
    progress: _Progress,
) -> None:
    metrics = state.metrics
    state.in_flight.add(choice.request_id)
    try:
        async for delta in ready.engine.generate(
            list(choice.prompt_token_ids),
            choice.params,
            request_id=choice.request_id,
            lora=choice.lora,
        ):
            now = time.perf_counter()
            if delta.token_ids:
                if progress.waiting:
                    progress.waiting = False
                    state.waiting -= 1
                    metrics.first_token(now - progress.start)
                else:
                    metrics.next_tokens(now - progress.last)
                progress.last = now
                metrics.generated(len(delta.token_ids))
            if delta.finish_reason is not None:
                metrics.finished(
                    delta.finish_reason, delta.usage.prompt_tokens, now - progress.start
                )
            await events.send(ChoiceEvent(choice.index, delta=delta))
    except EngineError as error:
        await events.send(ChoiceEvent(choice.index, error=state.error_of(error)))
    finally:
        state.in_flight.discard(choice.request_id)
