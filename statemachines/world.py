"""A whole DP deployment in miniature: the shared core of the simulation and the explorer.

Theory of operation:

1. Parties: one client, one coordinator, N ranks (a ``RankMachine`` each plus a toy
   scheduler whose requests need ``steps`` forwards after ``stalls`` zero-token steps),
   and a duplicating network that may hand the coordinator a second copy of any
   ``wave_complete`` at any later time (the only message the protocol allows twice).
2. Every (sender, receiver) pair is one FIFO channel. A *move* is one of: deliver the
   head of a channel, let a rank run one loop step, or let the client act. Any enabled
   move may come next, so messages from different senders interleave arbitrarily and
   may stay in flight across pauses and barriers.
3. A rank blocked in a collective takes no message. The all-reduce (and the resume
   barrier) completes the moment the last rank of the group enters it.
4. The client's view of (wave, running) is whatever the coordinator last published; it
   sends FIRST_REQ whenever that view says idle. It never resumes while its pause is
   unanswered (the rank refuses too) nor while asleep. A pause is answered by each
   rank's ``PauseComplete``, a sleep by its ``EnterSleep``; no other reply (a wake's)
   counts.
5. A scale is the client's script: prepare (new ranks join paused, their schedulers
   too; leaving ranks leave load balancing; staying ranks pause KEEP, leaving ones
   ABORT, so what they held is reported aborted), commit once every pause is answered
   (the DP group switches at once; rank 0 sends ``resize`` to the coordinator), then
   resume only once the coordinator has published the new size. Until then the
   client's table keeps the old ranks, so no message naming a new rank can reach a
   coordinator that does not know it.
6. Invariants are checked after every move (``Violation`` names the rule): lockstep,
   drift, no forward after pause consensus or after the client was told "paused",
   requests reaching a paused or sleeping rank are announced, the coordinator's wave
   never goes backwards nor ahead of the ranks, and no deadlock (a rank in a collective
   while a peer is idle, or in another collective, with nothing in flight). At
   quiescence (nothing to deliver, nothing to step): the coordinator agrees with the
   ranks, every pause or sleep the client waits for was answered, and every accepted
   request finished unless the engines are paused.
7. The world is a value: ``clone()`` is cheap (machines keep their state in one frozen
   snapshot) and ``key()`` hashes everything that decides the future.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .coordinator import (
    BroadcastStartWave,
    CoordinatorMachine,
    FirstRequest,
    PublishState,
    RankStartedWave,
    Resize,
    WaveCompleted,
)
from .errors import ProtocolError
from .rank import (
    EnterSleep,
    Idle,
    NotifyStartWave,
    NotifyWaveComplete,
    PauseComplete,
    PauseMode,
    PauseRequested,
    PauseScheduler,
    PauseState,
    RankMachine,
    Reconfigured,
    RequestArrived,
    RequestHeld,
    ResumeBarrier,
    ResumeRequested,
    ResumeScheduler,
    ResumeSynced,
    RunDummyBatch,
    SleepRequested,
    StartWave,
    StepDone,
    SyncDone,
    SyncDP,
    WakeUpRequested,
)
from .scaling import (
    CommitRequested,
    DrainAndShutdown,
    GroupPrepared,
    ReconfigureFinished,
    ScaleDirection,
    ScaleRequested,
    ScaleRole,
    ScalingMachine,
    SwitchDone,
)

CLIENT, COORDINATOR, DUPLICATOR = "client", "coordinator", "network"
Party = int | str
Message = tuple[object, ...]
Move = tuple[object, ...]


class Violation(Exception):
    """A protocol property was broken; ``rule`` names it, ``trace`` shows how."""

    def __init__(self, rule: str, detail: str) -> None:
        self.rule = rule
        self.detail = detail
        self.trace: list[str] = []
        super().__init__(f"{rule}: {detail}")

    def report(self) -> str:
        lines = [f"VIOLATION {self.rule}: {self.detail}", "trace:"]
        lines += [f"  {n:3d}. {line}" for n, line in enumerate(self.trace, 1)]
        return "\n".join(lines)


class ClientRefused(Exception):
    """The client refuses an operation in its current state (e.g. resume while pausing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    rank: int
    steps: int = 2
    stalls: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ToyRequest:
    id: int
    remaining: int
    stalls: int
    admitted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLoop:
    """What the busy loop around one ``RankMachine`` holds besides the machine."""

    must_step: bool = False
    collective: str | None = None
    contribution: SyncDP | ResumeBarrier | None = None
    forwards: int = 0
    forwards_wave: int = 0
    requests: tuple[ToyRequest, ...] = ()
    scheduler_pause: PauseMode | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientState:
    group: int
    wave: int = 0
    running: bool = False
    submitted: int = 0
    done: frozenset[int] = frozenset()
    held: frozenset[int] = frozenset()
    awaiting: frozenset[int] = frozenset()
    # The reply that answers the awaited call: a rank also answers calls the client does
    # not wait for (a wake), and such a reply must not count as the answer to a pause.
    awaited_reply: type[PauseComplete] | type[EnterSleep] | None = None
    paused: bool = False
    asleep: bool = False
    scaling_to: int | None = None
    # The ranks switched groups; the client waits for the coordinator's publication of
    # the new size before it uses the new table or resumes.
    committed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldConfig:
    dp_size: int = 2
    sync_interval: int = 2
    lockstep: bool = True
    duplicate_wave_complete: bool = True
    rank_class: type[RankMachine] = RankMachine
    coordinator_class: type[CoordinatorMachine] = CoordinatorMachine
    scaling_class: type[ScalingMachine] = ScalingMachine


@dataclass(slots=True)
class World:
    config: WorldConfig
    ranks: list[RankMachine]
    loops: list[RankLoop]
    coordinator: CoordinatorMachine
    client: ClientState
    group_size: int
    channels: dict[tuple[Party, Party], tuple[Message, ...]] = field(default_factory=dict)
    scaling: dict[int, ScalingMachine] = field(default_factory=dict)
    trace: list[str] | None = None
    views_matter: bool = True

    @classmethod
    def start(cls, config: WorldConfig) -> World:
        n = config.dp_size
        return cls(
            config=config,
            ranks=[cls._new_rank(config, r, n) for r in range(n)],
            loops=[RankLoop() for _ in range(n)],
            coordinator=config.coordinator_class(n),
            client=ClientState(group=n),
            group_size=n,
        )

    @staticmethod
    def _new_rank(config: WorldConfig, rank: int, n: int, joining: bool = False) -> RankMachine:
        return config.rank_class(
            rank, n, sync_interval=config.sync_interval, lockstep=config.lockstep, joining=joining
        )

    # -- value semantics ------------------------------------------------------------------

    def clone(self) -> World:
        return World(
            config=self.config,
            ranks=[m.copy() for m in self.ranks],  # type: ignore[misc]
            loops=list(self.loops),
            coordinator=self.coordinator.copy(),  # type: ignore[arg-type]
            client=self.client,
            group_size=self.group_size,
            channels=dict(self.channels),
            scaling={r: m.copy() for r, m in self.scaling.items()},  # type: ignore[misc]
            views_matter=self.views_matter,
        )

    def forget_views(self) -> None:
        """The client will submit nothing more: its view of the engines no longer decides
        anything, so it is dropped (fewer distinct states, same futures)."""
        self.views_matter = False
        # A publication of a new group size still matters: it ends a reconfiguration.
        resizes = tuple(
            m for m in self.channels.pop((COORDINATOR, CLIENT), ()) if m[3] != self.client.group
        )
        if resizes:
            self.channels[COORDINATOR, CLIENT] = resizes
        self.client = replace(self.client, wave=0, running=False)

    def key(self) -> tuple[object, ...]:
        """Everything that decides the future. Step counters of a long-running wave are
        shifted down by a multiple of ``sync_interval``: the rules only ever compare them
        with 1, with each other and modulo the interval, so shifted states behave alike
        (a pause message can stay in flight for any number of dummy steps)."""
        snapshots = [m.snapshot() for m in self.ranks]
        loops = self.loops
        interval = self.config.sync_interval
        counters = [s.step_counter for s in snapshots if s.running]
        if counters and min(counters) > 2 * interval:
            shift = ((min(counters) - interval - 1) // interval) * interval
            snapshots, loops = self._shifted(snapshots, shift)
        return (
            tuple(snapshots),
            tuple(loops),
            self.coordinator.snapshot(),
            self.client,
            self.group_size,
            frozenset(self.channels.items()),
            tuple(sorted((r, m.snapshot()) for r, m in self.scaling.items())),
        )

    def _shifted(self, snapshots: list, shift: int) -> tuple[list, list[RankLoop]]:  # type: ignore[type-arg]
        shifted_snapshots, shifted_loops = [], []
        for snapshot, loop in zip(snapshots, self.loops, strict=True):
            if snapshot.running:
                snapshot = replace(snapshot, step_counter=snapshot.step_counter - shift)
                if loop.forwards_wave == snapshot.wave:
                    loop = replace(loop, forwards=loop.forwards - shift)
                if isinstance(loop.contribution, SyncDP):
                    contribution = replace(
                        loop.contribution, step_counter=loop.contribution.step_counter - shift
                    )
                    loop = replace(loop, contribution=contribution)
            shifted_snapshots.append(snapshot)
            shifted_loops.append(loop)
        return shifted_snapshots, shifted_loops

    @property
    def group(self) -> range:
        """The ranks of the DP group as it is now (it changes at a scale's commit)."""
        return range(self.group_size)

    def _note(self, text: str | Callable[[], str]) -> None:
        if self.trace is not None:
            self.trace.append(text if isinstance(text, str) else text())

    # -- moves ------------------------------------------------------------------------------

    def network_moves(self) -> list[Move]:
        """Deliveries and rank steps: everything but the client's own initiative."""
        moves: list[Move] = []
        for sender, receiver in self.channels:
            if isinstance(receiver, int) and self.loops[receiver].collective:
                continue
            moves.append(("deliver", sender, receiver))
        for r, loop in enumerate(self.loops):
            if loop.must_step and not loop.collective:
                moves.append(("step", r))
        return moves

    def apply(self, move: Move) -> None:
        waves_before = self.coordinator.wave
        if move[0] == "deliver":
            self._deliver(move[1], move[2])  # type: ignore[arg-type]
        elif move[0] == "step":
            self._step(move[1])  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown move {move!r}")
        self._check_after_move(waves_before)

    def _send(self, sender: Party, receiver: Party, message: Message) -> None:
        self.channels[sender, receiver] = (*self.channels.get((sender, receiver), ()), message)

    def _pop(self, sender: Party, receiver: Party) -> Message:
        head, *rest = self.channels[sender, receiver]
        if rest:
            self.channels[sender, receiver] = tuple(rest)
        else:
            del self.channels[sender, receiver]
        return head

    def _deliver(self, sender: Party, receiver: Party) -> None:
        message = self._pop(sender, receiver)
        self._note(f"deliver {sender}->{receiver} {message}")
        if receiver == COORDINATOR:
            self._coordinator_receives(message)
        elif receiver == CLIENT:
            self._client_receives(message)
        else:
            self._rank_receives(receiver, message)  # type: ignore[arg-type]

    def _client_receives(self, message: Message) -> None:
        _, wave, running, dp_size = message
        client = self.client
        if self.views_matter:
            client = replace(client, wave=wave, running=running)  # type: ignore[arg-type]
        if client.committed and dp_size == client.scaling_to:
            # The coordinator knows the new group: the client's table may grow and the
            # engines may resume without a new rank's messages reaching it first.
            client = replace(client, group=dp_size, scaling_to=None, committed=False)
        self.client = client

    # -- coordinator ----------------------------------------------------------------------

    def _coordinator_receives(self, message: Message) -> None:
        kind = message[0]
        if kind == "first_req":
            event: object = FirstRequest(rank=message[1], wave=message[2])  # type: ignore[arg-type]
        elif kind == "start_wave":
            event = RankStartedWave(rank=message[1], wave=message[2])  # type: ignore[arg-type]
        elif kind == "wave_complete":
            event = WaveCompleted(wave=message[1])  # type: ignore[arg-type]
        else:
            event = Resize(dp_size=message[1])  # type: ignore[arg-type]
        for action in self._handle(self.coordinator, event, "coordinator"):
            if isinstance(action, BroadcastStartWave):
                # To the ranks the coordinator knows that still exist: between a commit
                # and the coordinator's resize the two differ.
                for r in range(min(self.coordinator.dp_size, self.group_size)):
                    self._send(COORDINATOR, r, ("start_dp_wave", action.wave, action.exclude_rank))
            elif isinstance(action, PublishState) and (
                self.views_matter or len(action.loads) != self.client.group
            ):
                publication = ("publish", action.wave, action.engines_running, len(action.loads))
                self._send(COORDINATOR, CLIENT, publication)

    def _handle(self, machine: object, event: object, who: str) -> tuple[object, ...]:
        try:
            actions = machine.handle(event)  # type: ignore[attr-defined]
        except ProtocolError as error:
            raise Violation("protocol_error", f"{who}: {error}") from error
        self._note(lambda: f"    {who} <- {event} -> {actions}")
        return actions

    # -- ranks ----------------------------------------------------------------------------

    def _rank_receives(self, r: int, message: Message) -> None:
        machine = self.ranks[r]
        kind = message[0]
        held_before = machine.pause_state is not PauseState.UNPAUSED or bool(machine.asleep)
        request_id: int | None = None
        if kind == "add":
            _, request_id, wave, steps, stalls = message
            request = ToyRequest(id=request_id, remaining=steps, stalls=stalls)  # type: ignore[arg-type]
            loop = self.loops[r]
            self.loops[r] = replace(loop, requests=(*loop.requests, request))
            event: object = RequestArrived(wave=wave)  # type: ignore[arg-type]
        elif kind == "start_dp_wave":
            event = StartWave(wave=message[1], exclude_rank=message[2])  # type: ignore[arg-type]
        elif kind == "pause":
            event = PauseRequested(mode=message[1])  # type: ignore[arg-type]
        elif kind == "resume":
            event = ResumeRequested()
        elif kind == "sleep":
            event = SleepRequested(level=message[1])  # type: ignore[arg-type]
        else:
            event = WakeUpRequested(tags=message[1])  # type: ignore[arg-type]
        actions = self._handle(machine, event, f"rank {r}")
        if (
            request_id is not None
            and held_before
            and not any(isinstance(a, RequestHeld) for a in actions)
        ):
            raise Violation(
                "silent_wait", f"request {request_id} reached paused/sleeping rank {r} unannounced"
            )
        # The loop always steps after draining its inputs.
        self.loops[r] = replace(self.loops[r], must_step=True)
        self._perform(r, actions, request_id)

    def _step(self, r: int) -> None:
        machine, loop = self.ranks[r], self.loops[r]
        executed, requests, finished = _toy_step(loop.requests, loop.scheduler_pause)
        self._note(f"step rank {r}: executed={executed} unfinished={len(requests)}")
        if executed:
            self._forward(r)
        self.loops[r] = replace(self.loops[r], requests=requests)
        self.client = replace(self.client, done=self.client.done | finished)
        actions = self._handle(
            machine, StepDone(executed=executed, has_unfinished=bool(requests)), f"rank {r}"
        )
        self._perform(r, actions, None)

    def _forward(self, r: int) -> None:
        if self.ranks[r].pause_state is PauseState.PAUSED:
            raise Violation("forward_after_pause", f"rank {r} ran a forward after pause consensus")
        if self.client.paused:
            raise Violation(
                "forward_after_pause_reply",
                f"rank {r} ran a forward after the client saw the pause done",
            )
        loop = self.loops[r]
        wave = self.ranks[r].wave
        forwards = loop.forwards + 1 if loop.forwards_wave == wave else 1
        self.loops[r] = replace(loop, forwards=forwards, forwards_wave=wave)

    def _perform(self, r: int, actions: tuple[object, ...], request_id: int | None) -> None:
        for action in actions:
            loop = self.loops[r]
            if isinstance(action, RunDummyBatch):
                self._forward(r)
            elif isinstance(action, SyncDP):
                self.loops[r] = replace(loop, collective="sync", contribution=action)
            elif isinstance(action, ResumeBarrier):
                self.loops[r] = replace(loop, collective="barrier", contribution=action)
            elif isinstance(action, Idle):
                self.loops[r] = replace(loop, must_step=False)
            elif isinstance(action, NotifyStartWave):
                self._send(r, COORDINATOR, ("start_wave", r, action.wave))
            elif isinstance(action, NotifyWaveComplete):
                self._send(r, COORDINATOR, ("wave_complete", action.wave))
                if self.config.duplicate_wave_complete:
                    self._send(DUPLICATOR, COORDINATOR, ("wave_complete", action.wave))
            elif isinstance(action, PauseComplete | EnterSleep):
                self._answered(r, action)
            elif isinstance(action, PauseScheduler):
                self._pause_scheduler(r, action.mode)
            elif isinstance(action, ResumeScheduler):
                self.loops[r] = replace(loop, scheduler_pause=None)
            elif isinstance(action, RequestHeld) and request_id is not None:
                self.client = replace(self.client, held=self.client.held | {request_id})
        self._complete_collective()

    def _answered(self, r: int, reply: object) -> None:
        if type(reply) is not self.client.awaited_reply:
            return
        awaiting = self.client.awaiting - {r}
        paused = self.client.paused or (bool(self.client.awaiting) and not awaiting)
        awaited_reply = self.client.awaited_reply if awaiting else None
        self.client = replace(
            self.client, awaiting=awaiting, paused=paused, awaited_reply=awaited_reply
        )

    def _pause_scheduler(self, r: int, mode: PauseMode) -> None:
        loop = self.loops[r]
        requests = loop.requests
        if mode is PauseMode.ABORT:
            aborted = frozenset(q.id for q in requests)
            self.client = replace(self.client, done=self.client.done | aborted)
            requests = ()
        self.loops[r] = replace(loop, scheduler_pause=mode, requests=requests)

    def _complete_collective(self) -> None:
        group = [r for r in self.group]
        kinds = {self.loops[r].collective for r in group}
        if len(kinds) != 1 or None in kinds:
            return
        kind = kinds.pop()
        contributions = [self.loops[r].contribution for r in group]
        if kind == "sync":
            event = self._sync_result(group, contributions)  # type: ignore[arg-type]
        else:
            event = ResumeSynced(any_unfinished=any(c.has_unfinished for c in contributions))  # type: ignore[union-attr]
        self._note(f"collective {kind} completes: {event}")
        for r in group:
            self.loops[r] = replace(
                self.loops[r], collective=None, contribution=None, must_step=True
            )
        for r in group:
            self._perform(r, self._handle(self.ranks[r], event, f"rank {r}"), None)

    def _sync_result(self, group: list[int], contributions: list[SyncDP]) -> SyncDone:
        waves = {c.wave for c in contributions}
        steps = {c.step_counter for c in contributions}
        if len(waves) > 1 or len(steps) > 1:
            raise Violation("lockstep", f"all-reduce met waves {waves} and step counters {steps}")
        for r, c in zip(group, contributions, strict=True):
            loop = self.loops[r]
            forwards = loop.forwards if loop.forwards_wave == c.wave else 0
            if forwards != c.step_counter:
                raise Violation(
                    "lockstep",
                    f"rank {r} ran {forwards} forwards in wave {c.wave} but is at step {c.step_counter}",
                )
        return SyncDone(
            any_unfinished=any(c.has_unfinished for c in contributions),
            pausing_ranks=sum(c.pending_pause for c in contributions),
            wave_span=(min(waves), max(waves)),
            step_counter_span=(min(steps), max(steps)),
        )

    # -- invariants --------------------------------------------------------------------------

    def _check_after_move(self, coordinator_wave_before: int) -> None:
        wave = self.coordinator.wave
        if wave < coordinator_wave_before:
            raise Violation(
                "coordinator_wave", f"went back from {coordinator_wave_before} to {wave}"
            )
        rank_wave = max(self.ranks[r].wave for r in self.group)
        if wave > rank_wave:
            raise Violation("coordinator_wave", f"coordinator at {wave}, ranks at most {rank_wave}")
        waiting = {r: self.loops[r] for r in self.group if self.loops[r].collective}
        if not waiting:
            return
        kinds = {loop.collective for loop in waiting.values()}
        if len(kinds) > 1:
            raise Violation(
                "deadlock", f"ranks wait in different collectives: {sorted(map(str, kinds))}"
            )
        for r, loop in waiting.items():
            if loop.collective != "sync" or loop.contribution is None:
                continue
            for q in self.group:
                peer = self.loops[q]
                if (
                    q not in waiting
                    and self.ranks[q].wave == loop.contribution.wave  # type: ignore[union-attr]
                    and peer.forwards_wave == loop.contribution.wave  # type: ignore[union-attr]
                    and peer.forwards > loop.contribution.step_counter  # type: ignore[union-attr]
                ):
                    raise Violation(
                        "drift",
                        f"rank {q} ran {peer.forwards} forwards while rank {r} waits at step "
                        f"{loop.contribution.step_counter}",  # type: ignore[union-attr]
                    )
        if self.channels:
            return
        idle = [q for q in self.group if q not in waiting and not self.loops[q].must_step]
        if idle:
            raise Violation(
                "deadlock",
                f"ranks {sorted(waiting)} wait in the {kinds.pop()} while ranks {idle} are idle "
                "and nothing is in flight",
            )

    def quiescent(self) -> bool:
        return not self.network_moves()

    def check_quiescent(self) -> None:
        """The end-state properties; call only when ``quiescent()``."""
        ranks = [self.ranks[r] for r in self.group]
        running = any(m.running for m in ranks)
        if self.coordinator.engines_running != running:
            raise Violation(
                "coordinator_running",
                f"coordinator says running={self.coordinator.engines_running}, ranks {running}",
            )
        waves = {m.wave for m in ranks}
        if waves != {self.coordinator.wave}:
            raise Violation(
                "coordinator_wave", f"coordinator at {self.coordinator.wave}, ranks {waves}"
            )
        if self.client.awaiting:
            raise Violation(
                "call_unanswered",
                f"ranks {sorted(self.client.awaiting)} never answered the client's "
                f"{self.client.awaited_reply.__name__ if self.client.awaited_reply else 'call'}",
            )
        paused = any(m.pause_state is not PauseState.UNPAUSED or m.asleep for m in ranks)
        lost = set(range(self.client.submitted)) - self.client.done
        if lost and not paused:
            raise Violation("request_lost", f"requests {sorted(lost)} never finished")

    # -- the client -------------------------------------------------------------------------

    def submit(self, spec: RequestSpec) -> int:
        # Leaving ranks are dropped from load balancing as soon as a scale down starts.
        target = spec.rank % min(self.client.group, self.client.scaling_to or self.client.group)
        request_id = self.client.submitted
        view = self.client
        self._note(f"client submits request {request_id} ({spec.steps} steps) to rank {target}")
        self._send(CLIENT, target, ("add", request_id, view.wave, spec.steps, spec.stalls))
        if not view.running:
            self._send(CLIENT, COORDINATOR, ("first_req", target, view.wave))
        self.client = replace(view, submitted=request_id + 1, running=True)
        return request_id

    def refusal(self, op: tuple[object, ...]) -> str | None:
        """Why the client would refuse ``op`` now, or None when it may go ahead."""
        client = self.client
        busy = client.awaiting
        kind = op[0]
        if kind in ("pause", "sleep", "scale_prepare") and busy:
            return "a pause or sleep is still in flight"
        if kind in ("pause", "sleep", "wake", "resume") and client.scaling_to is not None:
            # The scale's own script pauses, commits and resumes.
            if kind != "resume" or not client.committed:
                return "a reconfiguration is in progress"
            return "the coordinator has not confirmed the new group yet"
        if kind == "resume":
            if busy:
                return "a pause is still in flight"
            if client.asleep:
                return "asleep: wake up first"
        if kind == "wake" and busy:
            return "a sleep is still in flight"
        if kind == "scale_prepare" and (client.scaling_to is not None or client.paused):
            return "a reconfiguration is active or the engines are paused"
        if kind == "scale_commit" and (
            client.scaling_to is None or client.committed or busy or not client.paused
        ):
            return "no prepared reconfiguration is paused and ready"
        return None

    def client_op(self, op: tuple[object, ...]) -> None:
        reason = self.refusal(op)
        if reason is not None:
            raise ClientRefused(f"{op[0]}: {reason}")
        self._note(f"client {op}")
        kind = op[0]
        if kind == "pause":
            self._broadcast(("pause", op[1]), reply=PauseComplete)
        elif kind == "resume":
            self._broadcast(("resume",), reply=None)
            self.client = replace(self.client, paused=False)
        elif kind == "sleep":
            self._broadcast(("sleep", op[1]), reply=EnterSleep)
            self.client = replace(self.client, asleep=True)
        elif kind == "wake":
            self._broadcast(("wake", None), reply=None)
            self.client = replace(self.client, asleep=False, paused=False)
        elif kind == "scale_prepare":
            self._scale_prepare(op[1])  # type: ignore[arg-type]
        elif kind == "scale_commit":
            self._scale_commit(self.client.scaling_to or self.client.group)
        else:
            raise ValueError(f"unknown client operation {op!r}")
        self._check_after_move(self.coordinator.wave)

    def _broadcast(
        self, message: Message, *, reply: type[PauseComplete] | type[EnterSleep] | None
    ) -> None:
        table = range(self.client.group)
        for r in table:
            self._send(CLIENT, r, message)
        if reply is not None:
            self.client = replace(self.client, awaiting=frozenset(table), awaited_reply=reply)

    def _scale_prepare(self, dp_size: int) -> None:
        old = self.client.group
        direction = ScaleDirection.UP if dp_size > old else ScaleDirection.DOWN
        for r in range(max(old, dp_size)):
            role = (
                ScaleRole.NEW
                if r >= old
                else (ScaleRole.REMOVING if r >= dp_size else ScaleRole.EXISTING)
            )
            machine = self.config.scaling_class(role)
            self._handle(
                machine, ScaleRequested(direction=direction, dp_size=dp_size), f"scaling {r}"
            )
            self._handle(machine, GroupPrepared(), f"scaling {r}")
            self.scaling[r] = machine
            if role is ScaleRole.NEW:
                joining = self._new_rank(self.config, r, dp_size, joining=True)
                self.ranks.append(joining)
                # A joining rank starts paused: its scheduler must hold what reaches it.
                self.loops.append(RankLoop(scheduler_pause=joining.snapshot().pause_mode))
        for r in range(old):
            mode = PauseMode.ABORT if r >= dp_size else PauseMode.KEEP
            self._send(CLIENT, r, ("pause", mode))
        self.client = replace(
            self.client,
            awaiting=frozenset(range(old)),
            awaited_reply=PauseComplete,
            scaling_to=dp_size,
        )

    def _scale_commit(self, dp_size: int) -> None:
        for r, machine in sorted(self.scaling.items()):
            for action in self._handle(machine, CommitRequested(), f"scaling {r}"):
                if isinstance(action, DrainAndShutdown):
                    lost = {q.id for q in self.loops[r].requests}
                    if lost:
                        raise Violation(
                            "request_lost", f"leaving rank {r} still held {sorted(lost)}"
                        )
        staying = [self.ranks[r] for r in range(dp_size)]
        merged = Reconfigured(
            rank=0,
            dp_size=dp_size,
            wave=max(m.wave for m in staying),
            running=any(m.running for m in staying),
            step_counter=max(m.step_counter for m in staying),
        )
        for r in range(dp_size):
            self._handle(self.ranks[r], replace(merged, rank=r), f"rank {r}")
        for r, machine in sorted(self.scaling.items()):
            for action in self._handle(machine, SwitchDone(), f"scaling {r}"):
                if isinstance(action, ReconfigureFinished) and r == 0:
                    self._send(0, COORDINATOR, ("resize", action.dp_size))
        for r in range(dp_size, len(self.ranks)):
            for sender in (CLIENT, COORDINATOR):
                for message in self.channels.pop((sender, r), ()):
                    if message[0] == "add":
                        raise Violation(
                            "request_lost", f"request {message[1]} sent to leaving rank {r}"
                        )
        del self.ranks[dp_size:]
        del self.loops[dp_size:]
        self.scaling = {}
        self.group_size = dp_size
        self.client = replace(self.client, committed=True)


def _toy_step(
    requests: tuple[ToyRequest, ...], pause: PauseMode | None
) -> tuple[bool, tuple[ToyRequest, ...], frozenset[int]]:
    """One scheduler step: every schedulable request advances (a stall counts as a
    zero-token step). Returns (executed, remaining requests, finished ids)."""
    executed = False
    remaining: list[ToyRequest] = []
    finished: set[int] = set()
    for request in requests:
        schedulable = pause is None or (pause is PauseMode.WAIT and request.admitted)
        if not schedulable:
            remaining.append(request)
        elif request.stalls:
            remaining.append(replace(request, stalls=request.stalls - 1, admitted=True))
        else:
            executed = True
            if request.remaining > 1:
                remaining.append(replace(request, remaining=request.remaining - 1, admitted=True))
            else:
                finished.add(request.id)
    return executed, tuple(remaining), frozenset(finished)
