"""Partial-order reduction: states where one rank's moves stand for every interleaving.

Theory of operation (``ExploreConfig.reduction``: "por", the default, or "none"):

1. At a state, the explorer may expand only the enabled moves of one rank r
   (deliveries into r, r's step) instead of every enabled move, when they form a
   *persistent set*: along every sequence of moves of the other parties (client,
   coordinator, other ranks) in which r does not move, each of those moves commutes
   with each of r's moves and disables none. Then every interleaving of the full graph
   has a representative in the reduced one: the same moves, each party's in the same
   order, with r's moves pulled ahead (and possibly more of them). Of the ranks that
   qualify (rules 2 to 4), the one with the fewest enabled moves is taken.
2. The client must not change what r's moves read or do before r moves (``calm_ranks``):

   a. no scale is left in its script (a scale changes the group and routing), and one
      that is active waits for the answers to one of its calls (its pause or its
      switch), in a run where no rank may die: it moves on only once every rank
      answered, r among them, so until r moves it is a client awaiting a call (b);
   b. while it awaits a call, r has not answered it: the client can do nothing until
      every rank answered, and the last answer (which makes the client see the
      engines paused) needs r's; the other answers only take their rank out of
      ``awaiting``. Pulling r's answer ahead of other moves changes nothing checked,
      for a rank that answered is paused and a forward of a paused rank is caught as
      ``forward_after_pause`` whether the client saw the pause done or not;
   c. while a KEEP or ABORT pause's deadline is not fixed, r has not received the
      call. The last arrival fixes the deadline from every rank's (wave, forwards)
      then, which only grow; r's forwards before its own arrival are never held to it,
      and pulling r's moves (its arrival among them) ahead can only make the last
      arrival come sooner, so the deadline earlier: every forward held to a deadline
      on a path of the full graph is held to one no later on its representative, and
      a slow pause is still caught (perhaps sooner, which ends that path);
   d. with no call awaited and calls left, the client neither sees the engines paused
      nor asleep (a resume or a wake would change what a forward is checked against);
   e. what the client may still send to r before r moves (a request for r; any call,
      unless it awaits r's answer) queues behind a message already in that channel.
      Whatever else ranks write into the client (finished and held requests) are
      unions of their own requests, which commute.
3. The coordinator must not newly reach r: a START_DP_WAVE it might send queues
   behind one already in flight to r, or it cannot broadcast before r moves: no
   first_req, no fresh start_wave (one for a newer wave, or for its wave while it is
   idle) is in flight to it, no request is left to submit, and no other rank may
   announce a wave (``may_announce``: a request, a START_DP_WAVE, a resume or a wake
   is in flight to it, or it waits in or has queued a resume barrier). Or every
   START_DP_WAVE that may reach r before it moves is one rule 9b drops as it is sent
   (``_deaf_to_broadcasts``): r runs in the newest wave any party knows of.
4. What r's moves share with other ranks commutes: a vote's ballots are fixed once
   every member started it, and the rank that reads it reads the same result in
   whichever move completes it (the vote table is kept in one normal form); a barrier
   completes with one result when its last member enters; r's state changes only by
   its own moves or a collective it waits in (none: it has a move enabled); r sends
   only to the coordinator on its own channel, where appending behind the head
   commutes with delivering it. The group must be fixed: every rank in it, none in a
   group join, nothing in flight from a departed rank.
5. Premises, checked at every move of a search with the reduction on: the coordinator
   broadcasts only while taking a first_req or a fresh start_wave, and leaves running
   only for a newer wave (so a stale start_wave stays stale); a rank announces a wave
   only when it ``may_announce``d before the move; with no scale left the group does
   not change. A machine that breaks one (a broken variant may) raises
   ``ReductionError`` and the explorer starts that search over without the reduction.
6. Cycles (the ignoring problem): a state is expanded in full when one of r's moves
   leads to a state first reached at the same or a lower level of the breadth-first
   search. Every cycle of the reduced graph holds such an edge, so no move is put off
   around a cycle for ever.
7. Why no violation of the checked properties is hidden. By rule 1 the reduced graph
   holds, for every path of the full one, a path of the same moves with each party's
   in the same order, possibly followed by more moves of ranks, or one that meets a
   violation sooner (rules 2b and 2c). So:

   a. a check that reads one party's state (and client fields that rules 2 and 3 keep
      fixed) sees the same sequence: forwards after a pause or its reply, slow pauses,
      lockstep and drift, silent waits, collective order, call contracts, refused
      calls and protocol errors, the paused and asleep views, and the local halves of
      the coordinator-wave property (the coordinator adopts only a wave a message
      carried and publishes its own, a rank announces only a wave it is in, a rank's
      wave never goes back: ``world``, ``invariants``);
   b. the coordinator ahead of every rank cannot happen without one of those local
      halves failing first: its wave came from a message, the message's wave from its
      sender (in the group, rule 4), whose wave only grows;
   c. a rank waiting in a vote for a member that waits in a barrier (or the reverse)
      waits for ever, so the states after it show it too;
   d. a rank waiting for an idle member while nothing is in flight waits until the
      client acts (no message can reach the idle member otherwise, rule 5), so the
      state every other move leads to from there, where only the client could move,
      shows it too; such states, like the terminal ones where the end-state checks
      run, are all kept (unless a violation comes first), by a path of the same
      length: were none of a path's moves in a state's persistent set, that set's
      moves would still be enabled at the path's end.
8. A depth bound weakens rule 7: the reduced path to a violation may be longer than the
   shortest full one. A search that closes before the bound (``complete``) has checked
   every reachable violation; one stopped at the bound has checked representatives of
   the interleavings up to it (every violation the tests guard is still found at the
   depths they use, and a survey of small configurations finds the same violations and
   terminal states with and without the reduction: ``test_reduction``).
9. Inert messages (``drop_inert``, after every move of a search with the reduction
   on): a message that its receiver would ignore whenever it arrives is taken out of
   its channel at once. Delivering one is a move that changes no state but its
   channel (or, into an idle rank, an empty iteration that ends in the state it began
   in), so every path of the full graph maps to one of the same other moves in the
   reduced one, where the messages behind it arrive a move sooner, and every check
   sees the same sequence of states (a check that reads whether anything is in
   flight, the deadlock check, may fire a move sooner, on the state that follows the
   delivery). Each is checked against the machine itself (fed a copy of the receiver,
   it changes nothing and does nothing) and must stay ignored:

   a. to the coordinator, a start_wave that is stale (``_stale``) or a wave_complete of
      a wave before the coordinator's: its wave never goes back, and it leaves running
      only for a newer wave (premises of rule 5);
   b. to a lockstep rank, a START_DP_WAVE of a wave before its *floor*: its wave,
      plus one while it runs. A rank's floor never goes down (a premise checked at
      every move: a running rank stops only at the end of its wave or at a pause, both
      of which move it to the next wave). Only where no rank may die: a rank out of a
      broken group stops running in its wave. Into a rank waiting for input, the
      message wakes it for an empty step: it is dropped only where that step, tried
      on a copy of the world, leaves every party as it was (an idle rank's step
      finds the requests its last step found: every input is followed by a step).

   The lockstep ranks each announce a wave and the coordinator answers the first with
   a broadcast to all: the interleavings of the ignored rest (in flight, delivered)
   would otherwise multiply the states five times over.
"""

