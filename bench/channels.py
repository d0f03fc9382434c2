"""Channels benchmark: wavecore channels + cbor2 vs pyzmq + msgpack (and msgspec).

Measured in one process over tcp://127.0.0.1, sender and receiver on one event loop /
thread (so both sides share a core):
  (a) request intake: small requests per second, one-way, pipelined (ours batches);
  (b) one engine step's outputs for 256 requests (ids, new token ids, finish reasons),
      encode + send + receive + decode, microseconds per round, in two shapes with the
      same content on every side: `step_round_us` is the columnar `StepOutputs` message
      recommended for the engine (see wavecore.channels), `step_rows_round_us` the
      row-per-request shape (`RowStepOutputs` of `Output`s);
  (c) one 16 MiB float32 tensor, GB/s.
Ours runs twice: plain, and with every frame signed and verified (`frame_signer`), as
the engine's channels are.
Prints a table with ratios and writes bench/results/channels.json. `--quick` for smoke runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgpack
import msgspec
import numpy as np
import torch
import zmq

from wavecore.channels import (
    ChannelKey,
    Codec,
    FrameSigner,
    MessageRegistry,
    open_pull,
    open_push,
)

registry = MessageRegistry()


@registry.register(tag=31500)
@dataclass(frozen=True, slots=True, kw_only=True)
class Submit:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@registry.register(tag=31501)
@dataclass(frozen=True, slots=True, kw_only=True)
class Output:
    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None


@registry.register(tag=31502)
@dataclass(frozen=True, slots=True, kw_only=True)
class RowStepOutputs:
    step: int
    outputs: tuple[Output, ...]


@registry.register(tag=31504)
@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutputs:
    """One step's outputs, columnar: request i owns token_counts[i] tokens of token_ids."""

    step: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    token_counts: tuple[int, ...]
    finish_reasons: tuple[str | None, ...]


@registry.register(tag=31503)
@dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    tensor: torch.Tensor


