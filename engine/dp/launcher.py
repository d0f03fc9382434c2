"""Starting, watching and reaping the coordinator and rank processes of one DP engine.

Theory of operation:

1. Addresses: with `transport="ipc"` every socket is a file in a private temporary
   directory (removed on exit, whatever happened); with `"tcp"` every listener binds
   127.0.0.1 port 0 and peers are told the address the kernel actually gave it, so no
   port is ever picked and bound later. The client listens on everything it receives
   on or sends to ranks; the coordinator binds its own PULL and PUB and reports them.
2. Processes come from the `spawn` context (never fork: the client may hold threads
   and sockets); the ranks come from the `RankStarter` (`rank_starter`): processes
   spawned here, or Ray actors elsewhere (`ray_launcher`), whose sockets then listen on
   an address of this machine the cluster can reach. They start together; the startup
   handshake then takes the
   coordinator's `CoordinatorHello` first, and then each rank's `RankHello` (answered
   with its `RankAssignment`) and `RankReady` (its configuration compared with the
   client's, a mismatch refused naming every differing field). The whole startup is
   bounded by `startup_timeout`, and the error names the ranks that did not come up.
3. A watcher thread waits on every process's sentinel; an exit is reported to the
   owner (`on_exit`) within moments, during startup and after, for the processes
   started here and for those a scale up adds later (`ProcessWatcher.watch`), with its
   exit status collected (`exit_status`: a signal is named, "killed by SIGKILL"; a Ray
   actor says how and where it ended).
4. On exit the client's senders close first (ranks and coordinator see end of
   stream and leave), every process gets a short grace period, then SIGTERM, then
   SIGKILL, and every one is joined: nothing outlives the block.
5. When this process dies without leaving the block (SIGKILL runs no `finally`), its
   children notice and end by themselves (`parent_watch`), and the coordinator removes
   the ipc directory. The processes are spawned from the event-loop thread, which lives
   as long as the engine: the kernel's parent-death signal fires when the thread that
   spawned a process ends, so it must not be a short-lived worker thread.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import anyio
import anyio.to_thread

from wavecore.channels import (
    ChannelKey,
    MessageReceiver,
    MessageSender,
    MessageStream,
    config_hash,
    open_pull,
    open_push,
    open_rep,
    open_sub,
)
from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.dp.channel_key import (
    COORDINATOR_HANDSHAKE,
    COORDINATOR_INPUT,
    COORDINATOR_PUBLISH,
    RANK_HANDSHAKE,
    RANK_OUTPUTS,
    engine_channel_key,
    rank_input,
)
from wavecore.engine.dp.coordinator_process import coordinator_main
from wavecore.engine.dp.exit_status import describe_end, wait_for_exits
from wavecore.engine.dp.invalid_frames import InvalidFrameLog
from wavecore.engine.dp.rank_process import BuildCore, describe_config
from wavecore.engine.dp.rank_starter import LocalRanks, RankStarter
from wavecore.engine.errors import EngineError

SHUTDOWN_GRACE_S = 3.0
KILL_GRACE_S = 1.0
COORDINATOR = "coordinator"


class DPStartupError(EngineError):
    """A rank or the coordinator did not come up (timeout, crash or load failure)."""


class ConfigMismatchError(DPStartupError):
    """A rank reported a configuration different from the client's."""


def process_name(rank: int) -> str:
    return f"rank {rank}"


