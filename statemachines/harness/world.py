"""A whole DP deployment in miniature: the shared core of the simulation and the explorer.

Theory of operation:

1. Parties: one client (with the ``ScalingMachine`` that scripts its scales), one
   coordinator, N ranks, and a duplicating network that may hand the coordinator a
   second copy of any ``wave_complete`` at any later time (the only message the
   protocol allows twice). Each rank is the very ``RankLoop`` the engine runs, over
   modelled effects (``toy``): a toy scheduler, FIFO channels, instant replies.
2. A *move* is one of: deliver the head of a channel, let a rank run its pending step,
   or let the client act (submit, a call, the next part of a scale). Any enabled move
   may come next, so messages from different senders interleave arbitrarily and may
   stay in flight across pauses, barriers and group switches.
3. A rank takes messages only at the top of an iteration (its loop waits for input or
   for its next step). Dummy forwards and sleeps complete at once; a blocking
   collective completes the moment the last of its members enters it (the new group's
   members for a group join, the current group's otherwise). A vote is the
   non-blocking all-reduce: each rank starts it without waiting, and its result is
   there for every member as soon as the last member started it, however many moves
   later a rank reads it; every member reads the same result for the same vote.
4. A scale is the ``ScalingMachine``'s script: the world performs its actions and
   feeds the machine when each part is done (new ranks ready at once; the drain done
   when no request of a leaving rank is left, or aborted by a drain timeout the
   client may fire at any moment, once a drain as the engine's timer does; the pause
   and the switch answered by every rank;
   the coordinator's publication of the new size). When it finishes, each party must
   have done its own part: the leaving ranks shut down, every other rank in the new
   group (``scale_roles``).
5. A rank may die (``WorldConfig.deaths``: how many may, none unless a scenario asks)
   where the engine would shrink around it: while a reconfiguration runs (a member:
   scaling rule 10), or while the engines serve, neither paused nor asleep nor in a
   call (rule 9; elsewhere the engine itself ends). The death is taken as the engine
   takes a process exit: its messages in flight are lost, the DP group is broken
   (``broken_calls``), and the client feeds ``RanksLost`` to its ``ScalingMachine`` at
   once, abandoning the call the loss cut into, and performs the script like a
   scale's. A survivor's collective of the broken group fails (``RankLoop.group_lost``,
   rank rule 13) when it waits in it; a join a switch of the broken group asked for
   fails and keeps the rank where it was. ``DropRanks`` ends the lost ranks' requests
   with an error (``ClientState.failed``) and renumbers the survivors everywhere.
   The scale's batch of actions is performed whole before a death can cut in (the
   engine may be cut mid-batch; rule 10 says its undo holds either way), and a lost
   rank's requests are not resent to a survivor (the engine's ``resend``).
6. The world is a value: ``clone()`` is cheap (machines and loops keep their state in
   frozen snapshots) and ``key()`` (``reduction``) hashes everything that decides the
   future. ``invariants`` lists the properties checked.
7. The client may abort a scale (``WorldConfig.abort_scales``) where its machine rolls
   it back (scaling rule 8): while a scale down drains or pauses, while a scale up
   pauses or switches before its new group formed. The call the scale waited for is
   abandoned (its answers come in unawaited) and the rollback is performed: new ranks
   stopped (a join they were to complete fails, and its rank stays in its old group),
   routing restored, the old ranks resumed. A second scale is tried at every part of
   a scale, and must be refused and change nothing.
8. One rank may drift out of lockstep once (``WorldConfig.drift``): at the top of an
   iteration of a running wave it runs one forward more than its peers and counts it.
   A vote that meets the drift must end with ``LockstepDriftError`` (rank rule 12),
   which ends the engine: the run stops there. A drift only a drained vote met ends
   with its wave, unseen and harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..coordinator import (
    BroadcastStartWave,
    CoordinatorMachine,
    FirstRequest,
    PublishState,
    RankStartedWave,
    Resize,
    WaveCompleted,
)
from ..errors import LockstepDriftError, ProtocolError, ReconfigurationActiveError
from ..rank import RankMachine
from ..rank_events import (
    AwaitVote,
    DrainVote,
    GroupLost,
    NotifyStartWave,
    NotifyWaveComplete,
    PauseMode,
    PauseRequested,
    PauseState,
    ResumeRequested,
    SleepRequested,
    StartVote,
    StartWave,
    StepDone,
    WakeUpRequested,
)
from ..rank_loop import (
    AbortRequests,
    Call,
    Collective,
    NewRequest,
    RankLoop,
    RunDummy,
    RunStep,
    Sleep,
    WaitForInput,
    Wake,
)
from ..scaling import (
    ScaleRequested,
    ScalingMachine,
)
from .client import ClientRefused, ClientState, RequestSpec, refusal
from .invariants import (
    Violation,
    check_after_move,
    check_answer,
    check_quiescent,
    collective_members,
)
from .network import CLIENT, COORDINATOR, DUPLICATOR, Message, Move, Network, Party
from .reduction import world_key
from .toy import ToyRank, ToyRequest, preempted, toy_step
from .world_collectives import CollectiveMoves
from .world_scaling import ScalingMoves

__all__ = [
    "CLIENT",
    "COORDINATOR",
    "ClientRefused",
    "RequestSpec",
    "Violation",
    "World",
    "WorldConfig",
    "coordinator_event",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldConfig:
    dp_size: int = 2
    sync_interval: int = 1
    lockstep: bool = True
    duplicate_wave_complete: bool = True
    rank_class: type[RankMachine] = RankMachine
    coordinator_class: type[CoordinatorMachine] = CoordinatorMachine
    scaling_class: type[ScalingMachine] = ScalingMachine
    # How many ranks may die in one run (rule 5); 0 keeps every other scenario as it was.
    deaths: int = 0
    # The client may abort a scale where the machine rolls it back (rule 7).
    abort_scales: bool = False
    # One rank may drift out of lockstep once (rule 8).
    drift: bool = False


@dataclass(slots=True)
class World(CollectiveMoves, ScalingMoves):
    config: WorldConfig
    loops: list[RankLoop]
    toys: list[ToyRank]
    coordinator: CoordinatorMachine
    client: ClientState
    scaler: ScalingMachine
    group_size: int
    network: Network = field(default_factory=Network)
    trace: list[str] | None = None
    views_matter: bool = True
    deaths_left: int = 0
    # Rule 5: the group is broken, and the calls numbered below this one were made to
    # it (a switch among them cannot form its group); None while the group is whole.
    broken_calls: int | None = None
    # The ranks (current numbers) dead and not yet dropped by the scaler.
    dead: frozenset[int] = frozenset()
    # A shrink runs: its survivors paused out of a wave without ending it, so the
    # coordinator may believe it runs until they resume in the new group.
    shrinking: bool = False
    # Rule 7: the switch call of a scale up aborted before its group formed; the joins
    # it asked for fail (its new ranks are gone), keeping each rank in its old group.
    aborted_switch: int | None = None
    # Rule 8: a drift was injected; the error that ended the run (nothing moves after).
    drifted: bool = False
    halted: str | None = None

    @classmethod
    def start(cls, config: WorldConfig) -> World:
        n = config.dp_size
        world = cls(
            config=config,
            loops=[],
            toys=[],
            coordinator=config.coordinator_class(n),
            client=ClientState(group=n, routing=n, published_size=n),
            scaler=config.scaling_class(),
            group_size=n,
            deaths_left=config.deaths,
        )
        for r in range(n):
            world._add_rank(r, n, joining=False)
        return world

    def _add_rank(self, r: int, dp_size: int, *, joining: bool) -> None:
        machine = self.config.rank_class(
            r,
            dp_size,
            sync_interval=self.config.sync_interval,
            lockstep=self.config.lockstep,
            joining=joining,
        )
        self.loops.append(RankLoop(machine))
        self.toys.append(ToyRank())
        self.loops[r].start(self._effects(r))

    def _effects(self, r: int) -> _RankEffects:
        return _RankEffects(self, r)

    # -- value semantics ------------------------------------------------------------------

    def clone(self) -> World:
        return World(
            config=self.config,
            loops=[loop.copy() for loop in self.loops],
            toys=list(self.toys),
            coordinator=self.coordinator.copy(),  # type: ignore[arg-type]
            client=self.client,
            scaler=self.scaler.copy(),  # type: ignore[arg-type]
            group_size=self.group_size,
            network=self.network.copy(),
            views_matter=self.views_matter,
            deaths_left=self.deaths_left,
            broken_calls=self.broken_calls,
            dead=self.dead,
            shrinking=self.shrinking,
            aborted_switch=self.aborted_switch,
            drifted=self.drifted,
            halted=self.halted,
        )

    def key(self) -> tuple[object, ...]:
        return world_key(self)

    def forget_views(self) -> None:
        """The client will submit nothing more: its view of the engines no longer decides
        anything, so it is dropped (fewer distinct states, same futures)."""
        self.views_matter = False
        # A publication of a new group size still matters: it lets a scale go on.
        size = self.client.published_size
        for message in self.network.take(COORDINATOR, CLIENT):
            if message[3] != size:
                self.network.send(COORDINATOR, CLIENT, message)
                size = message[3]  # type: ignore[assignment]
        self.client = replace(self.client, wave=0, running=False)

    @property
    def group(self) -> range:
        """The ranks of the DP group as it is now (it changes at a scale's switch)."""
        return range(self.group_size)

    @property
    def ranks(self) -> list[RankMachine]:
        return [loop.machine for loop in self.loops]

    def _abandon_awaited_call(self, **also: object) -> None:
        """The client stops waiting for the call it awaited (an aborted scale, a loss
        cutting into one); answers still on their way arrive unawaited. `also` sets
        further client fields."""
        self.client = replace(
            self.client,
            awaited_call=None,
            awaited_mode=None,
            awaiting=frozenset(),
            arrivals=frozenset(),
            pause_deadline=None,
            doomed=frozenset(),
            **also,
        )

    def _note(self, text: str | Callable[[], str]) -> None:
        if self.trace is not None:
            self.trace.append(text if isinstance(text, str) else text())

    # -- moves ------------------------------------------------------------------------------

    def network_moves(self) -> list[Move]:
        """Deliveries and rank steps: everything but the client's own initiative."""
        moves: list[Move] = []
        if self.halted is not None:
            return moves  # rule 8: the engine ended with its error
        for sender, receiver in self.network.pairs():
            if isinstance(receiver, int) and not isinstance(
                self.loops[receiver].pending, WaitForInput | RunStep
            ):
                continue
            moves.append(("deliver", sender, receiver))
        for r, loop in enumerate(self.loops):
            if isinstance(loop.pending, RunStep):
                moves.append(("step", r))
        return moves

    def apply(self, move: Move) -> None:
        waves_before = self.coordinator.wave
        rank_waves = [loop.machine.wave for loop in self.loops]
        if move[0] == "deliver":
            self._deliver(move[1], move[2])  # type: ignore[arg-type]
        elif move[0] == "step":
            self._step(move[1])  # type: ignore[arg-type]
        elif move[0] in ("scale_next", "drain_timeout"):
            self._scale_move(move[0])  # type: ignore[arg-type]
        elif move[0] == "scale_abort":
            self._abort_scale()
        elif move[0] == "drift":
            self._drift(move[1])  # type: ignore[arg-type]
        elif move[0] == "die":
            self._die(move[1])  # type: ignore[arg-type]
            rank_waves = []  # the survivors were renumbered: their waves stay as they were
        else:
            raise ValueError(f"unknown move {move!r}")
        self._read_ready_votes()
        check_after_move(self, waves_before, rank_waves)

    def discard(self, sender: Party, receiver: Party, inert: Callable[[Message], bool]) -> None:
        """Take the messages ``inert`` picks out of one channel (``por`` rule 9)."""
        queue = self.network.channels.get((sender, receiver), ())
        kept = tuple(message for message in queue if not inert(message))
        if len(kept) < len(queue):
            self._note(lambda: f"drop inert {sender}->{receiver} {set(queue) - set(kept)}")
            self.network.keep(sender, receiver, kept)

    def quiescent(self) -> bool:
        return not self.network_moves()

    def check_quiescent(self) -> None:
        check_quiescent(self)

    def _handle(self, machine: object, event: object, who: str) -> tuple[object, ...]:
        try:
            actions = machine.handle(event)  # type: ignore[attr-defined]
        except ProtocolError as error:
            raise Violation("protocol_error", f"{who}: {error}") from error
        self._note(lambda: f"    {who} <- {event} -> {actions}")
        return actions

    def _deliver(self, sender: Party, receiver: Party) -> None:
        message = self.network.pop(sender, receiver)
        self._note(f"deliver {sender}->{receiver} {message}")
        if receiver == COORDINATOR:
            self._coordinator_receives(message)
        elif receiver == CLIENT:
            self._client_receives(message)
        else:
            self._rank_receives(receiver, message)  # type: ignore[arg-type]

    def _client_receives(self, message: Message) -> None:
        _, wave, running, dp_size = message
        client = replace(self.client, published_size=dp_size)  # type: ignore[arg-type]
        if self.views_matter:
            client = replace(client, wave=wave, running=running)  # type: ignore[arg-type]
        self.client = client

    # -- coordinator ----------------------------------------------------------------------

    def _coordinator_receives(self, message: Message) -> None:
        wave = self.coordinator.wave
        actions = self._handle(self.coordinator, coordinator_event(message), "coordinator")
        # A local half of the coordinator-wave property (``por`` rule 7b): a new wave
        # must come from the message.
        if self.coordinator.wave > max(wave, _carried_wave(message)):
            raise Violation(
                "coordinator_wave",
                f"the coordinator took {message} from wave {wave} to {self.coordinator.wave}",
            )
        for action in actions:
            if isinstance(action, BroadcastStartWave):
                # To the ranks the coordinator knows that still exist: between a scale
                # down's stop and the coordinator's resize the two differ.
                for r in range(min(self.coordinator.dp_size, len(self.loops))):
                    message = ("start_dp_wave", action.wave, action.exclude_rank)
                    self.network.send(COORDINATOR, r, message)
            elif isinstance(action, PublishState) and action.wave > self.coordinator.wave:
                raise Violation("coordinator_wave", f"the coordinator published {action}")
            elif isinstance(action, PublishState) and (
                self.views_matter
                or len(action.loads) != self.client.published_size
                or len(action.loads) != self._size_seen()
            ):
                publication = ("publish", action.wave, action.engines_running, len(action.loads))
                self.network.send(COORDINATOR, CLIENT, publication)

    def _size_seen(self) -> int:
        """The group size the client holds once what is in flight to it arrived: a
        publication of another size must reach it too (after a shrink cut into a
        scale's resize, the client awaits its old size again)."""
        in_flight = self.network.channels.get((COORDINATOR, CLIENT), ())
        return in_flight[-1][3] if in_flight else self.client.published_size  # type: ignore[return-value]

    # -- ranks ----------------------------------------------------------------------------

    def _rank_receives(self, r: int, message: Message) -> None:
        loop = self.loops[r]
        machine = loop.machine
        held_before = machine.pause_state is not PauseState.UNPAUSED or bool(machine.asleep)
        kind = message[0]
        if kind == "add":
            _, request_id, wave, steps, stalls = message
            item: object = NewRequest(
                request_id=str(request_id), wave=wave, payload=(steps, stalls)
            )  # type: ignore[arg-type]
        elif kind == "abort":
            item = AbortRequests(request_ids=tuple(str(i) for i in message[1]))  # type: ignore[union-attr]
        elif kind == "start_dp_wave":
            item = StartWave(wave=message[1], exclude_rank=message[2])  # type: ignore[arg-type]
        else:
            item = Call(call_id=message[1], request=message[2])  # type: ignore[arg-type]
            if message[1] == self.client.awaited_call and not loop.snapshot()[1].deferred:
                self._arrived(r)
        self._note(lambda: f"    rank {r} <- {item}")
        self.loops[r].deliver(item, self._effects(r))
        if isinstance(item, Call) and isinstance(item.request, GroupLost):
            self._forget_votes(r)  # rank rule 13: its open votes went with the group
        deferred = item in self.loops[r].snapshot()[1].deferred  # rank_loop rule 7
        if kind == "add" and held_before and not deferred and message[1] not in self.client.held:
            raise Violation(
                "silent_wait", f"request {message[1]} reached paused/sleeping rank {r} unannounced"
            )
        self._settle(r)

    def _step(self, r: int) -> None:
        toy = self.toys[r]
        executed, requests, finished = toy_step(toy.requests, toy.scheduler_pause)
        self._note(f"step rank {r}: executed={executed} unfinished={len(requests)}")
        if executed:
            self._forward(r)
        self.toys[r] = replace(self.toys[r], requests=requests)
        self.end_requests(finished)
        admitted = any(q.admitted for q in requests)
        done = StepDone(executed=executed, has_unfinished=bool(requests), has_admitted=admitted)
        self._complete(r, done)

    def _complete(self, r: int, result: object) -> None:
        self._note(
            lambda: f"    rank {r} completes {type(self.loops[r].pending).__name__}: {result}"
        )
        deferred = self.loops[r].snapshot()[1].deferred
        try:
            self.loops[r].complete(result, self._effects(r))
        except LockstepDriftError as error:
            if not self.drifted:
                raise Violation("protocol_error", f"rank {r}: {error}") from error
            self._note(f"    rank {r} ends the engine: {error}")
            self.halted = type(error).__name__  # rule 8
            return
        except ProtocolError as error:
            raise Violation("protocol_error", f"rank {r}: {error}") from error
        if deferred:
            self._released(r, deferred)
        self._settle(r)

    def _released(self, r: int, deferred: tuple[object, ...]) -> None:
        """The awaited call reached rank ``r`` only now if it waited behind a resume
        (``rank_loop`` rule 7); the rank took it from its backlog."""
        call = self.client.awaited_call
        still = self.loops[r].snapshot()[1].deferred
        if any(isinstance(item, Call) and item.call_id == call for item in deferred) and not any(
            isinstance(item, Call) and item.call_id == call for item in still
        ):
            self._arrived(r)

    def _settle(self, r: int) -> None:
        """Complete what the rank waits for that completes at once (rule 3)."""
        pending = self.loops[r].pending
        if isinstance(pending, RunDummy):
            self._forward(r)
            self._complete(r, None)
        elif isinstance(pending, Sleep):
            if "kv_cache" in pending.tags:
                self.toys[r] = replace(self.toys[r], requests=preempted(self.toys[r].requests))
            self._complete(r, None)
        elif isinstance(pending, Wake):
            self._complete(r, None)
        elif isinstance(pending, Collective) and self._broken(r, pending):
            self._fail_collective(r, pending)
        elif isinstance(pending, Collective):
            if isinstance(pending.action, AwaitVote | DrainVote):
                self._read_vote(r)
            else:
                self._complete_collective(collective_members(self, pending.action))

    def _forward(self, r: int) -> None:
        machine = self.loops[r].machine
        if machine.pause_state is PauseState.PAUSED:
            raise Violation("forward_after_pause", f"rank {r} ran a forward after pause consensus")
        if self.client.paused:
            raise Violation(
                "forward_after_pause_reply",
                f"rank {r} ran a forward after the client saw the pause done",
            )
        toy = self.toys[r]
        wave = machine.wave
        forwards = toy.forwards + 1 if toy.forwards_wave == wave else 1
        deadline = self.client.pause_deadline
        if deadline is not None and r in self.client.awaiting and (wave, forwards) > deadline:
            raise Violation(
                "slow_pause",
                f"rank {r} runs step {forwards} of wave {wave}, but the pause that reached "
                f"every rank must be done by step {deadline[1]} of wave {deadline[0]} "
                "(rank rule 7)",
            )
        self.toys[r] = replace(toy, forwards=forwards, forwards_wave=wave)

    def _arrived(self, r: int) -> None:
        """The awaited call reached rank ``r``. Once a KEEP or ABORT pause reached every
        rank it waits for, the group's furthest step then plus ``2 * sync_interval`` is
        its deadline (a rank behind it runs the steps it owes; a WAIT pause lets requests
        finish first, for as long as they take)."""
        client = replace(self.client, arrivals=self.client.arrivals | {r})
        if client.awaited_mode is PauseMode.ABORT:
            held = frozenset(q.id for q in self.toys[r].requests)
            client = replace(client, doomed=client.doomed | held)
        if (
            client.awaited_mode in (PauseMode.KEEP, PauseMode.ABORT)
            and client.awaiting <= client.arrivals
            and client.pause_deadline is None
        ):
            wave = max(self.loops[q].machine.wave for q in client.awaiting)
            step = max(
                (
                    self.toys[q].forwards
                    for q in client.awaiting
                    if self.toys[q].forwards_wave == wave
                ),
                default=0,
            )
            deadline = (wave, step + 2 * self.config.sync_interval)
            client = replace(client, pause_deadline=deadline)
        self.client = client

    # -- the client -------------------------------------------------------------------------

    def end_requests(self, ids: frozenset[int], *, failed: bool = False) -> None:
        """These requests end (``failed``: with an error their caller sees); each
        accepted request ends exactly once."""
        if not ids:
            return  # most steps finish nothing
        again = ids & self.client.done
        if again:
            raise Violation("request_ended_twice", f"requests {sorted(again)} ended again")
        client = replace(self.client, done=self.client.done | ids)
        if failed:
            client = replace(client, failed=client.failed | ids)
        self.client = client

    def submit(self, spec: RequestSpec) -> int:
        client = self.client
        target = spec.rank % client.routing
        request_id = client.submitted
        self._note(f"client submits request {request_id} ({spec.steps} steps) to rank {target}")
        self.network.send(CLIENT, target, ("add", request_id, client.wave, spec.steps, spec.stalls))
        if not client.running:
            self.network.send(CLIENT, COORDINATOR, ("first_req", target, client.wave))
        self.client = replace(
            client,
            submitted=request_id + 1,
            owners=(*client.owners, target),
            running=True,
        )
        return request_id

    def refusal(self, op: tuple[object, ...]) -> str | None:
        """Why the client would refuse ``op`` now, or None when it may go ahead."""
        return refusal(self.client, op, self.scaler.active)

    def client_op(self, op: tuple[object, ...]) -> None:
        reason = self.refusal(op)
        if reason is not None:
            raise ClientRefused(f"{op[0]}: {reason}")
        self._note(f"client {op}")
        kind = op[0]
        if kind == "pause":
            self._call(range(self.client.group), PauseRequested(mode=op[1]), awaited=True)  # type: ignore[arg-type]
        elif kind == "resume":
            self._call(range(self.client.group), ResumeRequested(), awaited=False)
            self.client = replace(self.client, paused=False)
        elif kind == "sleep":
            mode = op[2] if len(op) > 2 else PauseMode.ABORT
            sleep = SleepRequested(level=op[1], mode=mode)  # type: ignore[arg-type]
            self._call(range(self.client.group), sleep, awaited=True)
            self.client = replace(self.client, asleep=True)
        elif kind == "wake":
            self._call(range(self.client.group), WakeUpRequested(), awaited=False)
            # Only a wake of something asleep resumes the ranks (rank rule 10).
            if self.client.asleep:
                self.client = replace(self.client, asleep=False, paused=False)
        else:
            old = self.client.group
            event = ScaleRequested(old_dp_size=old, dp_size=op[1])  # type: ignore[arg-type]
            self._scale_actions(self._handle(self.scaler, event, "scaler"))
            self._check_second_scale_refused()
        check_after_move(self, self.coordinator.wave)

    def _check_second_scale_refused(self) -> None:
        """Scaling rule 7, in every phase a scale reaches: a second scale is refused
        with ``ReconfigurationActiveError`` and changes nothing (the client's front end
        refuses it the same way)."""
        if not self.scaler.active:
            return
        scaler = self.scaler.copy()
        before = scaler.snapshot()  # type: ignore[attr-defined]
        second = ScaleRequested(old_dp_size=self.client.group, dp_size=self.client.group + 1)
        try:
            scaler.handle(second)  # type: ignore[attr-defined]
        except ReconfigurationActiveError:
            if scaler.snapshot() == before:  # type: ignore[attr-defined]
                return
        raise Violation(
            "second_scale",
            f"a second scale in {self.scaler.phase.name} was not refused, or changed the scale",
        )

    def _call(self, ranks: range | tuple[int, ...], request: object, *, awaited: bool) -> None:
        call_id = self.client.calls
        for r in ranks:
            self.network.send(CLIENT, r, ("call", call_id, request))
        self.client = replace(self.client, calls=call_id + 1)
        if awaited:
            mode = getattr(request, "mode", None)
            self.client = replace(
                self.client,
                awaited_call=call_id,
                awaiting=frozenset(ranks),
                awaited_mode=mode,
                arrivals=frozenset(),
                pause_deadline=None,
                doomed=frozenset(),
            )

    def answered(self, r: int, call_id: int, error: str | None) -> None:
        if error is not None:
            raise Violation("protocol_error", f"rank {r} refused call {call_id}: {error}")
        client = self.client
        if call_id != client.awaited_call:
            return
        check_answer(self, r, client.awaited_mode)
        awaiting = client.awaiting - {r}
        if awaiting:
            self.client = replace(client, awaiting=awaiting)
            return
        # A pause, a sleep, or a scale's pause or switch: every rank answered.
        self.client = replace(
            client,
            awaiting=awaiting,
            awaited_call=None,
            awaited_mode=None,
            arrivals=frozenset(),
            pause_deadline=None,
            doomed=frozenset(),
            paused=True,
        )


def coordinator_event(message: Message) -> object:
    """The coordinator's event for a message to it."""
    kind = message[0]
    if kind == "first_req":
        return FirstRequest(rank=message[1], wave=message[2])  # type: ignore[arg-type]
    if kind == "start_wave":
        return RankStartedWave(rank=message[1], wave=message[2])  # type: ignore[arg-type]
    if kind == "wave_complete":
        return WaveCompleted(wave=message[1])  # type: ignore[arg-type]
    return Resize(dp_size=message[1])  # type: ignore[arg-type]


def _carried_wave(message: Message) -> int:
    """The newest wave a message to the coordinator vouches for: a completion's is the
    wave after the one it ends; a resize vouches for none."""
    kind = message[0]
    if kind in ("first_req", "start_wave"):
        return message[2]  # type: ignore[return-value]
    if kind == "wave_complete":
        return message[1] + 1  # type: ignore[operator]
    return -1


class _RankEffects:
    """The modelled effects of rank ``r`` (``rank_loop.RankEffects``)."""

    def __init__(self, world: World, r: int) -> None:
        self.world = world
        self.r = r

    def add_request(self, request_id: str, payload: object) -> None:
        steps, stalls = payload  # type: ignore[misc]
        toy = self.world.toys[self.r]
        request = ToyRequest(id=int(request_id), remaining=steps, stalls=stalls)
        self.world.toys[self.r] = replace(toy, requests=(*toy.requests, request))

    def abort_requests(self, request_ids: tuple[str, ...]) -> None:
        self._finish(frozenset(int(i) for i in request_ids))

    def stop_requests(self, request_ids: tuple[str, ...]) -> None:
        self._finish(frozenset(int(i) for i in request_ids))

    def _finish(self, ids: frozenset[int]) -> None:
        world = self.world
        toy = world.toys[self.r]
        held = frozenset(q.id for q in toy.requests) & ids
        kept = tuple(q for q in toy.requests if q.id not in ids)
        world.toys[self.r] = replace(toy, requests=kept)
        world.end_requests(held)

    def pause_scheduler(self, mode: PauseMode) -> None:
        if mode is PauseMode.ABORT:
            self._finish(frozenset(q.id for q in self.world.toys[self.r].requests))
        self.world.toys[self.r] = replace(self.world.toys[self.r], scheduler_pause=mode)

    def resume_scheduler(self) -> None:
        self.world.toys[self.r] = replace(self.world.toys[self.r], scheduler_pause=None)

    def reset_prefix_cache(self) -> None:
        pass

    def start_vote(self, vote: StartVote) -> None:
        self.world.start_vote(self.r, vote)

    def notify_coordinator(self, message: NotifyStartWave | NotifyWaveComplete) -> None:
        network = self.world.network
        # A local half of the coordinator-wave property (``por`` rule 7b): a rank
        # announces only a wave it is in, and completes only one it left.
        own = self.world.loops[self.r].machine.wave
        ahead = message.wave > own if isinstance(message, NotifyStartWave) else message.wave >= own
        if ahead:
            raise Violation("coordinator_wave", f"rank {self.r} in wave {own} sends {message}")
        if isinstance(message, NotifyStartWave):
            network.send(self.r, COORDINATOR, ("start_wave", self.r, message.wave))
            return
        network.send(self.r, COORDINATOR, ("wave_complete", message.wave))
        if self.world.config.duplicate_wave_complete:
            network.send(DUPLICATOR, COORDINATOR, ("wave_complete", message.wave))

    def announce_held(self, request_ids: tuple[str, ...], reason: str) -> None:
        held = frozenset(int(i) for i in request_ids)
        self.world.client = replace(self.world.client, held=self.world.client.held | held)

    def report(self) -> object:
        return None

    def reply(self, call_id: int, *, error: str | None = None, result: object = None) -> None:
        self.world.answered(self.r, call_id, error)
