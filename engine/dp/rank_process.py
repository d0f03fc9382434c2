"""One DP engine rank: its process entry point, its startup and its busy loop.

Theory of operation:

1. `rank_main` is what the launcher spawns. The rank dials the client's handshake
   socket, says `RankHello`, receives its `RankAssignment` (addresses, DP group), opens
   its channels, loads its model on its `ModelThread`, joins the gloo group (lockstep
   only), and reports `RankReady` with its configuration hash. A refusal ends it.
2. One anyio task group runs: a receiver per inbound channel (client PULL, coordinator
   SUB), each pouring messages into one in-memory stream, and `RankLoop.run`. Senders
   are `MessageSender`s, which batch everything sent in one tick into one frame.
3. The rank's busy loop is `core.rank_runner.RankRunner`, the same as a rank in the
   front end's process: the rank loop of `wavecore.statemachines` over an `EngineCore`,
   with the channels as its input, outputs and coordinator. A rank started by a scale
   up is built `joining`; its machine freezes its scheduler before any input.
4. If anything in the loop raises, the rank reports `RankFailed` (naming itself) and
   waits for the client to close its input; the client fails every request. With
   `on_rank_failure="shrink"` a broken collective is reported and survived instead
   (`RankRunner` rule 6): the client shrinks the group around the lost rank.
5. A spawned rank ends soon after the process that started it, however that died
   (`parent_watch`); it creates nothing that outlives it, so it has nothing to remove.
6. Heartbeats (`heartbeat`): every rank beats to the front end from its event loop; a
   headless rank, which has no parent to watch, exits when its front end goes silent
   (with `FRONT_END_LOST_EXIT`).
7. Once the rank's loop and channels are closed, the process ends at once
   (`os._exit`), skipping the interpreter's teardown: that teardown destroys every gloo
   group, and the destructor of a group that broke joins gloo's worker thread, which
   may still wait in a receive from a peer that is gone until collective_timeout
   (seen: a dropped headless rank, continued, took a minute to exit). Nothing of the
   rank's needs the teardown: its channels and model are closed by then.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import asdict
from multiprocessing import parent_process
from typing import Any, NoReturn

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from wavecore.channels import (
    ChannelKey,
    MessageReceiver,
    config_hash,
    open_pull,
    open_push,
    open_req,
    open_sub,
)
from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.model_thread import ModelThread
from wavecore.engine.core.rank_runner import DPGroupHandle, GroupJoiner, RankRunner, Shutdown, Sink
from wavecore.engine.dp.channel_key import (
    COORDINATOR_INPUT,
    COORDINATOR_PUBLISH,
    RANK_HANDSHAKE,
    RANK_OUTPUTS,
    rank_input,
)
from wavecore.engine.dp.heartbeat import FRONT_END_LOST_EXIT, FrontEndWatch
from wavecore.engine.dp.invalid_frames import InvalidFrameLog
from wavecore.engine.dp.invalid_frames import counts as invalid_frame_counts
from wavecore.engine.dp.parent_watch import exit_with_parent
from wavecore.statemachines import RankMachine

BuildCore = Callable[[EngineConfig], EngineCore]


# How a rank was reached and who started it, how long it may take to start, how far the
# client may scale, whether it restarts lost ranks and where each machine keeps the
# channel key change nothing a rank computes; `lora_modules` are the front end's to load
# (`Engine.add_lora` on every rank).
_DEPLOYMENT_FIELDS = frozenset(
    {
        "transport",
        "startup_timeout",
        "max_dp_size",
        "restart_ranks",
        "dp_backend",
        "ray_address",
        "channel_key_file",
        # Each process names its own certificate files.
        "tls_cert_file",
        "tls_key_file",
        "tls_ca_file",
        "tls_server_name",
        "lora_modules",
    }
)


def describe_config(config: EngineConfig) -> dict[str, str]:
    """The configuration a rank reports; every rank of a group must report the same."""
    return {
        name: repr(value)
        for name, value in asdict(config).items()
        if name not in _DEPLOYMENT_FIELDS
    }


def rank_main(
    handshake_address: str,
    rank: int,
    config: EngineConfig,
    build_core: BuildCore,
    channel_key: ChannelKey,
) -> NoReturn:
    """The spawned process's entry point (also `wavecore rank`'s, which has no parent
    process to watch). It ends the process (rule 7), with exit code 0, or
    `FRONT_END_LOST_EXIT`."""
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle
    # Headless (no parent process): no parent watch ends it, its front end's silence does.
    code = run_rank(
        handshake_address,
        rank,
        config,
        build_core,
        channel_key,
        judges_front_end=parent_process() is None,
    )
    _leave_process(code)


def run_rank(
    handshake_address: str,
    rank: int,
    config: EngineConfig,
    build_core: BuildCore,
    channel_key: ChannelKey,
    *,
    judges_front_end: bool,
) -> int:
    """Run the rank until its input ends; its exit code (0, or `FRONT_END_LOST_EXIT`
    when `judges_front_end` and the front end fell silent). The caller ends the process
    (rule 7): `rank_main` at once, a Ray actor's owner by killing it."""
    watch = FrontEndWatch(
        interval=config.heartbeat_interval,
        timeout=config.heartbeat_timeout,
        judges=judges_front_end,
    )
    anyio.run(_run_rank, handshake_address, rank, config, build_core, channel_key, watch)
    return FRONT_END_LOST_EXIT if watch.lost else 0