@dataclass(slots=True, kw_only=True)
class DPWiring:
    """What the client talks through once startup succeeded."""

    dp_size: int
    max_model_len: int
    to_ranks: list[MessageSender]
    outputs: MessageReceiver
    to_coordinator: MessageSender
    coordinator_state: MessageReceiver
    processes: dict[str, BaseProcess]
    addresses: dict[str, str] = field(default_factory=dict)
    ipc_directory: str | None = None
    invalid_frames: list[InvalidFrameLog] = field(default_factory=list)
    # What elastic scaling (engine/dp/scaling.py) needs to start more ranks later.
    rank_handshake: MessageStream | None = None
    store: Any = None
    host: str = "127.0.0.1"
    build_core: BuildCore | None = None
    starter: RankStarter = field(default_factory=LocalRanks)
    rank_configs: Mapping[int, EngineConfig] = field(default_factory=dict)
    group_prefix: str = ""
    watcher: ProcessWatcher | None = None
    # Every rank's member id (`RankAssignment.member`) by its current number, for the
    # ranks spawned here and the headless ones alike: a loss names a member, since a
    # shrink renumbers the ranks and a headless rank has no process here.
    members: list[int] = field(default_factory=list)
    # How many member ids were handed out (`new_members`): a message naming another
    # member is no rank's.
    members_issued: int = 0
    # Members a shrink dropped: a headless one may still be running.
    dropped: set[int] = field(default_factory=set)
    # What every channel of this engine is signed with (`channel_key`).
    channel_key: ChannelKey = field(default_factory=ChannelKey.generate)

    def new_members(self, count: int) -> list[int]:
        """Member ids for `count` new ranks, never handed out before."""
        first = self.members_issued
        self.members_issued += count
        return list(range(first, self.members_issued))

    def number_of(self, member: int) -> int | None:
        """A member's current rank number; None once it left (or before it is ready)."""
        return self.members.index(member) if member in self.members else None

    def member_of(self, process: BaseProcess) -> int | None:
        """The member a rank process spawned here is; None for the coordinator, a
        retired rank, or a rank a scale up is still starting."""
        for name, current in self.processes.items():
            if current is process and name.startswith("rank ") and "retired" not in name:
                number = int(name.removeprefix("rank "))
                return self.members[number] if number < len(self.members) else None
        return None


class _Addresses:
    def __init__(self, transport: str, host: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="wavecore-dp-") if transport == "ipc" else None
        self.base = f"ipc://{self.directory}" if self.directory else f"tcp://{host}"

    def listen(self, name: str) -> str:
        return f"{self.base}/{name}" if self.directory else f"{self.base}:0"

    def remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _host_store(config: EngineConfig, host: str) -> Any:
    """The lockstep group's store, listening on `host` only: given a port of 0, TCPStore
    listens on every interface, so it is handed a socket bound here (and owns it)."""
    if config.dp_mode != "lockstep":
        return None
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family, backlog=128) as listener:
        port = listener.getsockname()[1]
        listening = os.dup(listener.fileno())
    try:
        return dist.TCPStore(
            host, port, None, True, wait_for_workers=False, master_listen_fd=listening
        )
    except BaseException:
        os.close(listening)
        raise


def open_rank_input(
    key: ChannelKey, hello: m.RankHello
) -> AbstractAsyncContextManager[MessageSender]:
    """The input of the rank that said `hello`: a PUSH channel that dials the rank's
    listening input (`channel_key` rule 4)."""
    signer = key.signer(rank_input(hello.input_channel))
    return open_push(dial=hello.input_address, linger=0.5, signer=signer)


def _split_master(
    master: str | None, config: EngineConfig, starter: RankStarter
) -> tuple[str, int]:
    if master is None:
        return starter.host, 0
    if config.transport != "tcp":
        raise ValueError("ranks joining from elsewhere (master=...) need transport='tcp'")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"master must be HOST:PORT, got {master!r}")
    return host, int(port)