from __future__ import annotations

from functools import partial

from ..coordinator import CoordinatorMachine
from ..errors import ProtocolError
from ..rank import RankMachine, RankSnapshot
from ..rank_events import (
    JoinGroup,
    PauseMode,
    ResumeBarrier,
    ResumeRequested,
    StartWave,
    WakeUpRequested,
)
from ..rank_loop import Collective, RunStep, WaitForInput
from .network import CLIENT, COORDINATOR, Message, Move
from .world import Violation, World, coordinator_event

REDUCTIONS = ("por", "none")


class ReductionError(RuntimeError):
    """A premise of the reduction (rule 3) failed, so its result would not be sound."""


def calm_ranks(world: World, targets: frozenset[int], ops_left: bool) -> frozenset[int]:
    """The ranks whose moves the client cannot interfere with until they move (rule 2).
    ``targets``: the ranks the requests still to submit go to; ``ops_left``: the client
    has calls left in its script (a scale's excluded)."""
    client = world.client
    if world.scaler.active and client.awaited_call is None:
        return frozenset()  # rule 2a
    if client.awaited_call is None:
        if ops_left and (client.paused or client.asleep):
            return frozenset()  # rule 2d
        ranks = frozenset(range(len(world.loops)))
    elif client.pause_deadline is None and client.awaited_mode in (PauseMode.KEEP, PauseMode.ABORT):
        ranks = client.awaiting - client.arrivals  # rule 2c
    else:
        ranks = client.awaiting
    # Rule 2e.
    waits = client.awaiting if client.awaited_call is not None else frozenset()
    exposed = targets | (frozenset(range(len(world.loops))) - waits if ops_left else frozenset())
    return frozenset(r for r in ranks if r not in exposed or (CLIENT, r) in world.network)