def _leave_process(code: int) -> NoReturn:
    """Rule 7: flush what is buffered, then end without the interpreter's teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _run_rank(
    handshake_address: str,
    rank: int,
    config: EngineConfig,
    build_core: BuildCore,
    key: ChannelKey,
    watch: FrontEndWatch,
) -> None:
    invalid = InvalidFrameLog(f"rank {rank} input")
    channel = secrets.token_hex(8)
    async with (
        open_pull(
            listen=input_listen_address(handshake_address),
            on_invalid=invalid,
            signer=key.signer(rank_input(channel)),
        ) as inputs,
        open_req(dial=handshake_address, signer=key.signer(RANK_HANDSHAKE)) as handshake,
    ):
        hello = m.RankHello(
            rank=rank, pid=os.getpid(), input_address=inputs.address, input_channel=channel
        )
        await handshake.send(hello)
        reply = await handshake.receive()
        if not reply.accepted or reply.assignment is None:
            return
        assignment: m.RankAssignment = reply.assignment
        if config.executor == "model":
            _share_cpu_threads(assignment.dp_size)
        with ModelThread(f"wavecore-rank{rank}") as model_thread:
            async with AsyncExitStack() as stack:
                invalid_waves = InvalidFrameLog(f"rank {rank} wave subscription")
                waves = await stack.enter_async_context(
                    open_sub(
                        dial=assignment.coordinator_publish_address,
                        topics=[m.WAVE_TOPIC],
                        on_invalid=invalid_waves,
                        signer=key.signer(COORDINATOR_PUBLISH),
                    )
                )
                outputs = await stack.enter_async_context(
                    open_push(
                        dial=assignment.output_address,
                        linger=0.5,
                        signer=key.signer(RANK_OUTPUTS),
                    )
                )
                coordinator = await stack.enter_async_context(
                    open_push(
                        dial=assignment.coordinator_input_address,
                        linger=0.5,
                        signer=key.signer(COORDINATOR_INPUT),
                    )
                )
                try:
                    core = await model_thread.run(build_core, config)
                    group = None
                    if assignment.lockstep and not assignment.joining:
                        from wavecore.engine.dp.collective import DPGroup

                        group = await model_thread.run(
                            lambda: DPGroup.join(
                                host=assignment.store_host,
                                port=assignment.store_port,
                                prefix=assignment.group_prefix,
                                rank=rank,
                                size=assignment.dp_size,
                                rendezvous_timeout_s=config.startup_timeout,
                                timeout_s=assignment.collective_timeout_s,
                                key=key,
                            )
                        )
                except Exception as error:
                    await handshake.send(
                        m.RankStartupFailed(rank=rank, error=f"{type(error).__name__}: {error}")
                    )
                    await handshake.receive()
                    return
                await waves.wait_connected()
                items = describe_config(config)
                await handshake.send(
                    m.RankReady(
                        rank=rank,
                        config_hash=config_hash(items),
                        config_items=items,
                        max_model_len=core.executor.max_model_len,
                    )
                )
                verdict = await handshake.receive()
                if not verdict.accepted:
                    return
                if config.async_scheduling:
                    # The heap now holds the model and the engine for the process's
                    # lifetime, so the garbage collector need not scan it again. The
                    # batch queue keeps a step's objects alive while it builds the next,
                    # which otherwise sets off full collections of the whole heap (about
                    # 100 ms each with torch loaded) while the forward that finished
                    # waits for the GIL (README, "The batch queue"); the serial loop
                    # never set one off there.
                    gc.collect()
                    gc.freeze()
                machine = RankMachine(
                    rank,
                    assignment.dp_size,
                    sync_interval=assignment.sync_interval,
                    lockstep=assignment.lockstep,
                    joining=assignment.joining,
                )
                runner = RankRunner(
                    core=core,
                    machine=machine,
                    model_thread=model_thread,
                    group=group,
                    outputs=outputs,
                    coordinator=coordinator,
                    on_invalid=invalid.unexpected,
                    join_group=_group_joiner(assignment, key) if assignment.lockstep else None,
                    survive_lost_group=config.on_rank_failure == "shrink",
                    member=assignment.member,
                    dropped_frames=lambda: invalid_frame_counts((invalid, invalid_waves)),
                )
                try:
                    await _serve(runner, inputs, waves, outputs, watch, assignment.member)
                finally:
                    await model_thread.run(core.close)


def input_listen_address(handshake_address: str) -> str:
    """Where a rank's input listens (`channel_key` rule 4): beside the front end's ipc
    sockets, or on this machine's address on the way to the front end (port 0: any)."""
    if handshake_address.startswith("ipc://"):
        directory = os.path.dirname(handshake_address.removeprefix("ipc://"))
        return f"ipc://{directory}/rank-input-{os.getpid()}"
    host, _, port = handshake_address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))  # picks the route; sends nothing
        local = probe.getsockname()[0]
    return f"tcp://[{local}]:0" if family == socket.AF_INET6 else f"tcp://{local}:0"


