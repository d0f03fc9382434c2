"""No frame crashes a receiver: every receiving socket of a dp 2 engine (the front end's
outputs, the coordinator's input, the handshakes, a rank's input) is driven with random,
empty, truncated, mutated and replayed frames while requests run, and every request
still ends exactly as it would have; each drop is counted where `stats()` shows it.
Every other frame a stranger sends is signed with the engine's key: unsigned frames are
refused unread, and the signed ones test what a receiver does with bad frames from a
peer that holds the key."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from pathlib import Path

import anyio
import pynng
import pytest
from dp_helpers import HANG_GUARD, VOCAB, collect, expected_tokens, null_config, wiring_of

from wavecore.channels import ChannelKey, Codec, EndOfStream, FrameSigner
from wavecore.engine import messages as m
from wavecore.engine.api import open_dp_engine
from wavecore.engine.dp.channel_key import COORDINATOR_INPUT, RANK_HANDSHAKE, RANK_OUTPUTS
from wavecore.engine.dp.launcher import _host_store
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio
codec = Codec()
ROUNDS = 40  # frames per socket per round


def _stale(rank: int) -> list[object]:
    """Well-formed messages no peer of this engine sends to the front end's outputs:
    outputs of requests long gone, values outside the engine's sizes, news of ranks
    that are no members, and messages of other channels."""
    return [
        m.StepOutputs(
            rank=rank, request_ids=("gone",), token_counts=(1,), token_ids=(5,), finished={}
        ),
        m.StepOutputs(
            rank=rank, request_ids=("live-0",), token_counts=(1,), token_ids=(10**6,), finished={}
        ),
        m.StepOutputs(
            rank=rank,
            request_ids=("live-1",),
            token_counts=(0,),
            token_ids=(),
            finished={"live-1": "bogus"},
        ),
        m.RankAlive(rank=rank, member=99),
        m.RankFailed(rank=rank, error="forged", member=99),
        m.UtilityResult(rank=rank, call_id=10**6, error="forged"),
        m.FirstRequest(rank=rank, wave=0),
        EndOfStream(),
    ]


def _to_coordinator() -> list[object]:
    """Well-formed messages the coordinator refuses: ranks outside the group, a negative
    count of end markers, messages of other channels, an end marker replayed."""
    return [
        m.LoadReport(rank=9, waiting=1, running=1, kv_usage=0.5),
        m.WaveStarted(rank=9, wave=3),
        m.FirstRequest(rank=-1, wave=0),
        m.ExpectEnds(markers=-1, token=1),
        m.RankAlive(rank=0, member=0),
        EndOfStream(),
    ]


def _to_rank() -> list[object]:
    """Well-formed messages a rank refuses or that change nothing live: a prompt outside
    the vocabulary, an empty prompt, aborts of unknown requests, an unknown call."""
    params = SamplingParams(max_tokens=2)
    return [
        m.AddRequest(request_id="ghost-0", prompt_token_ids=(VOCAB + 5,), params=params, wave=0),
        m.AddRequest(request_id="", prompt_token_ids=(1,), params=params, wave=0),
        m.AbortRequests(request_ids=("ghost-1",)),
        m.UtilityCall(call_id=10**6, method="no such method"),
        m.StopRequests(request_ids=("ghost-2",)),
    ]


def _frames(rng: random.Random, valid: list[object], count: int) -> list[bytes]:
    """Random, empty, truncated, mutated and replayed frames made from `valid`."""
    encoded = [codec.encode(message) for message in valid]
    frames: list[bytes] = []
    for _ in range(count):
        base = rng.choice(encoded)
        kind = rng.randrange(6)
        if kind == 0:
            frames.append(rng.randbytes(rng.randrange(1, 300)))
        elif kind == 1:
            frames.append(b"")
        elif kind == 2:
            frames.append(base[: rng.randrange(len(base))])
        elif kind == 3:
            mutated = bytearray(base)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            frames.append(bytes(mutated))
        elif kind == 4:
            frames.append(codec.batch_frame(rng.sample(encoded, k=min(3, len(encoded)))))
        else:
            frames.append(base)  # replayed as is
    return frames


class _Stranger:
    """One connection a stranger keeps to a socket, signing every other frame with
    `signer` (the engine's key for that channel): nng tells its frames apart from the
    engine's own by the connection (pipe), so each counts one end-of-stream marker at
    most."""

    def __init__(self, socket: pynng.Socket, signer: FrameSigner) -> None:
        self._socket = socket
        self._signer = signer
        self._lock = anyio.Lock()

    async def send(self, frames: list[bytes]) -> None:
        async with self._lock:
            for index, frame in enumerate(frames):
                if index % 2:
                    frame = self._signer.sign(frame)
                try:
                    await anyio.to_thread.run_sync(self._socket.send, frame)
                except pynng.Timeout:
                    # Only the handshake stops reading (between scales): what nng does not
                    # take waits for the next scale.
                    return


async def test_hostile_frames_on_every_socket_change_no_request() -> None:
    rng = random.Random(28)
    prompts = [f"request {i} " * (1 + i % 3) for i in range(12)]
    results: dict[int, list] = {}
    # The scale at the end spawns a rank process: on a loaded machine that alone can take
    # most of a minute, so its startup bound is doubled (a hang guard, not a race guard).
    with anyio.fail_after(HANG_GUARD * 3):
        async with open_dp_engine(
            null_config(dp_mode="lockstep", startup_timeout=2 * HANG_GUARD)
        ) as engine:
            wiring = wiring_of(engine)
            addresses = wiring.addresses

            # A REQ socket abandons its request when it sends the next: no reply awaited.
            key = wiring.channel_key
            outputs = _Stranger(
                pynng.Push0(dial=addresses["outputs"], send_timeout=20_000),
                key.signer(RANK_OUTPUTS),
            )
            coordinator = _Stranger(
                pynng.Push0(dial=addresses["coordinator_input"], send_timeout=20_000),
                key.signer(COORDINATOR_INPUT),
            )
            handshake = _Stranger(
                pynng.Req0(dial=addresses["rank_handshake"], send_timeout=500),
                key.signer(RANK_HANDSHAKE),
            )
            # A rank's input listens in the rank: a stranger who dials it can send (and
            # is refused unread), but is never handed a request meant for the rank.
            rank_inputs = [
                _Stranger(
                    pynng.Push0(dial=sender.address, send_timeout=20_000),
                    ChannelKey.generate().signer("rank input"),
                )
                for sender in wiring.to_ranks
            ]
            thieves = [pynng.Pull0(dial=sender.address) for sender in wiring.to_ranks]

            def attacks() -> list[Callable[[], object]]:
                return [
                    lambda: outputs.send(_frames(rng, _stale(0), ROUNDS)),
                    lambda: coordinator.send(_frames(rng, _to_coordinator(), ROUNDS)),
                    lambda: handshake.send(
                        _frames(
                            rng,
                            [
                                m.RankHello(
                                    rank=7,
                                    pid=1,
                                    input_address="tcp://127.0.0.1:9",
                                    input_channel="x",
                                ),
                                *_stale(1),
                            ],
                            ROUNDS,
                        )
                    ),
                    *(
                        lambda sender=sender: _send_frames(sender, _frames(rng, _to_rank(), ROUNDS))
                        for sender in wiring.to_ranks
                    ),
                    *(
                        lambda stranger=stranger: stranger.send(_frames(rng, _to_rank(), ROUNDS))
                        for stranger in rank_inputs
                    ),
                ]

            async def run(index: int) -> None:
                params = SamplingParams(max_tokens=30)
                results[index] = await collect(
                    engine, prompts[index], params, request_id=f"live-{index}"
                )

            async with anyio.create_task_group() as tg:
                for attack in attacks():
                    tg.start_soon(attack)  # type: ignore[arg-type]
                for index in range(len(prompts)):
                    tg.start_soon(run, index)
                for attack in attacks():
                    tg.start_soon(attack)  # type: ignore[arg-type]
            # A last round with nothing in flight; then a scale reads the handshake's
            # backlog (a stray hello once broke it), and the engine serves on.
            async with anyio.create_task_group() as tg:
                for attack in attacks():
                    tg.start_soon(attack)  # type: ignore[arg-type]
            await engine.scale(3)
            again = await collect(engine, prompts[0], SamplingParams(max_tokens=30), dp_rank=2)
            dropped = (await engine.stats()).dropped_frames
            stolen = []
            for thief in thieves:
                with contextlib.suppress(pynng.TryAgain):
                    stolen.append(thief.recv(block=False))
                thief.close()
            for stranger in (outputs, coordinator, handshake, *rank_inputs):
                stranger._socket.close()
    assert stolen == []
    for index, prompt in enumerate(prompts):
        deltas = results[index]
        assert [t for delta in deltas for t in delta.token_ids] == expected_tokens(prompt, 30)
        assert deltas[-1].finish_reason == "length"
    assert [t for delta in again for t in delta.token_ids] == expected_tokens(prompts[0], 30)
    for channel in ("client outputs", "client handshake", "rank 0 input", "rank 1 input"):
        assert dropped[channel] > 0, channel
    # The coordinator's count comes with its published state, which may lag a moment.
    assert "coordinator input" in dropped


async def _send_frames(sender: object, frames: list[bytes]) -> None:
    """Through the front end's own channel to a rank (a stranger cannot reach a rank's
    input: the rank dials the front end)."""
    for frame in frames:
        await sender.send_frame(frame)  # type: ignore[attr-defined]


def _listeners(table: str, port: int) -> list[str]:
    """The local addresses (kernel hex) listening on `port` in /proc/net/tcp or tcp6."""
    rows = [line.split() for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]]
    return [row[1] for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A"]


def test_the_group_store_listens_on_the_asked_address_only() -> None:
    # Given port 0, TCPStore listened on every interface, whatever the engine's host.
    store = _host_store(null_config(dp_mode="lockstep"), "127.0.0.1")
    assert _listeners("tcp", store.port) == [f"0100007F:{store.port:04X}"]
    assert _listeners("tcp6", store.port) == []
