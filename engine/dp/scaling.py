"""Elastic scaling: `DPClient.scale(n)` changes the number of ranks while serving.

Theory of operation (the client drives; its phases are a `ScalingMachine`, role EXISTING,
so a second `scale` while one is active is refused at once with ScalingInProgressError):

Ranks keep their numbers: a scale up appends ranks `old..new-1`, a scale down removes
the highest ones. Every commit builds a fresh gloo group under a new store prefix
(`<engine prefix>-g<generation>`), so the old and new groups never share keys.

Scale up:
1. PREPARING: spawn the new rank processes; they handshake on the launcher's socket
   with `joining=True` (paused KEEP, `ignore_start_wave`, no group yet), load the model
   and report ready. The existing ranks keep serving meanwhile. Any failure (a crash,
   a load error, a refused configuration, the startup timeout) is rolled back here: the
   new processes are stopped and reaped, and nothing else was touched, so the engine
   still serves at the old size. The error (ScalingFailedError) names what failed.
2. READY -> SWITCHING: pause every rank with KEEP (requests stay frozen), then send
   `SwitchGroup` to every rank of the new group: each joins the new gloo group and all
   of them all-reduce the max of (running, wave, step_counter) into `Reconfigured`.
3. Every rank answered (rank 0's answer is the "reconfigure finished"): the coordinator
   (`Resize`) and the client grow their tables, and the engine resumes. Frozen requests
   continue where they were; new requests reach the new ranks.

The gloo group is built at the commit, not in the background: gloo's rendezvous needs
every member, and the new ranks are only members once they are ready anyway; it costs
one rendezvous while paused.

Scale down (the choice: drain, not abort):
1. The leaving ranks leave load balancing at once (no new request reaches them, an
   explicit `dp_rank` naming one is refused).
2. Requests still running there finish on them, bounded by `drain_timeout` (None: no
   bound); at the bound they are aborted and their streams end with finish_reason
   "abort". No accepted request is lost silently.
3. Pause every rank with KEEP; the leaving ranks' inputs close, so they leave their
   loops, close their channels and exit (reaped here, no orphans); the staying ranks
   switch to the smaller group (as in scale up, step 2); resize; resume.

Scale while the user has paused the engine is refused (ScalingRefusedError): the scale
ends by resuming, which would undo the user's pause, and a drain could never progress.
A failure after the commit started (a rank failing to join the new group) is not rolled
back: the group state of the ranks is then unknown and the error says so.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from wavecore.channels import MessageSender, open_push
from wavecore.engine.dp import messages as m
from wavecore.engine.dp.launcher import (
    KILL_GRACE_S,
    SHUTDOWN_GRACE_S,
    ConfigMismatchError,
    DPStartupError,
    _config_difference,
    process_name,
)
from wavecore.engine.dp.rank_process import describe_config, rank_main
from wavecore.engine.errors import (
    EngineError,
    ScalingFailedError,
    ScalingInProgressError,
    ScalingRefusedError,
)
from wavecore.statemachines.errors import ReconfigurationActiveError
from wavecore.statemachines.rank import PauseMode
from wavecore.statemachines.scaling import (
    CommitRequested,
    GroupPrepared,
    ScaleAborted,
    ScaleDirection,
    ScaleRequested,
    ScaleRole,
    ScalingMachine,
    SwitchDone,
)

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from wavecore.engine.dp.client import DPClient


class Scaler:
    """The client's side of elastic scaling; see the module docstring."""

    def __init__(self, client: DPClient) -> None:
        self._client = client
        self._machine = ScalingMachine(ScaleRole.EXISTING)
        self._generation = 0
        self._hosts: anyio.abc.TaskGroup | None = None
        self._sender_closed: dict[int, anyio.Event] = {}
        self._ends_token = 0
        self._ends_expected = anyio.Event()

    @property
    def active(self) -> bool:
        return self._machine.active

    async def scale(self, new_dp_size: int, *, drain_timeout: float | None) -> None:
        client = self._client
        if isinstance(new_dp_size, bool) or not isinstance(new_dp_size, int) or new_dp_size < 1:
            raise ScalingRefusedError(f"new_dp_size must be an int >= 1, got {new_dp_size!r}")
        if drain_timeout is not None and drain_timeout < 0:
            raise ScalingRefusedError(f"drain_timeout must be >= 0 or None, got {drain_timeout}")
        if self._machine.active:
            raise ScalingInProgressError(
                f"scaling to {self._machine.target_dp_size} ranks is still in progress"
            )
        if client.user_paused:
            raise ScalingRefusedError("the engine is paused: resume it before scaling")
        old = client.dp_size
        if new_dp_size == old:
            return
        direction = ScaleDirection.UP if new_dp_size > old else ScaleDirection.DOWN
        try:
            self._machine.handle(ScaleRequested(direction=direction, dp_size=new_dp_size))
        except ReconfigurationActiveError as error:  # pragma: no cover - checked above
            raise ScalingInProgressError(str(error)) from None
        try:
            if direction is ScaleDirection.UP:
                await self._scale_up(old, new_dp_size)
            else:
                await self._scale_down(old, new_dp_size, drain_timeout)
        except BaseException as error:
            if self._machine.active:
                self._machine.handle(ScaleAborted(reason=str(error) or type(error).__name__))
            raise

    # -- scale up --------------------------------------------------------------------------

    async def _scale_up(self, old: int, new: int) -> None:
        client = self._client
        wiring = client.wiring
        names = [process_name(rank) for rank in range(old, new)]
        senders: list[MessageSender] = []
        try:
            await self._start_ranks(old, new, senders)
        except BaseException as raised:
            error = _sole(raised)
            await self._stop_ranks(names, senders)
            if isinstance(error, (DPStartupError, TimeoutError)):
                raise ScalingFailedError(
                    f"scaling up from {old} to {new} ranks failed and was rolled back "
                    f"(still {old} ranks): {error}"
                ) from error
            raise error from None
        if wiring.watcher is not None:
            # From here on a new rank's death is the engine's, as for the first ranks.
            for name in names:
                wiring.watcher.watch(name, wiring.processes[name])
        self._machine.handle(GroupPrepared())
        await client.pause(PauseMode.KEEP)
        client.user_paused = False  # the scale's own pause, undone below
        self._machine.handle(CommitRequested())
        wiring.to_ranks.extend(senders)
        await self._switch(new)
        await wiring.to_coordinator.send(m.CoordinatorResize(dp_size=new))
        client.resize_tables(new)
        wiring.dp_size = new
        self._machine.handle(SwitchDone())
        await client.resume()

    async def _start_ranks(self, old: int, new: int, senders: list[MessageSender]) -> None:
        """Spawn ranks [old, new) and take their startup handshake (joining); their
        input senders go to `senders` as they open, so a rollback can close them."""
        client = self._client
        wiring = client.wiring
        config = client.config
        handshake = wiring.rank_handshake
        if handshake is None or wiring.listen is None:
            raise ScalingRefusedError("this engine's ranks were not started here; cannot scale")
        self._generation += 1
        count = new - old
        await self._expect_ends(count)
        for rank in range(old, new):
            address = wiring.listen(f"rank{rank}-in-g{self._generation}")
            senders.append(await self._open_sender(address))
        context = multiprocessing.get_context("spawn")
        for rank in range(old, new):
            process = context.Process(
                target=rank_main,
                args=(
                    handshake.address,
                    rank,
                    wiring.rank_configs.get(rank, config),
                    wiring.build_core,
                ),
                name=f"wavecore-dp-rank{rank}",
                daemon=True,
            )
            wiring.processes[process_name(rank)] = process
            process.start()
        expected = describe_config(config)
        ready: set[int] = set()
        with anyio.fail_after(config.startup_timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_startup, range(old, new), tg.cancel_scope)
                while len(ready) < count:
                    message = await handshake.receive()
                    if isinstance(message, m.RankHello):
                        assignment = m.RankAssignment(
                            rank=message.rank,
                            dp_size=new,
                            lockstep=config.dp_mode == "lockstep",
                            sync_interval=config.sync_interval,
                            input_address=senders[message.rank - old].address,
                            output_address=wiring.addresses["outputs"],
                            coordinator_input_address=wiring.addresses["coordinator_input"],
                            coordinator_publish_address=wiring.addresses["coordinator_publish"],
                            store_host=wiring.host,
                            store_port=0 if wiring.store is None else wiring.store.port,
                            group_prefix=self._prefix(),
                            collective_timeout_s=float(config.startup_timeout),
                            joining=True,
                        )
                        await handshake.send(
                            m.HandshakeReply(accepted=True, reason="", assignment=assignment)
                        )
                    elif isinstance(message, m.RankStartupFailed):
                        await handshake.send(
                            m.HandshakeReply(accepted=False, reason="startup failed")
                        )
                        raise DPStartupError(
                            f"rank {message.rank} failed to start: {message.error}"
                        )
                    else:
                        problem = _config_difference(expected, message)
                        await handshake.send(m.HandshakeReply(accepted=not problem, reason=problem))
                        if problem:
                            raise ConfigMismatchError(problem)
                        ready.add(message.rank)
                tg.cancel_scope.cancel()

    async def _watch_startup(self, ranks: range, scope: anyio.CancelScope) -> None:
        """A new rank that dies during its startup ends the wait at once."""
        processes = [self._client.wiring.processes[process_name(rank)] for rank in ranks]
        sentinels = [process.sentinel for process in processes]
        await anyio.to_thread.run_sync(
            multiprocessing.connection.wait, sentinels, abandon_on_cancel=True
        )
        dead = [p for p in processes if p.exitcode is not None]
        names = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
        raise DPStartupError(f"new rank process exited during startup: {names}")

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Hosts the new ranks' input senders for the engine's lifetime (a channel's
        context must be left by the task that entered it)."""
        self._client.wiring.coordinator_state.subscribe(m.SCALE_TOPIC)
        async with anyio.create_task_group() as tg:
            self._hosts = tg
            task_status.started()
            await anyio.sleep_forever()

    async def _expect_ends(self, ranks: int) -> None:
        """`ranks` more senders join the client's output stream and the coordinator's
        input: each receiver ends once every sender sent its one end marker, so both
        must count the newcomers before any of them can end (even a rolled-back one).
        A rank that leaves early sends the marker it was counted for; one that dies
        sends none, and the launcher's shutdown grace and reaping bound that wait."""
        wiring = self._client.wiring
        wiring.outputs.expect_more_end_of_streams(ranks)
        self._ends_token += 1
        self._ends_expected = anyio.Event()
        await wiring.to_coordinator.send(m.ExpectEnds(markers=ranks, token=self._ends_token))
        with anyio.fail_after(self._client.config.startup_timeout):
            await self._ends_expected.wait()

    def on_ends_expected(self, token: int) -> None:
        if token == self._ends_token:
            self._ends_expected.set()

    async def _open_sender(self, address: str) -> MessageSender:
        if self._hosts is None:
            raise ScalingRefusedError("the engine's scaling service is not running")
        closed = anyio.Event()
        sender: MessageSender = await self._hosts.start(_host_sender, address, closed)
        self._sender_closed[id(sender)] = closed
        return sender

    def _prefix(self) -> str:
        return f"{self._client.wiring.group_prefix}-g{self._generation}"

    # -- scale down ------------------------------------------------------------------------

    async def _scale_down(self, old: int, new: int, drain_timeout: float | None) -> None:
        client = self._client
        wiring = client.wiring
        leaving = range(new, old)
        client.route_to(new)
        self._machine.handle(GroupPrepared())
        await self._drain(leaving, drain_timeout)
        await client.pause(PauseMode.KEEP)
        client.user_paused = False
        self._machine.handle(CommitRequested())
        self._generation += 1
        names = [process_name(rank) for rank in leaving]
        senders = wiring.to_ranks[new:]
        del wiring.to_ranks[new:]
        await self._stop_ranks(names, senders)
        await self._switch(new)
        await wiring.to_coordinator.send(m.CoordinatorResize(dp_size=new))
        client.resize_tables(new)
        wiring.dp_size = new
        self._machine.handle(SwitchDone())
        await client.resume()

    async def _drain(self, leaving: range, drain_timeout: float | None) -> None:
        """Let the leaving ranks finish their requests; abort what is left at the bound."""
        client = self._client

        def remaining() -> dict[str, int]:
            return {rid: rank for rid, rank in client.owners.items() if rank in leaving}

        with anyio.move_on_after(drain_timeout if drain_timeout is not None else float("inf")):
            while remaining():
                await client.request_done.wait()
        left = remaining()
        for request_id, rank in left.items():
            await client.send_to_rank(rank, m.AbortRequests(request_ids=(request_id,)))
        with anyio.fail_after(client.config.startup_timeout):
            while remaining():
                await client.request_done.wait()

    # -- shared ------------------------------------------------------------------------------

    async def _switch(self, new: int) -> None:
        """Commit: ranks [0, new) join the new group; every one answers when it did."""
        client = self._client
        call_id, call = client.start_switch(new)
        message = m.SwitchGroup(call_id=call_id, dp_size=new, group_prefix=self._prefix())
        for rank in range(new):
            await client.send_to_rank(rank, message)
        try:
            with anyio.fail_after(client.config.startup_timeout):
                await client.finish_call(call)
        except (EngineError, TimeoutError) as error:
            raise ScalingFailedError(
                f"switching to the {new}-rank group failed after the commit started "
                f"(not rolled back; the engine may be unusable): {error}"
            ) from error

    async def _stop_ranks(self, names: list[str], senders: list[MessageSender]) -> None:
        """Close these ranks' inputs (they leave their loops and exit); reap them."""
        wiring = self._client.wiring
        processes: dict[str, BaseProcess] = wiring.processes
        if wiring.watcher is not None:
            # They exit on purpose (removed, or rolled back): not a death.
            for name in names:
                if name in processes:
                    wiring.watcher.forget(processes[name])
        with anyio.CancelScope(shield=True):
            for sender in senders:
                await sender.aclose()
                closed = self._sender_closed.pop(id(sender), None)
                if closed is not None:
                    closed.set()
            stopping = [processes[name] for name in names if name in processes]
            await anyio.to_thread.run_sync(_join_all, stopping, SHUTDOWN_GRACE_S)
            for process in stopping:
                if process.is_alive():
                    process.terminate()
            await anyio.to_thread.run_sync(_join_all, stopping, KILL_GRACE_S)
            for process in stopping:
                if process.is_alive():
                    process.kill()
                await anyio.to_thread.run_sync(process.join)
                # Rank numbers are reused by a later scale up; keep it for the final reap.
                for name, known in list(processes.items()):
                    if known is process:
                        retired = f"{name} (retired, pid {process.pid})"
                        processes[retired] = processes.pop(name)


def _join_all(processes: list[Any], timeout: float) -> None:
    for process in processes:
        process.join(timeout)


def _sole(error: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, else the group itself."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


async def _host_sender(
    address: str, closed: anyio.Event, *, task_status: anyio.abc.TaskStatus[MessageSender]
) -> None:
    """One new rank's input, open until its rank leaves (`closed`) or the engine ends."""
    async with open_push(listen=address, linger=0.5) as sender:
        task_status.started(sender)
        await closed.wait()