def _share_cpu_threads(dp_size: int) -> None:
    """Ranks on one machine split its cores instead of each oversubscribing all of them."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dp_size))


def _group_joiner(assignment: m.RankAssignment, key: ChannelKey) -> GroupJoiner:
    """How this rank joins the group a scale switches to (over the client's store,
    signed with `key`)."""
    # Imported now, not at the switch: the import takes seconds on a busy machine, which
    # would count against the collective timeout of every member waiting for this one.
    from wavecore.engine.dp.group_switch import join_and_agree

    def join(
        *, prefix: str, dp_size: int, rank: int, running: bool, wave: int, step_counter: int
    ) -> tuple[DPGroupHandle | None, tuple[bool, int, int]]:
        group, agreed = join_and_agree(
            host=assignment.store_host,
            port=assignment.store_port,
            prefix=prefix,
            rank=rank,
            size=dp_size,
            timeout_s=assignment.collective_timeout_s,
            running=running,
            wave=wave,
            step_counter=step_counter,
            key=key,
        )
        return group, (agreed.running, agreed.wave, agreed.step_counter)

    return join


async def _serve(
    runner: RankRunner,
    inputs: MessageReceiver,
    waves: MessageReceiver,
    outputs: Sink,
    watch: FrontEndWatch,
    member: int,
) -> None:
    send, receive = anyio.create_memory_object_stream[Any](max_buffer_size=1 << 16)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_pour, inputs, send.clone(), True, watch.heard, runner.interrupt_collective)
        tg.start_soon(_pour, waves, send.clone(), False)
        tg.start_soon(watch.run, outputs, lambda: runner.rank, member, tg.cancel_scope)
        send.close()
        await runner.run(receive)
        tg.cancel_scope.cancel()


async def _pour(
    channel: MessageReceiver,
    inbox: MemoryObjectSendStream[Any],
    ends_rank: bool,
    heard: Callable[[], None] | None = None,
    leaving: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Feed `channel` into the runner's inbox; `heard` is told of every message (the
    front end's beats stop here), `leaving` awaited before a `LeaveGroup` or the end of
    the rank's input goes in."""
    async with inbox:
        try:
            async for message in channel:
                if heard is not None:
                    heard()
                    if type(message) is m.FrontEndAlive:
                        continue
                if leaving is not None and type(message) is m.LeaveGroup:
                    await leaving()
                await inbox.send(message)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        if ends_rank:
            if leaving is not None:
                await leaving()
            await inbox.send(Shutdown())
