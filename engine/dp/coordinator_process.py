"""The DP coordinator process: `CoordinatorMachine` between one PULL and one PUB.

Theory of operation:

1. It binds a PULL (ranks and the client push to it) and a PUB (topic "wave" carries
   `StartDPWave` to the ranks, topic "state" carries `CoordinatorState` to clients),
   and tells the client their real addresses in `CoordinatorHello`.
2. Every message received becomes one event for the machine; the actions it returns
   are performed in order: `BroadcastStartWave` is published at once, `PublishState`
   at once when `immediate`, otherwise at most every `STATE_INTERVAL_S` (the latest
   state wins). The process makes no protocol decision of its own.
3. It exits when every sender (the client and each rank) has closed its stream.
4. It ends soon after the process that started it, however that died
   (`parent_watch`). With the ipc transport it is the one that removes the sockets'
   directory then: a SIGKILLed client runs no `finally`, and the coordinator, the one
   child that lives as long as the engine, is left to do it. SIGTERM (the kernel's
   signal for a dead parent, or the launcher's when the engine ends) removes it too.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
from collections.abc import Callable
from typing import Any

import anyio

from wavecore.channels import ChannelKey, MessageSender, open_pub, open_pull, open_req
from wavecore.engine import messages as m
from wavecore.engine.dp.channel_key import (
    COORDINATOR_HANDSHAKE,
    COORDINATOR_INPUT,
    COORDINATOR_PUBLISH,
)
from wavecore.engine.dp.invalid_frames import InvalidFrameLog
from wavecore.engine.dp.parent_watch import exit_with_parent
from wavecore.statemachines.coordinator import (
    BroadcastStartWave,
    CoordinatorMachine,
    FirstRequest,
    PublishState,
    RankStartedWave,
    RankStats,
    Resize,
    WaveCompleted,
)
from wavecore.statemachines.errors import ProtocolError

STATE_INTERVAL_S = 0.1


def coordinator_main(
    handshake_address: str,
    dp_size: int,
    listen_base: str,
    ipc_directory: str | None,
    channel_key: ChannelKey,
) -> None:
    """The spawned process's entry point; `listen_base` is an ipc prefix or tcp host, and
    `ipc_directory` the directory of the ipc sockets (None with tcp)."""
    exit_with_parent(
        cleanup=functools.partial(shutil.rmtree, ipc_directory, ignore_errors=True)
        if ipc_directory is not None
        else None
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle
    anyio.run(_run_coordinator, handshake_address, dp_size, listen_base, channel_key)


def _listen_address(listen_base: str, name: str) -> str:
    return f"{listen_base}:0" if listen_base.startswith("tcp://") else f"{listen_base}/{name}"


_EVENTS: dict[type, Callable[[Any], object]] = {
    m.FirstRequest: lambda msg: FirstRequest(rank=msg.rank, wave=msg.wave),
    m.WaveStarted: lambda msg: RankStartedWave(rank=msg.rank, wave=msg.wave),
    m.WaveComplete: lambda msg: WaveCompleted(wave=msg.wave),
    m.LoadReport: lambda msg: RankStats(
        rank=msg.rank, waiting=msg.waiting, running=msg.running, kv_usage=msg.kv_usage
    ),
    m.CoordinatorResize: lambda msg: Resize(dp_size=msg.dp_size),
}


async def _run_coordinator(
    handshake_address: str, dp_size: int, listen_base: str, key: ChannelKey
) -> None:
    invalid = InvalidFrameLog("coordinator input")
    async with (
        open_pull(
            listen=_listen_address(listen_base, "coordinator-in"),
            expected_end_of_streams=dp_size + 1,
            on_invalid=invalid,
            signer=key.signer(COORDINATOR_INPUT),
        ) as inputs,
        open_pub(
            listen=_listen_address(listen_base, "coordinator-pub"),
            linger=0.2,
            signer=key.signer(COORDINATOR_PUBLISH),
        ) as pub,
    ):
        signer = key.signer(COORDINATOR_HANDSHAKE)
        async with open_req(dial=handshake_address, signer=signer) as handshake:
            await handshake.send(
                m.CoordinatorHello(
                    pid=os.getpid(), input_address=inputs.address, publish_address=pub.address
                )
            )
            reply = await handshake.receive()
        if not reply.accepted:
            return
        relay = CoordinatorRelay(CoordinatorMachine(dp_size), pub, invalid)
        counted = 0  # the newest ExpectEnds counted: the scaler sends it again until answered
        async with anyio.create_task_group() as tg:
            tg.start_soon(relay.publish_periodically)
            try:
                async for message in inputs:
                    if isinstance(message, m.ExpectEnds):
                        if message.markers < 0:
                            invalid.unexpected(message, "a negative count of markers")
                            continue
                        if message.token > counted:
                            inputs.expect_more_end_of_streams(message.markers)  # a scale's ranks
                            counted = message.token
                        # Over PUB, which drops frames for a slow subscriber.
                        await pub.publish(m.SCALE_TOPIC, m.EndsExpected(token=message.token))
                    else:
                        await relay.receive(message)
            except anyio.EndOfStream:
                pass
            tg.cancel_scope.cancel()


class CoordinatorRelay:
    """Performs the coordinator machine's actions on the PUB channel."""

    def __init__(
        self, machine: CoordinatorMachine, pub: MessageSender, invalid: InvalidFrameLog
    ) -> None:
        self.machine = machine
        self.invalid = invalid
        self._pub = pub
        self._due: m.CoordinatorState | None = None
        self._wake = anyio.Event()

    async def receive(self, message: Any) -> None:
        """One message in, its actions out; one that cannot apply is logged and dropped."""
        convert = _EVENTS.get(type(message))
        if convert is None:
            self.invalid.unexpected(message)
            return
        try:
            actions = self.machine.handle(convert(message))
        except (ProtocolError, ValueError) as error:
            self.invalid.unexpected(message, str(error))
            return
        await self.perform(actions)

    async def perform(self, actions: tuple[Any, ...]) -> None:
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                wave = m.StartDPWave(wave=action.wave, exclude_rank=action.exclude_rank)
                await self._pub.publish(m.WAVE_TOPIC, wave)
            elif isinstance(action, PublishState):
                await self._publish_state(action)

    async def _publish_state(self, action: PublishState) -> None:
        state = m.CoordinatorState(
            wave=action.wave,
            engines_running=action.engines_running,
            waiting=tuple(load.waiting for load in action.loads),
            running=tuple(load.running for load in action.loads),
            kv_usage=tuple(load.kv_usage for load in action.loads),
            dropped_frames=self.invalid.count,
        )
        if action.immediate:
            self._due = None
            await self._pub.publish(m.STATE_TOPIC, state)
        else:
            self._due = state
            self._wake.set()

    async def publish_periodically(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            await anyio.sleep(STATE_INTERVAL_S)  # the rate limit itself, not a race guard
            if self._due is not None:
                state, self._due = self._due, None
                await self._pub.publish(m.STATE_TOPIC, state)