def persistent_moves(
    world: World, moves: list[Move], calm: frozenset[int], submits_left: bool
) -> list[Move] | None:
    """The enabled moves of one of the ``calm`` ranks that stand for all of ``moves``
    (rules 1, 3 and 4), or None where no rank qualifies or its moves are all there is."""
    if not _group_fixed(world):
        return None
    by_rank: dict[int, list[Move]] = {}
    for move in moves:
        rank = move[2] if move[0] == "deliver" else move[1] if move[0] == "step" else None
        if isinstance(rank, int) and rank in calm:
            by_rank.setdefault(rank, []).append(move)
    announcers = {q for q in range(len(world.loops)) if may_announce(world, q)}
    announced = submits_left or any(
        message[0] == "first_req" or (message[0] == "start_wave" and not _stale(world, message))
        for (_, receiver), queue in world.network.channels.items()
        if receiver == COORDINATOR
        for message in queue
    )
    eligible = [
        rank_moves
        for r, rank_moves in by_rank.items()
        if (COORDINATOR, r) in world.network
        or not (announced or announcers - {r})
        or _deaf_to_broadcasts(world, r, quiet=not (submits_left or _requests_in_flight(world)))
    ]
    if not eligible:
        return None
    chosen = min(eligible, key=len)
    return chosen if len(chosen) < len(moves) else None


def _deaf_to_broadcasts(world: World, r: int, *, quiet: bool) -> bool:
    """Whether every START_DP_WAVE the coordinator may send rank ``r`` before it moves
    is inert for it (rule 3, through rule 9b): ``r`` runs in wave w and takes no input
    now, no wave after w is known anywhere (a rank's, the coordinator's, the client's,
    one a message carries), and ``r`` ignores a START_DP_WAVE of any wave up to w.

    A broadcast of w+1 needs wave w to end first, which only a vote ``r`` started and
    others have still to read can do without ``r``, and then a cause to announce w+1
    or to wake the coordinator into it: a request arriving at an idle rank, or a
    first_req. ``quiet``: none is in flight or left to submit. A START_DP_WAVE carries
    no wave after w (by induction), and a resume or a wake announces only out of a
    barrier that ``r`` must enter first."""
    loop = world.loops[r]
    machine = loop.machine
    if not (_floors_hold(world) and machine.running) or isinstance(loop.pending, WaitForInput):
        return False
    wave = machine.wave
    if (world.toys[r].votes and not quiet) or _newest_wave(world) > wave:
        return False
    return all(
        _changes_nothing(machine, StartWave(wave=old, exclude_rank=exclude))
        for old in range(wave + 1)
        for exclude in range(len(world.loops))
    )


