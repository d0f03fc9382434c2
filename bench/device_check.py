"""The prepared GPU check: the model runtime and the engine on a CUDA device, checked
against transformers on the same device and timed against it, in one run, one table.

`bench/device_check.sh` runs the model's reference tests on the GPU first, then this.
Each section is reported even when another fails; the exit status is 1 if any check
failed.

1. Agreement, per dtype (float32, bfloat16, float16): the engine (one rank, this
   process) answers a fixed set of chat prompts greedily, all at once; transformers,
   on the same device in the same dtype, is teacher-forced on each answer. Reported:
   the fraction of generated positions where transformers' argmax is the engine's
   token, and how many answers equal transformers' own greedy answer (exactly when
   every position agrees). Pass: float32 >= 99% of positions; bfloat16 and float16 >=
   90%. Two correct implementations round differently in reduced precision, so their
   greedy paths part after a near-tie and a few positions disagree; a wrong kernel
   drops agreement towards chance.
2. Speed, in the device's default dtype ("auto"): the engine's end-to-end tokens/s for
   one request and for `--requests` concurrent ones (`--new-tokens` each, EOS
   ignored), against transformers `generate` at batch 1 and batched (left-padded), on
   the same device. Two roofs measured in the same run: the dtype's matmul rate (an
   8192^3 product) and the device-to-device copy rate; a batch-1 step must read every
   weight once, so weight bytes over that rate bound batch-1 decode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch

from wavecore.engine.api import open_engine
from wavecore.engine.cli.demo_prompts import DEMO_PROMPTS
from wavecore.engine.config import EngineConfig
from wavecore.engine.model import default_model_path, resolve_model_source
from wavecore.engine.sampling.tokenizer import Tokenizer
from wavecore.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
PASS_AGREEMENT = {"float32": 0.99, "bfloat16": 0.90, "float16": 0.90}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def chat_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    texts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(count)]
    # As the engine renders chat messages: the template writes the special tokens.
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}]),
            add_special_tokens=False,
        )
        for text in texts
    ]


async def engine_answers(
    config: EngineConfig, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], float]:
    """Every prompt's output token ids (all submitted at once) and the wall seconds."""
    answers: list[list[int]] = [[] for _ in prompts]

    async def one(index: int, engine: Any) -> None:
        async for delta in engine.generate(prompts[index], params):
            answers[index].extend(delta.token_ids)

    async with open_engine(config) as engine:
        async for _ in engine.generate(prompts[0], SamplingParams(max_tokens=2)):
            pass  # warm-up: lazy CUDA set-up is not part of the figure
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for index in range(len(prompts)):
                tg.start_soon(one, index, engine)
        seconds = time.perf_counter() - start
    return answers, seconds


def load_reference(model_path: Path, device: str, dtype: torch.dtype) -> Any:
    import transformers

    # Loaded in float32, then cast: a dense model in `dtype`, whatever the loader's default.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return model.to(device=device, dtype=dtype).eval()


def agreement(
    reference: Any, prompts: list[list[int]], answers: list[list[int]]
) -> tuple[float, int]:
    """(fraction of positions where the reference's argmax is ours, identical answers)."""
    agreeing = positions = identical = 0
    with torch.inference_mode():
        for prompt, ours in zip(prompts, answers, strict=True):
            ids = torch.tensor([prompt + ours[:-1]], device=reference.device)
            choice = reference(ids).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
            matches = sum(a == b for a, b in zip(choice, ours, strict=True))
            agreeing, positions = agreeing + matches, positions + len(ours)
            identical += matches == len(ours)
    return agreeing / positions, identical