class SubmitStruct(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


class OutputStruct(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None


class StepOutputsStruct(msgspec.Struct, array_like=True):
    step: int
    request_ids: list[str]
    token_ids: list[int]
    token_counts: list[int]
    finish_reasons: list[str | None]


codec = Codec(registry, max_message_size=64 * 1024 * 1024)
PROMPT = tuple(range(16))


def _row_outputs(step: int) -> RowStepOutputs:
    return RowStepOutputs(
        step=step,
        outputs=tuple(
            Output(
                request_id=f"req-{i:06d}",
                new_token_ids=(step + i,),
                finish_reason="stop" if i % 50 == 0 else None,
            )
            for i in range(256)
        ),
    )


def _outputs(step: int) -> StepOutputs:
    rows = _row_outputs(step).outputs
    return StepOutputs(
        step=step,
        request_ids=tuple(o.request_id for o in rows),
        token_ids=tuple(t for o in rows for t in o.new_token_ids),
        token_counts=tuple(len(o.new_token_ids) for o in rows),
        finish_reasons=tuple(o.finish_reason for o in rows),
    )


async def ours(
    requests: int, steps: int, tensor_rounds: int, *, signed: bool = False
) -> dict[str, float]:
    """`signed`: every frame signed and verified with a channel key, as the engine's are."""
    results: dict[str, float] = {}
    key = ChannelKey.generate()

    def signer() -> FrameSigner | None:
        return key.signer("bench") if signed else None

    async with open_pull(listen="tcp://127.0.0.1:0", codec=codec, signer=signer()) as rx:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_push(dial=rx.address, codec=codec, signer=signer()) as tx:
            await tx.wait_connected()

            async def drain(count: int) -> None:
                for _ in range(count):
                    await rx.receive()

            start = time.perf_counter()
            async with anyio.create_task_group() as group:
                group.start_soon(drain, requests)
                for i in range(requests):
                    await tx.send(
                        Submit(request_id=f"r{i}", prompt_token_ids=PROMPT, max_tokens=64)
                    )
            results["intake_per_s"] = requests / (time.perf_counter() - start)

            for metric, make in (("step_round_us", _outputs), ("step_rows_round_us", _row_outputs)):
                batches = [make(s) for s in range(steps)]
                start = time.perf_counter()
                for batch in batches:
                    await tx.send(batch)
                    await tx.flush()
                    await rx.receive()
                results[metric] = (time.perf_counter() - start) / steps * 1e6

            tensor = torch.randn(4 * 1024 * 1024)
            start = time.perf_counter()
            for _ in range(tensor_rounds):
                await tx.send(Tensor(tensor=tensor))
                await tx.flush()
                await rx.receive()
            results["tensor_gb_s"] = (
                tensor.numel() * 4 * tensor_rounds / (time.perf_counter() - start) / 1e9
            )
            async with anyio.create_task_group() as group:
                group.start_soon(drain_to_end, rx)
                await tx.aclose()
    return results


async def drain_to_end(rx: object) -> None:
    async for _ in rx:  # type: ignore[attr-defined]
        pass


def zmq_peer(requests: int, steps: int, tensor_rounds: int, flavour: str) -> dict[str, float]:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    if flavour == "msgspec":
        enc_submit = msgspec.msgpack.Encoder().encode
        dec_submit = msgspec.msgpack.Decoder(SubmitStruct).decode
        dec_rows = msgspec.msgpack.Decoder(tuple[int, list[OutputStruct]]).decode
        dec_outputs = msgspec.msgpack.Decoder(StepOutputsStruct).decode

        def make_submit(i):
            return SubmitStruct(f"r{i}", list(PROMPT), 64)

        def make_outputs(b):
            return StepOutputsStruct(
                b.step,
                list(b.request_ids),
                list(b.token_ids),
                list(b.token_counts),
                list(b.finish_reasons),
            )

        def make_rows(b):
            return (
                b.step,
                [
                    OutputStruct(o.request_id, list(o.new_token_ids), o.finish_reason)
                    for o in b.outputs
                ],
            )
    else:
        enc_submit = msgpack.packb
        dec_submit = dec_outputs = dec_rows = msgpack.unpackb

        def make_submit(i):
            return [f"r{i}", list(PROMPT), 64]

        def make_outputs(b):
            return [
                b.step,
                list(b.request_ids),
                list(b.token_ids),
                list(b.token_counts),
                list(b.finish_reasons),
            ]

        def make_rows(b):
            return [
                b.step,
                [[o.request_id, list(o.new_token_ids), o.finish_reason] for o in b.outputs],
            ]

    results: dict[str, float] = {}
    chunk = 500  # below zmq's default high-water mark of 1000
    start = time.perf_counter()
    for base in range(0, requests, chunk):
        count = min(chunk, requests - base)
        for i in range(base, base + count):
            push.send(enc_submit(make_submit(i)))
        for _ in range(count):
            dec_submit(pull.recv())
    results["intake_per_s"] = requests / (time.perf_counter() - start)
    for metric, make, encode, decode in (
        ("step_round_us", _outputs, make_outputs, dec_outputs),
        ("step_rows_round_us", _row_outputs, make_rows, dec_rows),
    ):
        batches = [make(s) for s in range(steps)]
        start = time.perf_counter()
        for batch in batches:
            push.send(enc_submit(encode(batch)))
            decode(pull.recv())
        results[metric] = (time.perf_counter() - start) / steps * 1e6
    tensor = torch.randn(4 * 1024 * 1024)
    start = time.perf_counter()
    for _ in range(tensor_rounds):
        array = tensor.numpy()
        push.send(
            msgpack.packb({"dtype": "float32", "shape": list(array.shape), "data": array.tobytes()})
        )
        got = msgpack.unpackb(pull.recv())
        np.frombuffer(got["data"], dtype=got["dtype"]).reshape(got["shape"])
    results["tensor_gb_s"] = (
        tensor.numel() * 4 * tensor_rounds / (time.perf_counter() - start) / 1e9
    )
    push.close(linger=0)
    pull.close(linger=0)
    context.term()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "channels.json"
    )
    args = parser.parse_args()
    requests, steps, tensor_rounds = (2000, 10, 2) if args.quick else (50_000, 200, 10)
    table = {
        "wavecore+cbor2": anyio.run(ours, requests, steps, tensor_rounds, backend="asyncio"),
        "wavecore signed": anyio.run(
            functools.partial(ours, signed=True), requests, steps, tensor_rounds, backend="asyncio"
        ),
        "zmq+msgpack": zmq_peer(requests, steps, tensor_rounds, "msgpack"),
        "zmq+msgspec": zmq_peer(requests, steps, tensor_rounds, "msgspec"),
    }
    peer = table["zmq+msgpack"]
    ours_plain = table["wavecore+cbor2"]
    print(
        f"{'metric':<16}"
        + "".join(f"{name:>18}" for name in table)
        + f"{'ours/zmq+msgpack':>20}{'signed/unsigned':>18}"
    )
    for metric, unit in (
        ("intake_per_s", "req/s"),
        ("step_round_us", "us"),
        ("step_rows_round_us", "us"),
        ("tensor_gb_s", "GB/s"),
    ):
        row = "".join(f"{values[metric]:>18.3f}" for values in table.values())
        ratio = ours_plain[metric] / peer[metric]
        signed_ratio = table["wavecore signed"][metric] / ours_plain[metric]
        print(f"{metric + ' (' + unit + ')':<16}{row}{ratio:>20.2f}{signed_ratio:>18.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "quick": args.quick,
        "requests": requests,
        "steps": steps,
        "tensor_rounds": tensor_rounds,
        "results": table,
    }
    args.output.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