@asynccontextmanager
async def open_dp_processes(
    config: EngineConfig,
    *,
    build_core: BuildCore,
    on_exit: Callable[[str, str], None],
    rank_configs: Mapping[int, EngineConfig] | None = None,
    master: str | None = None,
    local_ranks: Collection[int] | None = None,
    on_listening: Callable[[str], None] | None = None,
    starter: RankStarter | None = None,
) -> AsyncIterator[DPWiring]:
    """Start the coordinator and `config.dp_size` ranks; yield the client's channels.

    `rank_configs` gives chosen ranks a configuration of their own (the handshake must
    then refuse them unless it equals `config`). `on_exit(name, how)` is called on the
    event loop when a process ends after startup, saying how it ended (`describe_end`).
    `starter` starts the ranks (default: `LocalRanks`, processes of this machine).

    Headless ranks: with `master="HOST:PORT"` (tcp only) every socket listens on HOST,
    the ranks' handshake on PORT (0: any, reported to `on_listening`), and only
    `local_ranks` are spawned here; the others join with `wavecore rank`. Their death is
    seen when they fail, not by a process watch.
    """
    starter = LocalRanks() if starter is None else starter
    host, port = _split_master(master, config, starter)
    spawned = range(config.dp_size) if local_ranks is None else sorted(set(local_ranks))
    key = engine_channel_key(config, headless=len(spawned) < config.dp_size)
    addresses = _Addresses(config.transport, host)
    store = _host_store(config, host)
    processes: dict[str, BaseProcess] = {}
    started = False
    watcher = ProcessWatcher()
    try:
        async with AsyncExitStack() as stack:
            invalid = [
                InvalidFrameLog("client outputs"),
                InvalidFrameLog("client state"),
                InvalidFrameLog("client handshake"),
            ]
            coordinator_rep = await stack.enter_async_context(
                open_rep(
                    listen=addresses.listen("coordinator-handshake"),
                    on_invalid=invalid[2],
                    signer=key.signer(COORDINATOR_HANDSHAKE),
                )
            )
            rank_handshake = (
                f"tcp://{host}:{port}" if master else addresses.listen("rank-handshake")
            )
            rank_rep = await stack.enter_async_context(
                open_rep(
                    listen=rank_handshake, on_invalid=invalid[2], signer=key.signer(RANK_HANDSHAKE)
                )
            )
            if on_listening is not None:
                on_listening(rank_rep.address)
            outputs = await stack.enter_async_context(
                open_pull(
                    listen=addresses.listen("outputs"),
                    expected_end_of_streams=config.dp_size,
                    recv_buffer_size=256,
                    on_invalid=invalid[0],
                    signer=key.signer(RANK_OUTPUTS),
                )
            )
            to_ranks: list[MessageSender] = []  # opened once the ranks said hello
            context = multiprocessing.get_context("spawn")
            processes[COORDINATOR] = context.Process(
                target=coordinator_main,
                args=(
                    coordinator_rep.address,
                    config.dp_size,
                    addresses.base,
                    addresses.directory,
                    key,
                ),
                name="wavecore-dp-coordinator",
                daemon=True,
            )
            processes[COORDINATOR].start()
            configs = {rank: (rank_configs or {}).get(rank, config) for rank in spawned}
            ranks = await starter.start(rank_rep.address, configs, build_core, key)
            processes.update({process_name(rank): ranks[rank] for rank in spawned})
            wiring = DPWiring(
                dp_size=config.dp_size,
                max_model_len=0,
                to_ranks=to_ranks,
                outputs=outputs,
                to_coordinator=None,  # type: ignore[arg-type]  # set by the handshake
                coordinator_state=None,  # type: ignore[arg-type]
                processes=processes,
                invalid_frames=invalid,
                ipc_directory=addresses.directory,
            )
            wiring.rank_handshake = rank_rep
            wiring.channel_key = key
            wiring.store = store
            wiring.host = host
            wiring.build_core = build_core
            wiring.starter = starter
            wiring.rank_configs = dict(rank_configs or {})
            wiring.watcher = watcher
            wiring.members = wiring.new_members(config.dp_size)
            wiring.addresses["outputs"] = outputs.address
            wiring.addresses["rank_handshake"] = rank_rep.address
            async with anyio.create_task_group() as tg, AsyncExitStack() as late:
                await tg.start(watcher.run, processes, on_exit)
                await _startup(
                    late,
                    config,
                    wiring,
                    coordinator_rep,
                    rank_rep,
                    to_ranks,
                    watcher,
                )
                started = True
                try:
                    yield wiring
                finally:
                    watcher.closing = True
                    await _close_senders([*to_ranks, wiring.to_coordinator])
                    with anyio.CancelScope(shield=True):
                        await reap(processes, grace=SHUTDOWN_GRACE_S if watcher.clean else 0.0)
                    watcher.stop()
    finally:
        watcher.stop()
        if not started:
            with anyio.CancelScope(shield=True):
                await reap(processes, grace=0.0)
        watcher.close()
        addresses.remove()


async def _close_senders(senders: list[MessageSender | None]) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_GRACE_S):
        async with anyio.create_task_group() as tg:
            for sender in senders:
                if sender is not None:
                    tg.start_soon(sender.aclose)