def _requests_in_flight(world: World) -> bool:
    return any(
        message[0] in ("add", "first_req")
        for queue in world.network.channels.values()
        for message in queue
    )


def _newest_wave(world: World) -> int:
    """The newest wave any party knows of, or a message in flight makes known."""
    newest = max(world.coordinator.wave, world.client.wave)
    newest = max(newest, *(loop.machine.wave for loop in world.loops))
    for queue in world.network.channels.values():
        for message in queue:
            kind = message[0]
            if kind in ("first_req", "start_wave", "add"):
                newest = max(newest, message[2])  # type: ignore[call-overload]
            elif kind in ("start_dp_wave", "publish"):
                newest = max(newest, message[1])  # type: ignore[call-overload]
            elif kind == "wave_complete":
                newest = max(newest, message[1] + 1)  # type: ignore[operator]
    return newest


def may_announce(world: World, q: int) -> bool:
    """Whether rank ``q`` may send a start_wave before a broadcast reaches it (rule 3):
    a request or a START_DP_WAVE for it is in flight, or a resume or a wake (their
    barrier), or it waits in a resume barrier or has one queued."""
    for (_, receiver), queue in world.network.channels.items():
        if receiver == q and any(_wakes(message) for message in queue):
            return True
    _, loop = world.loops[q].snapshot()
    barrier_pending = isinstance(loop.pending, Collective) and isinstance(
        loop.pending.action, ResumeBarrier
    )
    return barrier_pending or any(isinstance(action, ResumeBarrier) for action in loop.queued)


def _wakes(message: tuple[object, ...]) -> bool:
    if message[0] in ("add", "start_dp_wave"):
        return True
    return message[0] == "call" and isinstance(message[2], ResumeRequested | WakeUpRequested)


def _stale(world: World, message: tuple[object, ...]) -> bool:
    """A start_wave the coordinator will never act on: for an older wave, or for its
    wave while it runs (it leaves running only for a newer wave: rule 5 checks it)."""
    wave = message[2]
    coordinator = world.coordinator
    return wave < coordinator.wave or (wave == coordinator.wave and coordinator.engines_running)  # type: ignore[operator]


def _group_fixed(world: World) -> bool:
    """The group is fixed (rule 4)."""
    if len(world.loops) != world.group_size:
        return False
    if any(
        isinstance(loop.pending, Collective) and isinstance(loop.pending.action, JoinGroup)
        for loop in world.loops
    ):
        return False
    return not any(
        isinstance(sender, int) and sender >= len(world.loops) and receiver == COORDINATOR
        for sender, receiver in world.network.channels
    )


def drop_inert(world: World) -> None:
    """Take every inert message out of its channel (rule 9)."""
    ranks_too = _floors_hold(world)
    for sender, receiver in world.network.pairs():
        if receiver == COORDINATOR:
            world.discard(sender, receiver, partial(_inert, world))
        elif sender == COORDINATOR and isinstance(receiver, int) and ranks_too:
            world.discard(sender, receiver, partial(_ignored_by, world, receiver))


def _inert(world: World, message: Message) -> bool:
    """Rule 9a."""
    kind = message[0]
    coordinator = world.coordinator
    if not (
        (kind == "start_wave" and _stale(world, message))
        or (kind == "wave_complete" and message[1] < coordinator.wave)  # type: ignore[operator]
    ):
        return False
    return _changes_nothing(coordinator, coordinator_event(message))


def _ignored_by(world: World, r: int, message: Message) -> bool:
    """Rule 9b."""
    loop = world.loops[r]
    machine = loop.machine
    if message[0] != "start_dp_wave" or message[1] >= _floor(machine.snapshot()):  # type: ignore[operator]
        return False
    if isinstance(loop.pending, WaitForInput):
        return _wakes_for_nothing(world, r, message)
    return _changes_nothing(machine, StartWave(wave=message[1], exclude_rank=message[2]))  # type: ignore[arg-type]


