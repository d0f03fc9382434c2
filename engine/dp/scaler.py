"""Elastic scaling: the `Scaler` performs `ScalingMachine`'s script, and nothing else.

Theory of operation:

1. The machine (`wavecore.statemachines.scaling`, read its docstring) decides every
   step of a reconfiguration, including why leaving ranks drain and why the new group
   is built at the switch; the simulation performs the same script over modelled
   effects. Here each action is performed for real: `StartRanks` spawns processes and
   takes their startup handshake (joining: paused, their scheduler frozen by their own
   machine), `RouteTo` and `ResizeTables` change the front end's tables, `DrainRanks`
   waits for the leaving ranks' requests (aborting what is left at `drain_timeout`),
   `PauseRanks`, `SwitchGroup` and `ResumeRanks` are calls to ranks through the front
   end, `StopRanks` closes ranks' inputs and reaps their processes, and
   `ResizeCoordinator` tells the coordinator and waits for its publication of the new
   size (so no message of a new rank can reach a coordinator that does not know it).
2. Ranks keep their numbers; every switch builds a fresh gloo group under a new store
   prefix (`<engine prefix>-g<generation>`), so the old and new groups never share keys.
3. The target size is checked first (`capacity`, or the Ray cluster's free resources
   with `dp_backend="ray"`: `DPWiring.starter`): a size that cannot be held is refused
   before anything starts.
4. A failure is rolled back by the machine's `ScaleAborted` script where it can be
   (before the switch, and during a scale up's switch: a rank whose new group does
   not form stays in its old group and says so): new processes stopped and reaped,
   routing restored, the engines resumed; the error (`ScalingFailedError`) names the
   phase and the cause and says the engine still serves at its old size. Where nothing
   can be rolled back the error says so.
5. A lost rank (`on_rank_failure="shrink"`): `shrink` performs the machine's
   `RanksLost` script. `DropRanks` kills and reaps the lost processes (a headless one,
   elsewhere, is only cut off: its input closes, in the background, and it leaves),
   renumbers the survivors in the wiring (inputs, members, process names, the watcher)
   and in the front end's tables (`ScaleHost.lose_ranks`) at once, before anything can
   be sent on; then `LeaveGroup` (one call per survivor, each with its new number) and
   the switch of a scale down. Nothing can be rolled back: a shrink that fails is the
   engine's death.
6. New ranks are watched by the scale while it runs (`_watch_new_ranks`): a death ends
   it at once, named. Once a scale up's switch succeeded they are members of the
   group and the engine's watcher takes them over (`_adopt_new_ranks`).
7. Every call to ranks is bounded (`scale_calls`: `2 * collective_timeout`, which
   says why) and names the ranks that did not answer. With `on_rank_failure="shrink"`
   a member that dies, is named stuck by a peer, or does not answer is lost whatever
   the phase, a shrink's included (`take_loss`, `scale_losses`): it cuts into the
   actions in flight and the machine's rule 10 drops it, undoing what the
   reconfiguration changed, so the engine goes on with every healthy member; a scale
   so cut fails, naming the phase, the rank and the cause. With "fail" a rank that
   does not answer ends the engine (`engine_lost`), as its death would.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from wavecore.channels import MessageSender
from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.dp.exit_status import describe_end, wait_for_exits
from wavecore.engine.dp.launcher import (
    SHUTDOWN_GRACE_S,
    DPStartupError,
    DPWiring,
    answer_rank,
    open_rank_input,
    process_name,
    rank_assignment,
    reap,
)
from wavecore.engine.dp.process_state import process_is_stopped
from wavecore.engine.dp.rank_process import describe_config
from wavecore.engine.dp.scale_calls import RanksUnanswered, call_each
from wavecore.engine.dp.scale_losses import Loss, LossInbox
from wavecore.engine.errors import (
    EngineDeadError,
    EngineError,
    ScalingFailedError,
    ScalingInProgressError,
    ScalingRefusedError,
)
from wavecore.engine.frontend.core_client import ScaleHost
from wavecore.statemachines import (
    CoordinatorResized,
    Drained,
    DrainRanks,
    DropRanks,
    GroupLeft,
    LeaveGroup,
    PauseMode,
    PauseRanks,
    RanksLost,
    RanksPaused,
    RanksReady,
    ReconfigurationActiveError,
    ReconfigureFinished,
    ResizeCoordinator,
    ResizeTables,
    Resumed,
    ResumeRanks,
    RouteTo,
    ScaleAbandoned,
    ScaleAborted,
    ScalePhase,
    ScaleRequested,
    ScaleRolledBack,
    ScalingMachine,
    StartRanks,
    StopRanks,
    SwitchDone,
    SwitchGroup,
)

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

# How long the scaler waits for the coordinator's count of new senders before it asks
# again (the answer may be dropped; a count takes milliseconds).
_ENDS_EXPECTED_RETRY_S = 1.0


class Scaler:
    """The engine's side of elastic scaling; see the module docstring."""

    def __init__(self, config: EngineConfig, wiring: DPWiring) -> None:
        self._config = config
        self._wiring = wiring
        self._machine = ScalingMachine()
        self._generation = 0
        self._hosts: anyio.abc.TaskGroup | None = None
        self._sender_closed: dict[int, anyio.Event] = {}
        # Inputs of ranks still starting: a rollback closes them too.
        self._starting: list[MessageSender] = []
        self._ends_token = 0
        self._ends_expected = anyio.Event()
        # Lives as long as one scale: watches the ranks it starts (`_watch_new_ranks`).
        self._watches: anyio.abc.TaskGroup | None = None
        self._watch_scope: anyio.CancelScope | None = None
        self._new_ranks: tuple[int, ...] = ()
        self._losses = LossInbox(wiring)
        # The losses this reconfiguration took, each named with its cause ("rank 1 lost
        # (...)"), the phase the first cut into, and the current ones' causes by rank
        # (for their requests' errors) and whether their requests without output go to
        # a survivor.
        self._lost: list[str] = []
        self._lost_phase: ScalePhase | None = None
        self._causes: dict[int, str] = {}
        self._resend = True
        # Set when a failure left nothing that can serve: the engine ends.
        self.engine_lost = False

    @property
    def active(self) -> bool:
        return self._machine.active

    @property
    def shrinking(self) -> bool:
        return self._machine.active and bool(self._lost)

    @property
    def losing_ranks(self) -> bool:
        """A loss cuts into the active reconfiguration: taken by its machine
        (`shrinking`), or handed over (`take_loss`) and not consumed yet."""
        return self._machine.active and (bool(self._lost) or self._losses.pending)

    def take_loss(self, member: int, cause: str, *, resend: bool) -> None:
        """Rule 7: a rank lost while a reconfiguration runs (`active`) cuts into it."""
        self._losses.take(Loss(member=member, cause=cause, resend=resend))

    async def shrink(
        self,
        host: ScaleHost,
        member: int,
        cause: str,
        *,
        resend: bool,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Rule 5: go on without the rank `member` (`cause` says why it is gone; with
        `resend` its requests without output go to a survivor); `task_status` is told
        once the machine took the loss (later losses cut into this shrink, rule 7).
        Raises `ScalingFailedError` where the engine cannot go on."""
        old = host.dp_size
        host.reconfiguring(True)
        try:
            try:
                self._losses.take(Loss(member=member, cause=cause, resend=resend))
                actions = self._take_losses(host)
            finally:
                task_status.started()
            await self._run(host, actions, None)
        except Exception as error:
            where = _PHASES[self._machine.phase]
            if self._machine.active:
                self._machine.handle(ScaleAborted(reason=str(error)))
            self.engine_lost = True
            raise ScalingFailedError(
                f"shrinking from {old} ranks around the lost ranks failed {where} "
                f"({'; '.join(self._lost) or cause}): {type(error).__name__}: {error}"
            ) from error
        finally:
            self._end_losses()
            host.reconfiguring(False)

    def _take_losses(self, host: ScaleHost) -> tuple[object, ...]:
        """Rules 9 and 10: the machine drops the members lost meanwhile (nothing when
        none is). Raises `_NothingServes` when every member is gone."""
        members = self._machine.members or host.dp_size
        lost = self._losses.resolve(members)
        if not lost:
            return ()
        named = [f"{process_name(rank)} lost ({lost[rank].cause})" for rank in sorted(lost)]
        if len(lost) == members:
            raise _NothingServes(f"every rank is lost: {'; '.join(named)}")
        if self._lost_phase is None:
            self._lost_phase = self._machine.phase
        self._lost.extend(named)
        self._causes = {rank: loss.cause for rank, loss in lost.items()}
        self._resend = all(loss.resend for loss in lost.values())
        return self._machine.handle(RanksLost(old_dp_size=members, lost=tuple(sorted(lost))))

    def _take_silent(self, silent: RanksUnanswered) -> None:
        """Rule 7: members that did not answer a call are lost (stopped ones say so)."""
        wiring = self._wiring
        for rank in silent.ranks:
            if rank >= len(wiring.members):
                continue  # a new rank not ready yet: the scale's own failure
            process = wiring.processes.get(process_name(rank))
            stopped = process is not None and process_is_stopped(process)
            cause = silent.cause(rank) + (
                " (it is stopped: SIGSTOP or a debugger)" if stopped else ""
            )
            self._losses.take(Loss(member=wiring.members[rank], cause=cause, resend=True))

    def _silent_member(self, silent: RanksUnanswered) -> bool:
        """Whether a member is silent (a new rank's silence is the scale's failure)."""
        members = self._machine.members or 0
        return any(rank < members for rank in silent.ranks)

    def _end_losses(self) -> str | None:
        """What the reconfiguration lost, if anything, named with the phase it cut into."""
        where = _PHASES[self._lost_phase] if self._lost_phase is not None else ""
        report = f"{where}: {'; '.join(self._lost)}" if self._lost else None
        self._lost, self._lost_phase, self._causes = [], None, {}
        self._losses.forget_pending()
        return report

    async def scale(self, host: ScaleHost, new_dp_size: int, drain_timeout: float | None) -> None:
        old = host.dp_size
        if new_dp_size > old:
            await self._check_capacity(old, new_dp_size)
        try:
            actions = self._machine.handle(ScaleRequested(old_dp_size=old, dp_size=new_dp_size))
        except ReconfigurationActiveError as error:
            raise ScalingInProgressError(str(error)) from None
        scale = f"scaling from {old} to {new_dp_size} ranks"
        try:
            async with anyio.create_task_group() as watches:
                self._watches = watches
                await self._run(host, actions, drain_timeout)
                watches.cancel_scope.cancel()
        except BaseException as raised:
            error = _sole(raised)
            where = _PHASES[self._machine.phase]
            reason = f"{type(error).__name__}: {error}"
            dead_end = (
                isinstance(error, _NothingServes)
                or self.shrinking
                or (isinstance(error, RanksUnanswered) and self._silent_member(error))
            )
            if dead_end and isinstance(error, Exception):
                # Nothing to roll back to: a member is gone and the engine could not go
                # on without it (or must not: on_rank_failure="fail").
                if self._machine.active:
                    self._machine.handle(ScaleAborted(reason=reason))
                self.engine_lost = True
                raise ScalingFailedError(
                    f"{scale} failed {where}; the engine cannot go on: {reason}"
                    + (f" (after {'; '.join(self._lost)})" if self._lost else "")
                ) from error
            if not self._machine.active:
                raise
            if isinstance(error, EngineDeadError):
                # The engine ended meanwhile (with on_rank_failure="fail", a rank's
                # death or a collective that names a stopped one): nothing to roll back.
                self._machine.handle(ScaleAborted(reason=reason))
                raise ScalingFailedError(
                    f"{scale} failed {where}: the engine ended: {reason}"
                ) from error
            rollback = self._machine.handle(ScaleAborted(reason=reason))
            with anyio.CancelScope(shield=True):
                await self._roll_back(host, rollback)
            if not isinstance(error, Exception):
                raise
            if any(isinstance(action, ScaleRolledBack) for action in rollback):
                raise ScalingFailedError(
                    f"scaling from {old} to {new_dp_size} ranks failed {where} and was rolled "
                    f"back (still {old} ranks): {reason}"
                ) from error
            # The new ranks stay in the group: from now on their death is the engine's
            # (one that already died is reported at once, naming it).
            self._adopt_new_ranks()
            raise ScalingFailedError(
                f"scaling from {old} to {new_dp_size} ranks failed {where}, after the switch "
                f"started (not rolled back; the engine may be unusable): {reason}"
            ) from error
        finally:
            self._watches = None
            self._new_ranks = ()
            lost = self._end_losses()  # read below only when the scale itself succeeded
        if lost is not None:
            raise ScalingFailedError(
                f"{scale} failed {lost}; the engine goes on with {host.dp_size} ranks"
            )

    async def _check_capacity(self, old: int, new_dp_size: int) -> None:
        """Refuse a size the machine cannot hold before anything starts (`capacity`)."""
        capacity = await anyio.to_thread.run_sync(self._wiring.starter.capacity, self._config)
        if new_dp_size > capacity.max_dp_size:
            raise ScalingRefusedError(
                f"scaling from {old} to {new_dp_size} ranks refused: at most "
                f"{capacity.max_dp_size} ranks ({capacity.reason}); nothing changed, the "
                f"engine still serves at {old} ranks (EngineConfig.max_dp_size sets the limit)"
            )

    async def _run(
        self, host: ScaleHost, actions: tuple[object, ...], drain_timeout: float | None
    ) -> None:
        """Perform the actions; the one that waits for something yields the machine's
        next event. A member lost meanwhile cuts in (rule 7): the machine takes the
        loss instead, in the phase the batch was performed for."""
        while True:
            event, cut = None, False
            if actions:
                with self._losses.cut_in() as batch:
                    try:
                        for action in actions:
                            event = await self._perform(host, action, drain_timeout) or event
                    except RanksUnanswered as silent:
                        if self._config.on_rank_failure != "shrink":
                            raise
                        self._take_silent(silent)
                        if not self._losses.pending:
                            raise  # no member is silent: a new rank, the scale's failure
                        event = None
                cut = batch.cancel_called
            lost = self._take_losses(host) if self._losses.pending else ()
            if lost:
                actions = lost
            elif cut:
                raise RuntimeError("a loss cut into a reconfiguration but names no member")
            elif event is not None:
                actions = self._machine.handle(event)
            else:
                return

    async def _perform(
        self, host: ScaleHost, action: object, drain_timeout: float | None
    ) -> object | None:
        wiring = self._wiring
        timeout = self._config.startup_timeout
        bound = 2 * self._config.collective_timeout  # `scale_calls` says why
        if isinstance(action, StartRanks):
            await self._start_ranks(action.ranks, action.dp_size)
            await host.prepare_ranks(action.ranks)
            return RanksReady()
        if isinstance(action, DrainRanks):
            await self._drain(host, action.ranks, drain_timeout)
            return Drained()
        if isinstance(action, PauseRanks):
            keep = PauseMode.KEEP.value
            await call_each(
                host,
                action.ranks,
                lambda rank, cid: m.UtilityCall(call_id=cid, method="pause", pause_mode=keep),
                what="the pause",
                seconds=bound,
            )
            return RanksPaused()
        if isinstance(action, DropRanks):
            # Whole, even when a loss cuts in: the wiring and the front end's tables
            # must be renumbered together.
            with anyio.CancelScope(shield=True):
                await self._drop_ranks(host, action)
            return None
        if isinstance(action, LeaveGroup):
            # A survivor blocked in a collective answers once that collective fails.
            await call_each(
                host,
                action.ranks,
                lambda rank, cid: m.LeaveGroup(call_id=cid, rank=rank),
                what="leaving the broken group",
                seconds=bound,
            )
            return GroupLeft()
        if isinstance(action, SwitchGroup):
            self._generation += 1
            prefix = self._prefix()
            size = action.dp_size
            # A rank gives up on a group that does not form after the collective
            # timeout and says why in its answer.
            await call_each(
                host,
                range(size),
                lambda rank, cid: m.SwitchGroup(call_id=cid, dp_size=size, group_prefix=prefix),
                what=f"the switch to the group of {size} ranks",
                seconds=bound,
            )
            self._adopt_new_ranks()  # rule 6: members of the group from now on
            return SwitchDone()
        if isinstance(action, ResizeCoordinator):
            await wiring.to_coordinator.send(m.CoordinatorResize(dp_size=action.dp_size))
            with _within(timeout, f"the coordinator's resize to {action.dp_size} ranks"):
                await host.coordinator_size(action.dp_size)
            return CoordinatorResized()
        if isinstance(action, ResumeRanks):
            await call_each(
                host,
                action.ranks,
                lambda rank, cid: m.UtilityCall(call_id=cid, method="resume"),
                what="the resume",
                seconds=bound,
            )
            return Resumed()
        if isinstance(action, RouteTo):
            host.route_to(action.dp_size)
        elif isinstance(action, StopRanks):
            await self._stop_ranks(action.ranks)
        elif isinstance(action, ResizeTables):
            host.resize_tables(action.dp_size)
            wiring.dp_size = action.dp_size
        elif isinstance(action, ReconfigureFinished):
            self._adopt_new_ranks()
        else:
            raise RuntimeError(f"the scaler cannot perform {action}")
        return None

    def _adopt_new_ranks(self) -> None:
        """From here on a new rank's death is the engine's, as for the first ranks (a
        loss, with `on_rank_failure="shrink"`)."""
        self._stop_watching_new_ranks()
        watcher = self._wiring.watcher
        if watcher is not None:
            for rank in self._new_ranks:
                name = process_name(rank)
                watcher.watch(name, self._wiring.processes[name])
        self._new_ranks = ()

    def _stop_watching_new_ranks(self) -> None:
        if self._watch_scope is not None:
            self._watch_scope.cancel()
            self._watch_scope = None
        self._losses.joining.clear()

    async def _roll_back(self, host: ScaleHost, actions: tuple[object, ...]) -> None:
        """Perform an aborted scale's rollback. An engine that died meanwhile has nothing
        left to roll back, and the original error says why; a rank that does not answer
        its resume stays paused, and its peers' collectives name it."""
        for action in actions:
            if isinstance(action, ScaleRolledBack | ScaleAbandoned):
                continue
            with contextlib.suppress(EngineError, RanksUnanswered):
                await self._perform(host, action, None)

    # -- the actions that need processes and channels ------------------------------------

    async def _start_ranks(self, ranks: tuple[int, ...], dp_size: int) -> None:
        """Start these ranks (`DPWiring.starter`: spawned here, or Ray actors) and take their startup handshake (joining); once all are
        ready their inputs join the wiring."""
        wiring = self._wiring
        config = self._config
        handshake = wiring.rank_handshake
        if handshake is None:
            raise ScalingRefusedError("this engine's ranks were not started here; cannot scale")
        if self._hosts is None:
            raise ScalingRefusedError("the engine's scaling service is not running")
        first = ranks[0]
        self._generation += 1
        await self._expect_ends(len(ranks))
        members = wiring.new_members(len(ranks))
        configs = {rank: wiring.rank_configs.get(rank, config) for rank in ranks}
        started = await wiring.starter.start(
            handshake.address, configs, wiring.build_core, wiring.channel_key
        )
        for rank, process in started.items():
            wiring.processes[process_name(rank)] = process
        self._new_ranks = ranks
        if self._watches is not None:
            self._watch_scope = anyio.CancelScope()
            self._watches.start_soon(self._watch_new_ranks, ranks, self._watch_scope)
        self._losses.joining.update(members)
        expected = describe_config(config)
        ready: set[int] = set()
        hellos: dict[int, m.RankHello] = {}
        with _within(config.startup_timeout, f"the startup of new ranks {list(ranks)}"):
            while len(ready) < len(ranks):
                message = await handshake.receive()
                answered = await answer_rank(
                    handshake,
                    message,
                    expected,
                    ranks,
                    wiring.invalid_frames[2],
                    hellos,
                    lambda rank: rank_assignment(
                        config,
                        wiring,
                        rank=rank,
                        dp_size=dp_size,
                        group_prefix=self._prefix(),
                        member=members[rank - first],
                        joining=True,
                    ),
                )
                if answered is not None:
                    ready.add(answered.rank)
        for rank in ranks:
            self._starting.append(await self._open_sender(hellos[rank]))
        wiring.to_ranks.extend(self._starting)
        wiring.members.extend(members)
        self._starting = []

    async def _drain(
        self, host: ScaleHost, leaving: tuple[int, ...], drain_timeout: float | None
    ) -> None:
        """Let the leaving ranks finish their requests; abort what is left at the bound
        (its callers see finish reason "abort": never a silent loss)."""
        with anyio.move_on_after(drain_timeout if drain_timeout is not None else math.inf):
            while host.unfinished_on(leaving):
                await host.request_finished()
        await host.abort_on(host.unfinished_on(leaving))
        bound = self._config.startup_timeout
        with _within(bound, f"the abort of the requests left on ranks {list(leaving)}"):
            while host.unfinished_on(leaving):
                await host.request_finished()

    async def _drop_ranks(self, host: ScaleHost, action: DropRanks) -> None:
        """Kill the lost ranks' processes and renumber the survivors everywhere, the
        wiring first: nothing awaits between the two, so every message sent after this
        reaches the rank its number now names."""
        wiring = self._wiring
        processes: dict[str, BaseProcess] = wiring.processes
        lost_senders = [wiring.to_ranks[rank] for rank in action.ranks]
        wiring.to_ranks[:] = [wiring.to_ranks[rank] for rank in action.survivors]
        wiring.dropped.update(wiring.members[rank] for rank in action.ranks)
        wiring.members[:] = [wiring.members[rank] for rank in action.survivors]
        wiring.dp_size = len(action.survivors)
        lost = {name: processes.pop(name, None) for name in map(process_name, action.ranks)}
        kept = [processes.pop(process_name(rank), None) for rank in action.survivors]
        for rank, process in enumerate(kept):
            if process is not None:
                processes[process_name(rank)] = process
                if wiring.watcher is not None:
                    wiring.watcher.watch(process_name(rank), process)
        dead = {}
        for name, process in lost.items():
            if process is None:
                continue  # a headless rank elsewhere: its own host reaps it
            if wiring.watcher is not None:
                wiring.watcher.forget(process)
            if process.is_alive():
                process.kill()  # a stuck rank (SIGKILL ends a stopped one too)
            dead[f"{name} (retired, pid {process.pid})"] = process
        processes.update(dead)
        causes = "; ".join(
            f"{process_name(rank)} lost ({self._causes.get(rank, 'gone')})" for rank in action.ranks
        )
        error = f"{causes}; the engine goes on with {len(kept)} ranks"
        await host.lose_ranks(action.ranks, action.survivors, error, resend=self._resend)
        if self._hosts is not None:
            # In the background: closing waits out the input's linger (0.5 s) to hand
            # the lost rank an end marker (a stopped one reads it when continued, and
            # leaves), which would delay serving by as much.
            self._hosts.start_soon(self._close_inputs, lost_senders)
        else:
            await self._close_inputs(lost_senders)
        with anyio.CancelScope(shield=True):
            await reap(dead, grace=0.0)

    async def _close_inputs(self, senders: list[MessageSender]) -> None:
        with anyio.CancelScope(shield=True):
            for sender in senders:
                await sender.aclose()
                closed = self._sender_closed.pop(id(sender), None)
                if closed is not None:
                    closed.set()

    async def _watch_new_ranks(self, ranks: tuple[int, ...], scope: anyio.CancelScope) -> None:
        with scope:
            await self._wait_for_new_ranks(ranks)

    async def _wait_for_new_ranks(self, ranks: tuple[int, ...]) -> None:
        """A new rank that dies while the scale runs ends it at once (and the scale is
        rolled back), naming the rank, the phase and how it ended ("new rank 2 exited
        during startup: killed by SIGKILL"). The engine's watcher takes the new ranks
        over only once the scale finished: until then their death is the scale's
        failure, not the engine's."""

        processes = {
            process_name(rank): self._wiring.processes[process_name(rank)] for rank in ranks
        }
        # Joined before they are named: a sentinel is ready a moment before its status is.
        ended = await anyio.to_thread.run_sync(
            wait_for_exits, processes.values(), abandon_on_cancel=True
        )
        where = _PHASES[self._machine.phase]
        deaths = "; ".join(
            f"new {name} exited {where}: {describe_end(process)}"
            for name, process in processes.items()
            if process in ended
        )
        raise DPStartupError(deaths)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Hosts the new ranks' input senders for the engine's lifetime (a channel's
        context must be left by the task that entered it)."""
        self._wiring.coordinator_state.subscribe(m.SCALE_TOPIC)
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
        wiring = self._wiring
        wiring.outputs.expect_more_end_of_streams(ranks)
        self._ends_token += 1
        self._ends_expected = anyio.Event()
        expect = m.ExpectEnds(markers=ranks, token=self._ends_token)
        with _within(self._config.startup_timeout, "the coordinator's count of new senders"):
            # The answer comes over PUB, which drops frames for a slow subscriber: ask
            # again until it arrives (the coordinator counts each token once).
            while not self._ends_expected.is_set():
                await wiring.to_coordinator.send(expect)
                with anyio.move_on_after(_ENDS_EXPECTED_RETRY_S):
                    await self._ends_expected.wait()

    def on_ends_expected(self, token: int) -> None:
        if token == self._ends_token:
            self._ends_expected.set()

    async def _open_sender(self, hello: m.RankHello) -> MessageSender:
        if self._hosts is None:
            raise ScalingRefusedError("the engine's scaling service is not running")
        closed = anyio.Event()
        opened = open_rank_input(self._wiring.channel_key, hello)
        sender: MessageSender = await self._hosts.start(_host_sender, opened, closed)
        self._sender_closed[id(sender)] = closed
        return sender

    def _prefix(self) -> str:
        return f"{self._wiring.group_prefix}-g{self._generation}"

    async def _stop_ranks(self, ranks: tuple[int, ...]) -> None:
        """Close these ranks' inputs (they leave their loops and exit); reap them. They
        are the highest ranks: a scale down removes from the top, a scale up adds there."""
        wiring = self._wiring
        # A scale down has no new ranks; a scale up's stop them on purpose.
        self._stop_watching_new_ranks()
        self._new_ranks = ()
        senders = [*wiring.to_ranks[min(ranks) :], *self._starting]
        del wiring.to_ranks[min(ranks) :]
        del wiring.members[min(ranks) :]
        self._starting = []
        names = [process_name(rank) for rank in ranks]
        processes: dict[str, BaseProcess] = wiring.processes
        if wiring.watcher is not None:
            # They exit on purpose (removed, or rolled back): not a death.
            for name in names:
                if name in processes:
                    wiring.watcher.forget(processes[name])
        with anyio.CancelScope(shield=True):
            await self._close_inputs(senders)
            stopping = {name: processes[name] for name in names if name in processes}
            await reap(stopping, grace=SHUTDOWN_GRACE_S)
            # Rank numbers are reused by a later scale up; keep each for the final reap.
            for name, process in stopping.items():
                processes[f"{name} (retired, pid {process.pid})"] = processes.pop(name)


# Where a scale failed, by the phase its machine was in, for its error message.
_PHASES = {
    ScalePhase.IDLE: "before it started",
    ScalePhase.STARTING: "during startup",
    ScalePhase.DRAINING: "while the leaving ranks drained",
    ScalePhase.PAUSING: "while pausing the ranks",
    ScalePhase.LEAVING: "while leaving the broken group",
    ScalePhase.SWITCHING: "while switching to the new group",
    ScalePhase.RESIZING: "while resizing the coordinator",
    ScalePhase.RESUMING: "while resuming the ranks",
}


@contextlib.contextmanager
def _within(seconds: float, what: str) -> Iterator[None]:
    """`anyio.fail_after`, whose TimeoutError says what took too long (a bare one reads
    as an empty cause)."""
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError:
        raise TimeoutError(f"{what} did not complete within {seconds} s") from None


class _NothingServes(Exception):
    """Every member of the group is lost: nothing is left to serve."""


def _sole(error: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, else the group itself."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


async def _host_sender(
    opened: AbstractAsyncContextManager[MessageSender],
    closed: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[MessageSender],
) -> None:
    """One new rank's input (`open_rank_input`), open until its rank leaves (`closed`)
    or the engine ends."""
    async with opened as sender:
        task_status.started(sender)
        await closed.wait()
