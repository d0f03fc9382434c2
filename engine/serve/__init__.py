"""`wavecore serve`: an OpenAI-compatible HTTP server over one `Engine`.

An ASGI app (Starlette) served by Hypercorn, both anyio-native, so the server runs on
asyncio and on trio like the engine below it. Modules, one job each: `command` (the
subcommand's flags), `options` (what they chose), `errors` (OpenAI-style error
bodies), `bodies` (reading a body under the size limit), `parsing` (request JSON into
prompts and `SamplingParams`), `formatting` (response bodies and SSE chunks),
`choices` (running a request's choices on the engine), `state` (readiness, load
shedding, requests in flight), `metrics` (Prometheus), `openai_routes`,
`admin_routes`, `app` (routes, auth, error responses) and `server` (socket, signals,
shutdown).
"""