def _changes_nothing(machine: RankMachine | CoordinatorMachine, event: object) -> bool:
    """Whether a copy of ``machine`` fed ``event`` changes nothing and does nothing (a
    refusal is left for the search to report)."""
    probe = machine.copy()
    try:
        actions = probe.handle(event)
    except ProtocolError:
        return False
    return not actions and probe.snapshot() == machine.snapshot()


def _wakes_for_nothing(world: World, r: int, message: Message) -> bool:
    """Rule 9b, into an idle rank: delivered now, the message and the empty step it
    wakes the rank for leave every party as it was, but for the message's channel."""
    probe = world.clone()
    probe.network.keep(COORDINATOR, r, (message,))
    try:
        probe.apply(("deliver", COORDINATOR, r))
        if isinstance(probe.loops[r].pending, RunStep):
            probe.apply(("step", r))
    except (Violation, ProtocolError):
        return False  # left for the search to report
    channels = {
        pair: queue for pair, queue in world.network.channels.items() if pair != (COORDINATOR, r)
    }
    return (
        probe.network.channels == channels
        and [loop.snapshot() for loop in probe.loops] == [loop.snapshot() for loop in world.loops]
        and probe.toys == world.toys
        and probe.client == world.client
        and probe.coordinator.snapshot() == world.coordinator.snapshot()
    )


def _floors_hold(world: World) -> bool:
    """Whether rule 9b's premise holds for this world: lockstep ranks none of which
    may die."""
    return world.config.lockstep and not world.config.deaths


def _floor(snapshot: RankSnapshot) -> int:
    """The oldest wave a START_DP_WAVE may still start for the rank (rule 9b)."""
    return snapshot.wave + snapshot.running


def check_premises(before: World, move: Move, after: World, *, scaling_over: bool) -> None:
    """The premises of rules 5 and 9, for ``move`` from ``before`` to ``after``;
    ``scaling_over``: no scale is active or left in the client's script."""
    if move[0] == "die":
        # It sends nothing, and renumbers the ranks' channels; a death may come only
        # while the reduction is off (the explorer's ``scaling_over``).
        return
    if scaling_over and (
        after.group_size != before.group_size or len(after.loops) != len(before.loops)
    ):
        raise ReductionError(f"{move} changed the group with no scale left")
    channels = before.network.channels
    if move[0] == "deliver" and move[2] == COORDINATOR:
        message = channels[move[1], COORDINATOR][0]  # type: ignore[index]
        old, new = before.coordinator, after.coordinator
        if new.wave < old.wave:
            raise ReductionError(f"the coordinator went back to wave {new.wave} on {message}")
        if old.engines_running and not new.engines_running and new.wave <= old.wave:
            raise ReductionError(f"the coordinator went idle in wave {new.wave} on {message}")
        cause = message[0] == "first_req" or (
            message[0] == "start_wave" and not _stale(before, message)
        )
        if not cause and any(
            len(after.network.channels.get((COORDINATOR, r), ()))
            > len(channels.get((COORDINATOR, r), ()))
            for r in range(len(after.loops))
        ):
            raise ReductionError(f"the coordinator broadcast on {message}")
        return
    if _floors_hold(after):
        for q, (old_loop, new_loop) in enumerate(zip(before.loops, after.loops, strict=False)):
            if _floor(new_loop.machine.snapshot()) < _floor(old_loop.machine.snapshot()):
                raise ReductionError(f"rank {q}'s floor went down in {move}")
    for q in range(len(after.loops)):
        sent = after.network.channels.get((q, COORDINATOR), ())[
            len(channels.get((q, COORDINATOR), ())) :
        ]
        if any(message[0] == "start_wave" for message in sent) and not may_announce(before, q):
            raise ReductionError(f"rank {q} announced a wave in {move} without a cause")