async def _startup(
    stack: AsyncExitStack,
    config: EngineConfig,
    wiring: DPWiring,
    coordinator_rep: MessageStream,
    rank_rep: MessageStream,
    to_ranks: list[MessageSender],
    watcher: ProcessWatcher,
) -> None:
    expected = describe_config(config)
    hellos: dict[int, m.RankHello] = {}
    ready: set[int] = set()
    group_prefix = f"wavecore-dp-{uuid.uuid4().hex}"
    wiring.group_prefix = group_prefix

    async def handshake() -> None:
        while type(hello := await coordinator_rep.receive()) is not m.CoordinatorHello:
            wiring.invalid_frames[2].unexpected(hello)
            await coordinator_rep.send(m.HandshakeReply(accepted=False, reason="unexpected"))
        await coordinator_rep.send(m.HandshakeReply(accepted=True, reason=""))
        wiring.addresses["coordinator_input"] = hello.input_address
        wiring.addresses["coordinator_publish"] = hello.publish_address
        while len(ready) < config.dp_size:
            message = await rank_rep.receive()
            answered = await answer_rank(
                rank_rep,
                message,
                expected,
                range(config.dp_size),
                wiring.invalid_frames[2],
                hellos,
                lambda rank: rank_assignment(
                    config,
                    wiring,
                    rank=rank,
                    dp_size=config.dp_size,
                    group_prefix=group_prefix,
                    member=wiring.members[rank],
                ),
            )
            if answered is not None:
                ready.add(answered.rank)
                if answered.rank == 0:
                    wiring.max_model_len = answered.max_model_len

    try:
        with anyio.fail_after(config.startup_timeout):
            with anyio.CancelScope() as scope:
                watcher.on_startup_exit = lambda name, code: scope.cancel()
                await handshake()
    except TimeoutError:
        missing = [r for r in range(config.dp_size) if r not in ready]
        silent = [r for r in missing if r not in hellos]
        detail = f" ({', '.join(map(process_name, silent))} never said hello)" if silent else ""
        raise DPStartupError(
            f"{', '.join(map(process_name, missing))} did not report ready within "
            f"{config.startup_timeout} s{detail}"
        ) from None
    finally:
        watcher.on_startup_exit = None
    if watcher.exits:
        name, how = watcher.exits[0]
        raise DPStartupError(f"{name} ended during startup ({how})")
    # Opened here, outside the startup's cancel scopes, since they outlive them.
    for rank in range(config.dp_size):
        to_ranks.append(
            await stack.enter_async_context(open_rank_input(wiring.channel_key, hellos[rank]))
        )
    wiring.to_coordinator = await stack.enter_async_context(
        open_push(
            dial=wiring.addresses["coordinator_input"],
            linger=0.5,
            signer=wiring.channel_key.signer(COORDINATOR_INPUT),
        )
    )
    wiring.coordinator_state = await stack.enter_async_context(
        open_sub(
            dial=wiring.addresses["coordinator_publish"],
            topics=[m.STATE_TOPIC],
            on_invalid=wiring.invalid_frames[1],
            signer=wiring.channel_key.signer(COORDINATOR_PUBLISH),
        )
    )
    with anyio.fail_after(config.startup_timeout):
        await wiring.coordinator_state.wait_connected()


def rank_assignment(
    config: EngineConfig,
    wiring: DPWiring,
    *,
    rank: int,
    dp_size: int,
    group_prefix: str,
    member: int,
    joining: bool = False,
) -> m.RankAssignment:
    """Where a rank connects and which group it joins (the coordinator's addresses and
    the store must already be in `wiring`)."""
    return m.RankAssignment(
        rank=rank,
        dp_size=dp_size,
        lockstep=config.dp_mode == "lockstep",
        sync_interval=config.sync_interval,
        output_address=wiring.addresses["outputs"],
        coordinator_input_address=wiring.addresses["coordinator_input"],
        coordinator_publish_address=wiring.addresses["coordinator_publish"],
        store_host=wiring.host,
        store_port=0 if wiring.store is None else wiring.store.port,
        group_prefix=group_prefix,
        collective_timeout_s=float(config.collective_timeout),
        member=member,
        joining=joining,
    )


async def answer_rank(
    rep: MessageStream,
    message: Any,
    expected: dict[str, str],
    ranks: Collection[int],
    invalid: InvalidFrameLog,
    hellos: dict[int, m.RankHello],
    assign: Callable[[int], m.RankAssignment],
) -> m.RankReady | None:
    """Answer one message of a rank's startup handshake: its hello with its assignment
    (the hello kept in `hellos`: where the rank's input listens), its report with the
    verdict on its configuration. The report of a rank now ready is returned; a failed
    or mismatched rank raises (after it was told). A message that is no handshake's, or
    names a rank not starting (`ranks`), is refused and dropped."""
    handshake = (m.RankHello, m.RankStartupFailed, m.RankReady)
    if (
        type(message) not in handshake
        or message.rank not in ranks
        or (type(message) is m.RankReady and message.rank not in hellos)
    ):
        invalid.unexpected(message, "no rank of this handshake")
        await rep.send(m.HandshakeReply(accepted=False, reason="unexpected"))
        return None
    if isinstance(message, m.RankHello):
        hellos[message.rank] = message
        assignment = assign(message.rank)
        await rep.send(m.HandshakeReply(accepted=True, reason="", assignment=assignment))
        return None
    if isinstance(message, m.RankStartupFailed):
        await rep.send(m.HandshakeReply(accepted=False, reason="startup failed"))
        raise DPStartupError(f"rank {message.rank} failed to start: {message.error}")
    problem = config_difference(expected, message)
    await rep.send(m.HandshakeReply(accepted=not problem, reason=problem))
    if problem:
        raise ConfigMismatchError(problem)
    ready: m.RankReady = message
    return ready