def check_dtype(
    model_path: Path, device: str, dtype: str, prompts: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    config = EngineConfig(
        model=str(model_path), device=device, dtype=dtype, max_num_seqs=len(prompts)
    )
    answers, _ = anyio.run(
        engine_answers, config, prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens)
    )
    reference = load_reference(model_path, device, DTYPES[dtype])
    fraction, identical = agreement(reference, prompts, answers)
    del reference
    release(device)
    return {
        "dtype": dtype,
        "positions_agreeing": round(fraction, 4),
        "identical_answers": f"{identical}/{len(prompts)}",
        "passed": fraction >= PASS_AGREEMENT[dtype],
    }


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def seconds_per_call(call: Any, repeats: int, device: str) -> float:
    call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def roofs(device: str, dtype: torch.dtype) -> dict[str, float]:
    size, copied = (8192, 2**30) if device == "cuda" else (512, 2**24)  # CPU: a dry run
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    tflops = 2 * size**3 / seconds_per_call(lambda: a @ b, 10, device) / 1e12
    source = torch.empty(copied, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy = seconds_per_call(lambda: target.copy_(source), 10, device)
    copy_gbps = 2 * source.numel() / copy / 1e9
    return {"matmul_tflops": round(tflops, 1), "copy_gbps": round(copy_gbps, 1)}


def transformers_generate(
    reference: Any, prompts: list[list[int]], new_tokens: int, pad_token_id: int
) -> float:
    device = reference.device
    """Output tokens/s of one batched, left-padded greedy `generate` of every prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = {"do_sample": False, "pad_token_id": pad_token_id, "attention_mask": mask}
    with torch.inference_mode():
        reference.generate(ids, max_new_tokens=2, **kwargs)
        synchronize(device.type)
        start = time.perf_counter()
        reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        synchronize(device.type)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def speed(
    model_path: Path, device: str, prompts: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True
    )
    config = EngineConfig(
        model=str(model_path),
        device=device,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=16384,
        kv_cache_memory=8 * 2**30,
    )
    rows: dict[str, Any] = {}
    for label, batch in (("batch1", prompts[:1]), (f"batch{len(prompts)}", prompts)):
        _, seconds = anyio.run(engine_answers, config, batch, params)
        rows[f"wavecore_{label}_tok_s"] = round(len(batch) * new_tokens / seconds, 1)
    source = resolve_model_source(str(model_path))
    dtype = torch.float32
    if device == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    reference = load_reference(model_path, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    pad = source.eos_token_id if source.eos_token_id is not None else 0
    for label, batch in (("batch1", prompts[:1]), (f"batch{len(prompts)}", prompts)):
        rate = transformers_generate(reference, batch, new_tokens, pad)
        rows[f"transformers_{label}_tok_s"] = round(rate, 1)
    del reference
    release(device)
    limits = roofs(device, dtype)
    # A batch-1 step streams every weight once: this is its step-rate bound.
    rows["batch1_roof_tok_s"] = round(limits["copy_gbps"] * 1e9 / weight_bytes, 1)
    rows["batch1_of_roof"] = round(rows["wavecore_batch1_tok_s"] / rows["batch1_roof_tok_s"], 4)
    for label in ("batch1", f"batch{len(prompts)}"):
        ours, peer = rows[f"wavecore_{label}_tok_s"], rows[f"transformers_{label}_tok_s"]
        rows[f"{label}_vs_transformers"] = round(ours / peer, 2)
    return {"dtype": str(dtype).removeprefix("torch."), **limits, **rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts of the agreement check")
    parser.add_argument("--agreement-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=256, help="concurrent requests, speed")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--output", type=Path, default=RESULTS / "device_check.json")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of the script"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    model_path = (args.model or default_model_path()).resolve()
    tokenizer = Tokenizer.from_source(resolve_model_source(str(model_path)))
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": model_path.name,
        "agreement": [],
    }
    failed = False
    for dtype in ("float32", "bfloat16", "float16"):
        try:
            row = check_dtype(
                model_path,
                args.device,
                dtype,
                chat_prompts(tokenizer, args.prompts),
                args.agreement_tokens,
            )
        except Exception as error:  # one broken dtype must not hide the others' figures
            traceback.print_exc()
            row = {"dtype": dtype, "passed": False, "error": f"{type(error).__name__}: {error}"}
        failed |= not row["passed"]
        results["agreement"].append(row)
        print(json.dumps(row), flush=True)
    try:
        results["speed"] = speed(
            model_path, args.device, chat_prompts(tokenizer, args.requests), args.new_tokens
        )
    except Exception as error:
        traceback.print_exc()
        results["speed"] = {"error": f"{type(error).__name__}: {error}"}
        failed = True
    print_table(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{results['device']}  torch {results['torch']}  CUDA {results['cuda']}")
    print(f"{'dtype':<10} {'agreeing positions':>19} {'identical':>10}  result")
    for row in results["agreement"]:
        share = f"{row['positions_agreeing']:.2%}" if "positions_agreeing" in row else "-"
        verdict = "pass" if row["passed"] else f"FAIL {row.get('error', '')}"
        print(f"{row['dtype']:<10} {share:>19} {row.get('identical_answers', '-'):>10}  {verdict}")
    print()
    for key, value in results["speed"].items():
        print(f"{key:<32} {value}")


if __name__ == "__main__":
    sys.exit(main())
