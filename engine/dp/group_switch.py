"""A rank's side of a scale's commit: join the new DP group and agree on the wave.

Every rank of the new group (staying and new ones) builds a gloo group under the new
store prefix (one per reconfiguration, so the old and new groups never share keys) and
runs one MAX all-reduce of `[running, wave, step_counter]` on it: the result is what
`RankMachine`'s `Reconfigured` takes, so every member meets the next vote in lockstep.
Blocking; the rank loop runs it on its model thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from wavecore.channels import ChannelKey
from wavecore.engine.dp.collective import DPGroup
from wavecore.engine.dp.signed_store import open_group_store


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupAgreement:
    running: bool
    wave: int
    step_counter: int


def join_and_agree(
    *,
    host: str,
    port: int,
    prefix: str,
    rank: int,
    size: int,
    timeout_s: float,
    running: bool,
    wave: int,
    step_counter: int,
    key: ChannelKey,
) -> tuple[DPGroup, GroupAgreement]:
    timeout = timedelta(seconds=timeout_s)
    store = open_group_store(host, port, size=size, timeout=timeout, key=key)
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    tensor = torch.tensor([int(running), wave, step_counter], dtype=torch.int64)
    group.allreduce([tensor], options).wait()
    agreed_running, agreed_wave, agreed_step = tensor.tolist()
    agreement = GroupAgreement(
        running=bool(agreed_running), wave=agreed_wave, step_counter=agreed_step
    )
    return DPGroup(group, rank, size, timeout_s=timeout_s), agreement
