"""Fair admission over real sockets: one client's backlog waits at the server while
another client's request goes in at the next free slot; a client's queue is bounded
(429 with Retry-After, streamed or not); a client that goes away takes its queued work
with it. The engine is paused ("keep"), so what it holds (admin /stats) is exactly what
was admitted, and a slot frees only when the test ends a request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio
import httpx
import pytest
from serve_helpers import EXIT_GUARD, NULL_FLAGS, ServerProcess, error_of, serve, wait_held

from wavecore.engine.serve.fairness import client_key

KEY = "fair-key"
# Two engine requests admitted at once in all, two per client, three more queued per client.
FAIR_FLAGS = (
    *NULL_FLAGS,
    "--enable-admin-api",
    "--api-key",
    KEY,
    "--max-inflight",
    "2",
    "--max-inflight-per-client",
    "2",
    "--max-queued-per-client",
    "3",
)
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serve(*FAIR_FLAGS)


@pytest.fixture
async def admin(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    """The operator's client; the engine paused for the test, resumed after it."""
    async with httpx.AsyncClient(base_url=server.url, timeout=EXIT_GUARD, headers=AUTH) as http:
        assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        yield http
        assert (await http.post("/resume")).status_code == 200
        await wait_held(http, 0)
        assert await queued(http) == 0


def client(server: ServerProcess, source: str = "127.0.0.1") -> httpx.AsyncClient:
    """A client connecting from `source` (any 127.x address reaches the loopback server)."""
    transport = httpx.AsyncHTTPTransport(local_address=source)
    return httpx.AsyncClient(
        base_url=server.url, timeout=EXIT_GUARD, headers=AUTH, transport=transport
    )


def completion(prompts: int, **fields: object) -> dict[str, object]:
    return {"prompt": ["p"] * prompts, "max_tokens": 2, **fields}


async def held(http: httpx.AsyncClient) -> set[str]:
    return set((await http.get("/stats")).json()["held"])


async def queued(http: httpx.AsyncClient) -> float:
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith("wavecore:http_requests_queued{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no wavecore:http_requests_queued in /metrics")


async def wait_queued(http: httpx.AsyncClient, count: int) -> None:
    with anyio.fail_after(EXIT_GUARD):
        # The count lives in the server process: polled, under the hang guard above.
        while await queued(http) != count:  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def post(http: httpx.AsyncClient, body: dict[str, object]) -> None:
    """A call whose answer the test does not need (it ends with the test's task group)."""
    await http.post("/v1/completions", json=body)


def call_of(request_id: str) -> str:
    """The call a request id belongs to (`cmpl-<hex>-<choice index>`)."""
    return request_id.rsplit("-", 1)[0]


async def test_another_clients_request_is_admitted_before_a_backlog(
    server: ServerProcess, admin: httpx.AsyncClient
) -> None:
    reasons: dict[str, list[str]] = {}

    async def call(name: str, http: httpx.AsyncClient, body: dict[str, object]) -> None:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        reasons[name] = [choice["finish_reason"] for choice in response.json()["choices"]]

    # The heavy caller (by its `user`, the server requiring a key) takes both slots:
    # one request of its own call, then one of a 4-prompt call whose 3 others queue.
    one = anyio.CancelScope()

    async def single(heavy: httpx.AsyncClient) -> None:
        with one:
            await call("single", heavy, completion(1, user="heavy"))

    async with (
        client(server) as heavy,
        client(server, "127.0.0.2") as light,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(single, heavy)
        await wait_held(admin, 1)
        (first,) = await held(admin)
        tg.start_soon(call, "backlog", heavy, completion(4, user="heavy"))
        await wait_held(admin, 2)
        await wait_queued(admin, 3)
        (backlog,) = await held(admin) - {first}
        # The light client (by its address: no `user`) queues behind the full engine.
        tg.start_soon(call, "light", light, completion(1))
        await wait_queued(admin, 4)
        # The heavy caller gives up its single request: the slot goes to the light
        # client, whose turn comes before the heavy caller's backlog.
        one.cancel()
        await wait_queued(admin, 3)
        admitted = await held(admin) - {backlog}
        assert len(admitted) == 1
        assert call_of(admitted.pop()) not in {call_of(first), call_of(backlog)}
        assert (await admin.post("/resume")).status_code == 200
    assert reasons == {"backlog": ["length"] * 4, "light": ["length"]}


async def test_a_client_past_its_bound_gets_429_others_are_served(
    server: ServerProcess, admin: httpx.AsyncClient
) -> None:
    async with client(server) as heavy, anyio.create_task_group() as tg:
        # 2 admitted, 2 queued: 4 of the 5 (2 + 3) one client may have outstanding.
        tg.start_soon(post, heavy, completion(4, user="heavy"))
        await wait_queued(admin, 2)
        # Counted in engine requests: prompts x n, streamed or not.
        for body in (
            completion(2, user="heavy"),
            completion(1, n=2, user="heavy", stream=True),
        ):
            refused = await heavy.post("/v1/completions", json=body)
            error = error_of(refused, 429)
            assert error["code"] == "rate_limit_exceeded"
            assert "4 outstanding, this call adds 2, at most 5" in str(error["message"])
            assert refused.headers["retry-after"] == "1"
        # One more fits; another client is not limited by the heavy one's bound.
        tg.start_soon(post, heavy, completion(1, user="heavy"))
        tg.start_soon(post, heavy, completion(3, user="other"))
        await wait_queued(admin, 6)
        # A call that no bound could ever take is the caller's mistake, not a retry.
        error = error_of(await heavy.post("/v1/completions", json=completion(6, user="x")), 400)
        assert "at most 5 outstanding" in str(error["message"])
        assert (await admin.post("/resume")).status_code == 200
    metrics = (await admin.get("/metrics")).text
    assert 'wavecore:http_client_limited_total{model_name="' in metrics


async def test_a_client_that_goes_away_takes_its_queued_work_with_it(
    server: ServerProcess, admin: httpx.AsyncClient
) -> None:
    async with client(server) as heavy, anyio.create_task_group() as tg:
        for stream in (False, True):
            tg.start_soon(post, heavy, completion(2, user=f"s{stream}", stream=stream))
        await wait_held(admin, 2)
        await wait_queued(admin, 2)
        tg.cancel_scope.cancel()  # both calls' connections close
    # Their admitted requests are aborted and their queued ones never reach the engine.
    await wait_held(admin, 0)
    await wait_queued(admin, 0)


def test_who_a_client_is() -> None:
    assert client_key("10.0.0.1", None, authenticated=False) == "peer:10.0.0.1"
    # An unauthenticated `user` could be changed on every call to dodge the limits.
    assert client_key("10.0.0.1", "alice", authenticated=False) == "peer:10.0.0.1"
    assert client_key("10.0.0.1", "alice", authenticated=True) == "user:alice"
    assert client_key("10.0.0.1", "", authenticated=True) == "peer:10.0.0.1"
