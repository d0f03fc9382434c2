"""What the client, the coordinator and the ranks send each other (tags 30600-30649).

Every message is a frozen dataclass registered on `wavecore.channels.default_registry`,
so a frame that does not decode to exactly these shapes is refused by the codec before
any of our code sees it. `SamplingParams` and the stats types of `interface` are registered as
they are: they are already frozen dataclasses of plain fields.

Startup (over REQ/REP, client listening): a rank sends `RankHello`, gets its
`RankAssignment`, loads its model and sends `RankReady` (or `RankStartupFailed`); the
client answers each with `HandshakeReply`. The coordinator sends `CoordinatorHello`
with the addresses it bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wavecore.channels import default_registry
from wavecore.engine.interface import CoreStats, RankCounters, RankStats
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured_outputs import StructuredOutputs

default_registry.register(SamplingParams, tag=30600)
default_registry.register(StructuredOutputs, tag=30645)
default_registry.register(CoreStats, tag=30601)
default_registry.register(RankCounters, tag=30622)
default_registry.register(RankStats, tag=30623)


def _message(tag: int):  # type: ignore[no-untyped-def]
    return default_registry.register(tag=tag)


# -- startup ------------------------------------------------------------------------


@_message(30602)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankHello:
    """A rank says it started. Its input listens at `input_address` (the front end dials
    it: only the rank can receive what is sent there), named `input_channel` for the
    channel key (`engine/dp/channel_key.py`)."""

    rank: int
    pid: int
    input_address: str
    input_channel: str


@_message(30603)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankAssignment:
    """Where a rank connects and which DP group it joins."""

    rank: int
    dp_size: int
    lockstep: bool
    sync_interval: int
    output_address: str
    coordinator_input_address: str
    coordinator_publish_address: str
    store_host: str
    store_port: int
    group_prefix: str
    collective_timeout_s: float
    # The client's name for this rank process, unique for the engine's lifetime: a
    # shrink renumbers the ranks, a member keeps its id (its beats and failures carry
    # it, so the client can tell a rank it dropped from the one now holding its number).
    member: int
    # A rank started by a scale up: it starts paused (KEEP) and joins no group until
    # the commit's `SwitchGroup`.
    joining: bool = False


@_message(30604)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankReady:
    """The model is loaded; `config_items` lets the client name any difference."""

    rank: int
    config_hash: str
    config_items: dict[str, str]
    max_model_len: int


@_message(30605)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankStartupFailed:
    rank: int
    error: str


@_message(30606)
@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorHello:
    pid: int
    input_address: str
    publish_address: str


@_message(30607)
@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeReply:
    accepted: bool
    reason: str
    assignment: RankAssignment | None = None


# -- client -> rank -----------------------------------------------------------------


@_message(30610)
@dataclass(frozen=True, slots=True, kw_only=True)
class AddRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    wave: int
    # The LoRA adapter it runs under (None: the base model); every rank holds it.
    lora: str | None = None


@_message(30611)
@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@_message(30612)
@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequests:
    """A stop string matched in the client: finish these requests without a reply."""

    request_ids: tuple[str, ...]


@_message(30613)
@dataclass(frozen=True, slots=True, kw_only=True)
class UtilityCall:
    """`method` is one of UTILITY_METHODS; only the argument it takes is set."""

    call_id: int
    method: str
    pause_mode: str | None = None
    sleep_level: int | None = None
    wake_tags: tuple[str, ...] | None = None


@_message(30614)
@dataclass(frozen=True, slots=True, kw_only=True)
class FrontEndAlive:
    """The front end's heartbeat (`engine/dp/heartbeat.py`), every heartbeat_interval."""


UTILITY_METHODS = frozenset({"pause", "resume", "sleep", "wake_up", "reset_prefix_cache", "stats"})


# -- rank -> client -----------------------------------------------------------------

# The most `IterationDetails` a rank holds back before it sends them in a frame.
ITERATIONS_PER_FRAME = 64


@_message(30620)
@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLogprobs:
    """(token_id, logprob, top alternatives) per new token, for requests that asked."""

    request_id: str
    entries: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...]


@_message(30646)
@dataclass(frozen=True, slots=True, kw_only=True)
class IterationDetails:
    """One forward of a rank (`EngineConfig.log_iteration_details`), upstream's fields:
    its index among the rank's forwards, the context (prefill) and generation (decode)
    requests it ran and their tokens, how long its forward and sampling took on the
    model thread, and whether it was a dummy batch (a lockstep rank with no work)."""

    iteration: int
    context_requests: int
    context_tokens: int
    generation_requests: int
    generation_tokens: int
    elapsed_ms: float
    dummy: bool = False


