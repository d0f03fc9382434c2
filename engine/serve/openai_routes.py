"""The OpenAI-compatible routes: completions, chat completions (whole or streamed as
server-sent events), models, health and version."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from importlib.metadata import version

import anyio
from anyio.abc import ObjectReceiveStream
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from wavecore.engine.errors import InvalidRequestError
from wavecore.engine.serve.bodies import read_json
from wavecore.engine.serve.choices import Choice, ChoiceEvent, prepare_choices, run_choices
from wavecore.engine.serve.errors import APIError, bad_field
from wavecore.engine.serve.fairness import client_key
from wavecore.engine.serve.formatting import (
    SSE_DONE,
    ChoiceResult,
    Header,
    chunk,
    format_logprobs,
    sse,
    usage_chunk,
    whole_body,
)
from wavecore.engine.serve.limits import check_work
from wavecore.engine.serve.parsing import CallKind, GenerationCall, parse_call
from wavecore.engine.serve.state import ReadyEngine, ServerState

_ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}


def openai_routes(state: ServerState) -> list[Route]:
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    async def models(request: Request) -> Response:
        base = state.options.model_name
        entry = {"object": "model", "created": state.started, "owned_by": "wavecore"}
        data = [{"id": base, **entry}]
        ready = state.serving()
        if ready is not None:
            # Each adapter, with its base as parent (upstream's model card fields).
            adapters = await ready.engine.list_loras()
            data += [{"id": a.name, **entry, "root": a.path, "parent": base} for a in adapters]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        state.ready()
        return JSONResponse({})

    async def server_version(request: Request) -> Response:
        return JSONResponse({"version": version("wavecore")})

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", server_version, methods=["GET"]),
    ]


async def _generate(state: ServerState, request: Request, kind: CallKind) -> Response:
    ready = state.ready()
    options = state.options
    body = await read_json(request, options.max_request_bytes, body_timeout=options.body_timeout)
    call = parse_call(kind, body, options.model_name, ready.lora_names())
    check_work(
        len(call.prompts),
        call.n,
        call.params.stop,
        max_requests_per_call=options.max_requests_per_call,
    )
    spec = call.params.structured_outputs
    if spec is not None:
        try:
            await ready.inputs.check_structured_outputs(spec)
        except InvalidRequestError as error:
            raise bad_field(call.structured_field or "structured_outputs", str(error)) from None
    call_id = f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex}"
    choices = prepare_choices(ready, call, call_id)
    client = client_key(
        request.client.host if request.client else None,
        call.user,
        authenticated=options.api_key is not None,
    )
    try:
        state.fair.reserve(client, len(choices))
    except APIError as error:
        if error.status == 429:
            state.metrics.client_limited()
        raise
    try:
        state.admit(len(choices))
    except APIError:
        state.fair.release_reservation(client, len(choices))
        raise
    header = Header(id=call_id, kind=kind, created=int(time.time()), model=state.options.model_name)
    if call.stream:
        return _EventStream(state, ready, call, header, client, choices)
    return JSONResponse(await _whole(state, request, ready, call, header, client, choices))


async def _whole(
    state: ServerState,
    request: Request,
    ready: ReadyEngine,
    call: GenerationCall,
    header: Header,
    client: str,
    choices: Sequence[Choice],
) -> dict[str, object]:
    results = [ChoiceResult() for _ in choices]
    failure: APIError | None = None
    send, receive = anyio.create_memory_object_stream[ChoiceEvent](math.inf)
    async with anyio.create_task_group() as tg, receive:
        tg.start_soon(run_choices, state, ready, client, choices, send)
        tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
        async for event in receive:
            if event.error is not None:
                # The other choices are cancelled, which aborts them on the engine.
                failure = event.error
                tg.cancel_scope.cancel()
                break
            assert event.delta is not None  # an event carries a delta or an error
            results[event.index].add(event.delta)
        tg.cancel_scope.cancel()  # every choice ended: stop watching the client
    if failure is not None:
        raise failure
    return whole_body(header, ready, choices, results, call.logprobs)


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    """A client that goes away before its whole answer is ready cancels `scope`, which
    aborts its choices on the engine (the body has been read: what remains to receive
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class _EventStream(Response):
    """A streamed response whose choices run in a task group around the stream: when
    the client disconnects the stream ends early and the group cancels the choices,
    which aborts their requests on the engine."""

    media_type = "text/event-stream"

    def __init__(
        self,
        state: ServerState,
        ready: ReadyEngine,
        call: GenerationCall,
        header: Header,
        client: str,
        choices: Sequence[Choice],
    ) -> None:
        super().__init__(media_type=self.media_type)
        self._client = client
        self._state = state
        self._ready = ready
        self._call = call
        self._header = header
        self._choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send_events, receive_events = anyio.create_memory_object_stream[ChoiceEvent]()
        async with anyio.create_task_group() as tg, receive_events:
            tg.start_soon(
                run_choices, self._state, self._ready, self._client, self._choices, send_events
            )
            stream = StreamingResponse(
                self._chunks(receive_events),
                media_type=self.media_type,
                headers={"Cache-Control": "no-cache"},
            )
            await stream(scope, receive, send)
            tg.cancel_scope.cancel()

    async def _chunks(self, events: ObjectReceiveStream[ChoiceEvent]) -> AsyncIterator[bytes]:
        call, header = self._call, self._header
        results = [ChoiceResult() for _ in self._choices]
        started = [False] * len(self._choices)
        async for event in events:
            if event.error is not None:
                yield sse(event.error.body())
                return  # ends the response; the task group cancels the other choices
            delta = event.delta
            assert delta is not None  # an event carries a delta or an error
            results[event.index].add(delta)
            first = not started[event.index]
            started[event.index] = True
            text = (self._choices[event.index].echo if first else "") + delta.text
            if not (text or delta.finish_reason or first):
                continue
            logprobs = (
                format_logprobs(header.kind, self._ready, delta.logprobs) if call.logprobs else None
            )
            yield sse(
                chunk(
                    header,
                    event.index,
                    text,
                    delta.finish_reason,
                    first=first,
                    logprobs=logprobs,
                    include_usage=call.include_usage,
                )
            )
        if call.include_usage:
            yield sse(usage_chunk(header, self._choices, results))
        yield SSE_DONE
