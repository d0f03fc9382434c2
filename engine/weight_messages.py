"""Messages of weight updates, LoRA adapters, collective RPC and the profiler (tags
30650-30659).

These calls are answered by a rank outside its protocol machine (`core.rank_calls`):
they change what the model computes, never what the protocol does. Each call gets one
`RankReply` per rank, in order with the rank's `StepOutputs`, so the front end knows
exactly which outputs came before a new weight version and which after.

An in-memory update travels as `WeightChunk`s: each a slice of a flattened tensor as an
RFC 8746 typed array (bfloat16 as its uint16 bits, `dtype` says which), so a tensor of
any size crosses the channels in frames of bounded size, and nothing is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wavecore.channels import default_registry

STAGE, COMMIT, DISCARD, SET_VERSION = "stage", "commit", "discard", "set_version"
SAVE = "save"
WEIGHT_ACTIONS = frozenset({STAGE, COMMIT, DISCARD, SET_VERSION, SAVE})


def _message(tag: int):  # type: ignore[no-untyped-def]
    return default_registry.register(tag=tag)


@_message(30650)
@dataclass(frozen=True, slots=True, kw_only=True)
class WeightChunk:
    """Elements `[start, start + data.size)` of tensor `name` (flattened, row-major) of
    `shape` and torch dtype `dtype`, for the update `call_id`."""

    call_id: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    data: np.ndarray


@_message(30651)
@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsCall:
    """`action` STAGE: read `path` (or the chunks sent before under `call_id`), check it
    against the model and build the new weights beside the old ones; COMMIT: serve with
    what STAGE built (`stage_call`), under `version`; DISCARD: drop it, or the chunks
    of an update abandoned while they were sent (no reply);
    SET_VERSION: relabel the current weights `version`; SAVE: write the served weights
    into the directory `path`, in shards of at most `max_shard_size` bytes."""

    call_id: int
    action: str
    path: str | None = None
    partial: bool = False
    version: str | None = None
    stage_call: int | None = None
    max_shard_size: int | None = None


@_message(30652)
@dataclass(frozen=True, slots=True, kw_only=True)
class RpcCall:
    """Call the executor's remotely callable `method` with CBOR-encoded `[args, kwargs]`."""

    call_id: int
    method: str
    arguments: bytes


@_message(30653)
@dataclass(frozen=True, slots=True, kw_only=True)
class RankReply:
    """One rank's answer to a `WeightsCall` or `RpcCall`: `error` (with `refused` when
    the rank's state, not the input, was the reason), or the CBOR-encoded `result`."""

    rank: int
    call_id: int
    error: str | None = None
    refused: bool = False
    result: bytes | None = None


PROFILE_START, PROFILE_STOP = "start", "stop"


@_message(30654)
@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileCall:
    """`action` PROFILE_START: start the torch profiler, its trace to go into
    `directory`; PROFILE_STOP: stop it and write the trace (the reply's result is its
    path)."""

    call_id: int
    action: str
    directory: str | None = None


LORA_ADD, LORA_REMOVE, LORA_PIN = "add", "remove", "pin"


@_message(30655)
@dataclass(frozen=True, slots=True, kw_only=True)
class LoRACall:
    """`action` LORA_ADD: read and keep the adapter `name` from the directory `path`;
    LORA_REMOVE: drop it; LORA_PIN: keep it resident from now on."""

    call_id: int
    action: str
    name: str
    path: str | None = None


RANK_CALLS = (WeightChunk, WeightsCall, RpcCall, ProfileCall, LoRACall)