@_message(30621)
@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutputs:
    """Everything one loop iteration of one rank produced: one frame per step.

    Columnar, so that a step of hundreds of requests encodes as a few flat arrays:
    request `request_ids[i]` got `token_counts[i]` new tokens, taken in order from
    `token_ids`; `finished` maps the requests that finished to their reason, and
    `errors` those that finished with reason "error" to what went wrong (a grammar
    that failed on the rank).

    `iterations` (only with `log_iteration_details`) are the forwards the rank ran
    since its last frame that carried any: a rank that runs only dummy batches holds
    them until it has `ITERATIONS_PER_FRAME`, answers a call or waits for input, so
    they never cost a frame of their own per step.
    """

    rank: int
    request_ids: tuple[str, ...]
    token_counts: tuple[int, ...]
    token_ids: tuple[int, ...]
    finished: dict[str, str]
    logprobs: tuple[RequestLogprobs, ...] = ()
    errors: dict[str, str] = field(default_factory=dict)
    iterations: tuple[IterationDetails, ...] = ()

    def __post_init__(self) -> None:
        if len(self.token_counts) != len(self.request_ids):
            raise ValueError("StepOutputs needs one token count per request id")
        if sum(self.token_counts) != len(self.token_ids):
            raise ValueError("StepOutputs token counts do not add up to its token ids")


@_message(30624)
@dataclass(frozen=True, slots=True, kw_only=True)
class UtilityResult:
    rank: int
    call_id: int
    error: str | None
    stats: RankStats | None = None


@_message(30625)
@dataclass(frozen=True, slots=True, kw_only=True)
class RequestsHeld:
    """These requests reached a paused or sleeping rank and wait (`reason`)."""

    rank: int
    request_ids: tuple[str, ...]
    reason: str


@_message(30626)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankFailed:
    """The rank's loop stopped with an error; it waits for shutdown. `in_collective`: the
    error came out of a collective of the DP group, where a peer's death shows first."""

    rank: int
    error: str
    in_collective: bool = False
    member: int = 0  # `RankAssignment.member` (a rank in the front end's process: 0)


@_message(30627)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankAlive:
    """A rank's heartbeat (`engine/dp/heartbeat.py`), every heartbeat_interval, sent by
    its event loop whatever its model thread is doing."""

    rank: int
    member: int  # `RankAssignment.member`


# -- coordinator traffic ----------------------------------------------------------------


@_message(30630)
@dataclass(frozen=True, slots=True, kw_only=True)
class FirstRequest:
    rank: int
    wave: int


@_message(30631)
@dataclass(frozen=True, slots=True, kw_only=True)
class WaveStarted:
    rank: int
    wave: int


@_message(30632)
@dataclass(frozen=True, slots=True, kw_only=True)
class WaveComplete:
    wave: int


@_message(30633)
@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    rank: int
    waiting: int
    running: int
    kv_usage: float


@_message(30634)
@dataclass(frozen=True, slots=True, kw_only=True)
class StartDPWave:
    wave: int
    exclude_rank: int


@_message(30635)
@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorState:
    wave: int
    engines_running: bool
    waiting: tuple[int, ...]
    running: tuple[int, ...]
    kv_usage: tuple[float, ...]
    # Frames the coordinator's input dropped as malformed or impossible, so far.
    dropped_frames: int = 0


WAVE_TOPIC = "wave"
STATE_TOPIC = "state"
SCALE_TOPIC = "scale"


# -- elastic scaling (see engine/dp/scaling.py) -------------------------------------------


@_message(30640)
@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchGroup:
    """Commit of a scale: join the gloo group `group_prefix` of `dp_size` ranks, adopt
    its max of (wave, step_counter); the reply is a `UtilityResult` for `call_id`."""

    call_id: int
    dp_size: int
    group_prefix: str


@_message(30644)
@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveGroup:
    """A rank of the group was lost: leave the broken group, paused KEEP, and from now on
    be rank `rank` (the shrink renumbers the survivors; the switch that follows keeps
    it); the reply is a `UtilityResult` for `call_id`, from the new number."""

    call_id: int
    rank: int


@_message(30641)
@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorResize:
    dp_size: int


@_message(30642)
@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectEnds:
    """Ranks are about to join: `markers` more senders will each end their stream
    once. The coordinator answers with `EndsExpected(token)` on SCALE_TOPIC."""

    markers: int
    token: int


@_message(30643)
@dataclass(frozen=True, slots=True, kw_only=True)
class EndsExpected:
    token: int