def config_difference(expected: dict[str, str], ready: m.RankReady) -> str:
    if ready.config_hash == config_hash(expected):
        return ""
    names = sorted(set(expected) | set(ready.config_items))
    differences = [
        f"{name}: client {expected.get(name)}, rank {ready.config_items.get(name)}"
        for name in names
        if expected.get(name) != ready.config_items.get(name)
    ]
    return f"rank {ready.rank} configuration differs from the client's: " + "; ".join(
        differences or ["(hash differs)"]
    )


class ProcessWatcher:
    """Waits on process sentinels in a worker thread; reports exits on the event loop.

    It watches the processes `run` starts with and those `watch` adds later (ranks a
    scale up started); `forget` takes back a process about to be stopped on purpose,
    whose exit is then no death. Processes are told apart by identity, not name: a
    later scale up reuses a removed rank's name.
    """

    def __init__(self) -> None:
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._watched: dict[int, tuple[str, BaseProcess]] = {}
        self._stopping = False
        self.exits: list[tuple[str, str]] = []
        self.on_startup_exit: Callable[[str, str], None] | None = None
        self.clean = True
        self.closing = False

    async def run(
        self,
        processes: Mapping[str, BaseProcess],
        on_exit: Callable[[str, str], None],
        *,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        for name, process in processes.items():
            self._watched[id(process)] = (name, process)
        task_status.started()
        while not self._stopping:
            ended = await anyio.to_thread.run_sync(
                wait_for_exits,
                [process for _, process in self._watched.values()],
                self._wake_reader,
                abandon_on_cancel=True,
            )
            with contextlib.suppress(BlockingIOError):
                self._wake_reader.recv(4096)
            for process in ended:
                watched = self._watched.pop(id(process), None)
                if watched is None or self.closing:
                    continue  # forgotten while the thread waited, or ending on purpose
                name = watched[0]
                how = describe_end(process)
                self.exits.append((name, how))
                self.clean = False
                if self.on_startup_exit is not None:
                    self.on_startup_exit(name, how)
                else:
                    on_exit(name, how)

    def watch(self, name: str, process: BaseProcess) -> None:
        """Report this started process's exit too, from now on."""
        self._watched[id(process)] = (name, process)
        self._wake()

    def forget(self, process: BaseProcess) -> None:
        """Stop watching `process` (it is being stopped on purpose)."""
        self._watched.pop(id(process), None)
        self._wake()

    def stop(self) -> None:
        """Have `run` return."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"x")

    def close(self) -> None:
        self._wake_reader.close()
        self._wake_writer.close()


async def reap(processes: Mapping[str, BaseProcess], *, grace: float) -> None:
    """Join these processes: `grace` seconds to exit, then SIGTERM, then SIGKILL."""
    started = [p for p in processes.values() if p.pid is not None]

    def join_all(timeout: float) -> None:
        deadline = _deadline(timeout)
        for process in started:
            process.join(max(0.0, deadline()))

    await anyio.to_thread.run_sync(join_all, grace)
    for process in started:
        if process.is_alive():
            process.terminate()
    await anyio.to_thread.run_sync(join_all, KILL_GRACE_S)
    for process in started:
        if process.is_alive():
            process.kill()
    # SIGKILL always ends a process, though one stuck in the kernel may take a moment.
    for process in started:
        await anyio.to_thread.run_sync(process.join)


def _deadline(timeout: float) -> Callable[[], float]:
    """Seconds left until `timeout` from now (a plain monotonic clock, usable in threads)."""
    end = time.monotonic() + timeout
    return lambda: end - time.monotonic()
