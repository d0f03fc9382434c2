"""A request sent again after its rank was lost (`FrontEnd.lose_ranks`) travels under
a new id: what the lost rank produced before it died, still on its way, must not reach
the caller's stream (the soak of `test_dp_rank_loss` once saw such a request finish
with the lost rank's token ahead of the survivor's whole answer)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from wavecore.engine import messages as m
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.frontend.core_client import ScaleHost
from wavecore.engine.frontend.engine import serving
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio
HANG_GUARD = 30


class ScriptedRanks:
    """A core client of two ranks whose answers the test writes: every message the
    front end sends is recorded, and `answer` puts a rank's output on the channel."""

    dp_size = 2
    lockstep = False
    max_model_len = 64
    has_coordinator = False
    max_chunk_bytes = None

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.sent: list[tuple[int, Any]] = []
        self.sent_one = anyio.Event()
        self._outputs, self._inbox = anyio.create_memory_object_stream[Any](math.inf)

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        pass

    def attach(self, host: ScaleHost) -> None:
        pass

    async def root_cause(
        self, error: EngineDeadError, *, in_collective: bool = False
    ) -> EngineDeadError:
        return error

    async def send(self, rank: int, message: Any) -> None:
        self.sent.append((rank, message))
        self.sent_one.set()
        self.sent_one = anyio.Event()

    async def send_coordinator(self, message: Any) -> None:
        pass

    async def outputs(self) -> AsyncIterator[Any]:
        async for message in self._inbox:
            yield message

    async def coordinator_states(self) -> AsyncIterator[Any]:
        await anyio.sleep_forever()
        yield  # an async generator that never yields a state

    async def scale(self, host: ScaleHost, new_dp_size: int, drain_timeout: float | None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._outputs.close()
        self._inbox.close()

    async def added(self, rank: int) -> str:
        """The id of the first request added on `rank`, once the front end sent it."""
        while True:
            for to, message in self.sent:
                if to == rank and isinstance(message, m.AddRequest):
                    return message.request_id
            await self.sent_one.wait()

    def answer(self, rank: int, request_id: str, tokens: tuple[int, ...], done: bool) -> None:
        finished = {request_id: "length"} if done else {}
        self._outputs.send_nowait(
            m.StepOutputs(
                rank=rank,
                request_ids=(request_id,),
                token_counts=(len(tokens),),
                token_ids=tokens,
                finished=finished,
            )
        )


async def test_the_lost_ranks_late_output_does_not_reach_a_request_sent_again() -> None:
    core = ScriptedRanks()
    deltas: list[Any] = []
    with anyio.fail_after(HANG_GUARD):
        async with serving(core) as front, anyio.create_task_group() as tg:  # type: ignore[arg-type]

            async def consume() -> None:
                params = SamplingParams(max_tokens=3)
                async for delta in front.generate("hi", params, request_id="r", dp_rank=1):
                    deltas.append(delta)

            tg.start_soon(consume)
            assert await core.added(1) == "r"
            await front.lose_ranks([1], [0], "rank 1 lost (killed by SIGKILL)", resend=True)
            sent_as = await core.added(0)
            core.answer(1, "r", (7,), done=False)  # the lost rank's last step, late
            core.answer(0, sent_as, (1, 2, 3), done=True)
    core.close()
    assert [token for delta in deltas for token in delta.token_ids] == [1, 2, 3]
    assert deltas[-1].finish_reason == "length" and deltas[-1].request_id == "r"
