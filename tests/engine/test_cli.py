"""`wavecore generate`: prompt sources, JSONL output written as each result finishes (with
its input index), one-line errors on stderr, and a run that keeps its finished work when a
prompt is bad or the engine dies."""

from __future__ import annotations

import io
import json
import multiprocessing
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from wavecore.engine.api import open_engine
from wavecore.engine.cli import main as cli_main
from wavecore.engine.cli.main import build_parser, main
from wavecore.engine.cli.prompts import UsageError, load_inputs
from wavecore.engine.cli.results import OutputError
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.interface import Engine
from wavecore.engine.outputs import CompletionDelta
from wavecore.engine.sampling_params import SamplingParams

# The null engine's context is 8192 tokens, and its tokenizer gives one token per byte.
TOO_LONG = "x" * 9000


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(args)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def generate_args(*more: str) -> list[str]:
    return ["generate", "--executor", "null", "--max-tokens", "5", *more]


def rows_by_index(output: Path) -> list[dict[str, Any]]:
    """The output file's rows in input order (they are written in finishing order)."""
    rows = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    return sorted(rows, key=lambda row: row["index"])


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_jsonl_output_has_one_object_per_prompt_with_its_input_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "first plain line\n"
        + json.dumps({"prompt": "second", "max_tokens": 3})
        + "\n\n"  # a blank line is not a prompt, and takes no index
        + json.dumps({"messages": [{"role": "user", "content": "third"}]})
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    status, printed, err = run_cli(
        generate_args("--prompts-file", str(prompts), "--output", str(output)), capsys
    )
    assert status == 0
    assert err == ""
    rows = rows_by_index(output)
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert [row["prompt"] for row in rows] == [
        "first plain line",
        "second",
        [{"role": "user", "content": "third"}],
    ]
    assert [row["output_tokens"] for row in rows] == [5, 3, 5]
    assert all(row["finish_reason"] == "length" for row in rows)
    assert all(len(row["token_ids"]) == row["output_tokens"] for row in rows)
    assert rows[0]["prompt_tokens"] == len(b"first plain line")
    assert "output tokens/s" in printed


def test_help_says_output_lines_come_as_they_finish_with_their_index(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "as soon as it finishes" in printed
    assert '"index" is the prompt\'s position in the input' in printed
    assert "--fail-fast" in printed


def test_a_prompt_too_long_for_the_model_fails_alone_and_the_others_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"one\n{TOO_LONG}\nthree\n")
    output = tmp_path / "out.jsonl"
    status, printed, err = run_cli(
        generate_args("--prompts-file", str(prompts), "--output", str(output)), capsys
    )
    assert status == 1
    [line] = error_lines(err)
    assert line.startswith(f"wavecore generate: {prompts}:2: ")
    assert "9000 tokens" in line
    rows = rows_by_index(output)
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert rows[1] == {"index": 1, "error": line.removeprefix("wavecore generate: ")}
    assert [rows[0]["prompt"], rows[2]["prompt"]] == ["one", "three"]
    assert rows[0]["finish_reason"] == rows[2]["finish_reason"] == "length"
    assert "Traceback" not in printed + err
    assert "output tokens/s" in printed


def test_fail_fast_stops_at_the_first_prompt_the_engine_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{TOO_LONG}\ntwo\n{TOO_LONG}\nfour\n")
    output = tmp_path / "out.jsonl"
    status, printed, err = run_cli(
        generate_args("--prompts-file", str(prompts), "--output", str(output), "--fail-fast"),
        capsys,
    )
    assert status == 1
    [line] = error_lines(err)
    assert line.startswith(f"wavecore generate: {prompts}:1: ")
    # The first prompt is refused before any other starts: nothing else runs.
    assert rows_by_index(output) == [
        {"index": 0, "error": line.removeprefix("wavecore generate: ")}
    ]
    assert "Traceback" not in printed + err


def test_fail_fast_on_an_unreadable_line_starts_no_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('good\n{"prompt": "x"\nalso good\n')
    output = tmp_path / "out.jsonl"
    status, printed, err = run_cli(
        generate_args("--prompts-file", str(prompts), "--output", str(output), "--fail-fast"),
        capsys,
    )
    assert status == 1
    expected = f"{prompts}:2: not valid JSON (Expecting ',' delimiter at column 15)"
    assert error_lines(err) == [f"wavecore generate: {expected}"]
    assert rows_by_index(output) == [{"index": 1, "error": expected}]
    assert "output tokens/s" not in printed


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param(
            '{"prompt": 5}',
            "prompt must be a string, got 5",
            id="non-string-prompt",
        ),
        pytest.param(
            '{"prompt": "x"',
            "not valid JSON (Expecting ',' delimiter at column 15)",
            id="bad-json",
        ),
        pytest.param(
            '{"messages": [{"role": "user"}]}',
            "messages must be a non-empty list of objects with string 'role' and 'content', "
            'got [{"role": "user"}]',
            id="message-without-content",
        ),
        pytest.param(
            '{"prompt": "x", "max_tokens": "many"}',
            "SamplingParams.max_tokens must be an int, got str",
            id="bad-sampling-field",
        ),
        pytest.param(
            '{"prompt": "x", "colour": "red"}',
            "unknown field(s) ['colour']",
            id="unknown-field",
        ),
    ],
)
def test_a_bad_jsonl_line_is_one_stderr_line_and_an_error_row(
    line: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(f"first\n{json.dumps({'prompt': 'second'})}\n{line}\nfourth\n")
    output = tmp_path / "out.jsonl"
    status, printed, err = run_cli(
        generate_args("--prompts-file", str(prompts), "--output", str(output)), capsys
    )
    assert status == 1
    assert error_lines(err) == [f"wavecore generate: {prompts}:3: {message}"]
    rows = rows_by_index(output)
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert rows[2] == {"index": 2, "error": f"{prompts}:3: {message}"}
    assert [rows[i]["prompt"] for i in (0, 1, 3)] == ["first", "second", "fourth"]
    assert "Traceback" not in printed + err


def test_a_line_that_is_not_utf8_fails_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"caf\xc3\xa9\nLatin-1 caf\xe9\nlast\n")
    output = tmp_path / "out.jsonl"
    status, printed, err = run_cli(
        generate_args("--prompts-file", str(prompts), "--output", str(output)), capsys
    )
    assert status == 1
    message = f"{prompts}:2: not valid UTF-8 (byte 12 of the line is 0xe9)"
    assert error_lines(err) == [f"wavecore generate: {message}"]
    rows = rows_by_index(output)
    assert rows[1] == {"index": 1, "error": message}
    assert [rows[0]["prompt"], rows[2]["prompt"]] == ["café", "last"]
    assert "Traceback" not in printed + err


class DiesAfterTheOthers:
    """A real engine that dies on the prompt "die" once every other prompt has finished,
    so which results finished before the death is known."""

    def __init__(self, engine: Engine, others: int) -> None:
        self._engine = engine
        self._others_left = others
        self._others_done = anyio.Event()

    async def generate(
        self, prompt: Any, params: SamplingParams, lora: str | None = None
    ) -> AsyncIterator[CompletionDelta]:
        if prompt == "die":
            await self._others_done.wait()
            raise EngineDeadError("rank 0 failed: out of memory")
        async for delta in self._engine.generate(prompt, params, lora=lora):
            yield delta
        self._others_left -= 1
        if not self._others_left:
            self._others_done.set()


def test_an_engine_death_ends_the_run_and_keeps_the_finished_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    @asynccontextmanager
    async def dying_engine(_args: object, config: EngineConfig) -> AsyncIterator[Any]:
        async with open_engine(config) as engine:
            yield DiesAfterTheOthers(engine, others=2)

    monkeypatch.setattr(cli_main, "_open_engine", dying_engine)
    output = tmp_path / "out.jsonl"
    args = ["--prompt", "die", "--prompt", "a", "--prompt", "b", "--output", str(output)]
    status, printed, err = run_cli(generate_args(*args), capsys)
    assert status == 1
    assert error_lines(err) == [
        "wavecore generate: the engine died (rank 0 failed: out of memory): "
        f"2 of 3 prompts finished; their results are in {output}"
    ]
    rows = rows_by_index(output)
    assert [(row["index"], row["prompt"]) for row in rows] == [(1, "a"), (2, "b")]
    assert "Traceback" not in printed + err


def test_bad_prompt_lines_are_rejected_with_their_place_before_any_engine(
    tmp_path: Path,
) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(
        "fine\n"
        + json.dumps({"prompt": "x", "temperature": -2})
        + "\n"
        + json.dumps({"prompt": "x", "colour": "red"})
        + "\n"
    )
    args = build_parser().parse_args(["generate", "--prompts-file", str(prompts)])
    inputs = load_inputs(args, io.StringIO())
    assert [(job.index, job.where, job.prompt) for job in inputs.jobs] == [
        (0, f"{prompts}:1", "fine")
    ]
    assert [(bad.index, bad.where) for bad in inputs.rejected] == [
        (1, f"{prompts}:2"),
        (2, f"{prompts}:3"),
    ]
    assert "temperature" in inputs.rejected[0].message
    assert inputs.rejected[1].message == "unknown field(s) ['colour']"


def test_usage_errors_are_one_line_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["generate"])
    stdin = io.StringIO("")
    stdin.isatty = lambda: True  # type: ignore[method-assign]
    with pytest.raises(UsageError, match="no prompts"):
        load_inputs(args, stdin)
    status, printed, err = run_cli(generate_args("--prompt", "x", "--top-p", "0"), capsys)
    assert status == 2
    assert printed == ""
    [line] = error_lines(err)
    assert line.startswith("wavecore generate: ") and "top_p" in line
    missing = tmp_path / "no-such-dir" / "out.jsonl"
    status, printed, err = run_cli(generate_args("--prompt", "x", "--output", str(missing)), capsys)
    assert status == 2
    assert error_lines(err) == [f"wavecore generate: --output {missing}: No such file or directory"]


def test_prompts_come_from_stdin_when_none_are_given() -> None:
    args = build_parser().parse_args(["generate", "--chat"])
    inputs = load_inputs(args, io.StringIO("one\n\ntwo\n"))
    assert [job.prompt for job in inputs.jobs] == [
        [{"role": "user", "content": "one"}],
        [{"role": "user", "content": "two"}],
    ]
    assert [job.where for job in inputs.jobs] == ["stdin:1", "stdin:3"]


def test_a_stdin_line_that_is_not_utf8_is_rejected_alone() -> None:
    args = build_parser().parse_args(["generate"])
    stdin = io.TextIOWrapper(io.BytesIO(b"one\n\xff two\nthree\n"), encoding="utf-8")
    inputs = load_inputs(args, stdin)
    assert [job.prompt for job in inputs.jobs] == ["one", "three"]
    assert [(bad.index, bad.where, bad.message) for bad in inputs.rejected] == [
        (1, "stdin:2", "not valid UTF-8 (byte 1 of the line is 0xff)")
    ]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_weights_and_dtype_flags_reach_the_engine_configuration(command: str) -> None:
    from wavecore.engine.cli.main import _engine_config

    args = build_parser().parse_args(
        [command, "--executor", "null", "--weights", "int8", "--dtype", "float32"]
    )
    assert (_engine_config(args).weights, _engine_config(args).dtype) == ("int8", "float32")
    default = _engine_config(build_parser().parse_args([command]))
    assert (default.weights, default.dtype) == ("auto", "auto")
    assert default.kv_cache_dtype == "auto"
    told = build_parser().parse_args([command, "--executor", "null", "--kv-cache-dtype", "float32"])
    assert _engine_config(told).kv_cache_dtype == "float32"
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--kv-cache-dtype", "fp8"])
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--weights", "int4"])
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--dtype", "float64"])


def test_the_summary_names_the_kernel_each_shape_class_ran() -> None:
    from rich.console import Console

    from wavecore.engine.cli.latency import RunSummary
    from wavecore.engine.cli.main import summary_table

    summary = RunSummary.of([], prompt_tokens=0, output_tokens=0, seconds=1.0)
    kernels = {
        "cpu": "a CPU",
        "decode": "fbgemm",
        "small": "onednn-bf16",
        "large": "onednn-bf16",
        "prefill": "blas",
        "origin": "cached",
        "kv_cache": "bfloat16",
    }
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(summary, (), kernels))
    assert (
        "decode fbgemm, small onednn-bf16, large onednn-bf16, prefill blas (cached)"
        in out.getvalue()
    )
    assert re.search(r"KV cache\s+.\s+bfloat16", out.getvalue())
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(summary))  # the null executor: none
    assert "kernels" not in out.getvalue()


@pytest.mark.parametrize("command", ["generate", "serve", "rank"])
def test_flags_every_rank_shares_reach_the_engine_configuration(command: str) -> None:
    from wavecore.engine.cli.main import _engine_config

    rank_args = ["--dp-rank", "0", "--dp-size", "2", "--master", "h:1"] if command == "rank" else []
    shared = ["--on-rank-failure", "shrink", "--async-scheduling", "--log-iteration-details"]
    args = build_parser().parse_args([command, *rank_args, "--executor", "null", *shared])
    config = _engine_config(args)
    assert (config.on_rank_failure, config.async_scheduling) == ("shrink", True)
    assert config.log_iteration_details
    default = _engine_config(build_parser().parse_args([command, *rank_args]))
    assert (default.on_rank_failure, default.async_scheduling) == ("fail", False)
    assert not default.log_iteration_details


def test_structured_output_flags_and_per_line_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--regex` (or `--choice`, `--json-schema`) constrains every prompt; a line's own
    `structured_outputs` object overrides it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "a plain line\n"
        + json.dumps({"prompt": "pick", "structured_outputs": {"choice": ["left", "right"]}})
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    status, _, err = run_cli(
        [
            "generate", "--executor", "null", "--max-tokens", "40", "--regex", "[0-9]{3}-[a-z]{2}",
            "--prompts-file", str(prompts), "--output", str(output),
        ],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    plain, pick = rows_by_index(output)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", plain["text"]) and plain["finish_reason"] == "stop"
    assert pick["text"] in ("left", "right")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"enum": ["on", "off"]}))
    status, printed, err = run_cli(
        generate_args("--prompt", "x", "--json-schema", str(schema)), capsys
    )
    assert status == 0 and ('"on"' in printed or '"off"' in printed), err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--regex", "(open"), "structured_outputs.regex: "),
        (("--choice", ","), "choice must be a non-empty list"),
        (("--json-schema", "/no/such/schema.json"), "--json-schema /no/such/schema.json: No such"),
    ],
)
def test_a_bad_structured_output_flag_is_one_line_before_any_engine(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, printed, err = run_cli(generate_args("--prompt", "x", *flags), capsys)
    assert status == 2 and printed == ""
    [line] = error_lines(err)
    assert line.startswith("wavecore generate: ") and message in line


# -- every failure in one line, with its exit code ----------------------------------------


def test_an_output_that_cannot_be_written_is_one_line_and_exit_4(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, printed, err = run_cli(generate_args("--prompt", "x", "--output", "/dev/full"), capsys)
    assert status == 4
    assert error_lines(err) == [
        "wavecore generate: --output /dev/full: No space left on device "
        "(--debug shows the traceback)"
    ]
    assert "Traceback" not in printed + err


def test_debug_shows_the_failure_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(OutputError, match="No space left on device"):
        main(["--debug", *generate_args("--prompt", "x", "--output", "/dev/full")])
    with pytest.raises(OutputError, match="No space left on device"):
        main([*generate_args("--prompt", "x", "--output", "/dev/full"), "--debug"])


def test_a_model_that_is_no_model_is_one_line_and_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a model\n")
    status, printed, err = run_cli(["generate", "--model", str(text), "--prompt", "x"], capsys)
    assert status == 4
    [line] = error_lines(err)
    assert line.startswith(f"wavecore generate: {text}: not a GGUF file")
    assert "Traceback" not in printed + err


def test_dp_beyond_the_machine_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, _printed, err = run_cli(generate_args("--prompt", "x", "--dp", "100000"), capsys)
    assert status == 2
    [line] = error_lines(err)
    assert line.startswith("wavecore generate: --dp 100000 refused: at most ")
    assert multiprocessing.active_children() == []


class InterruptedAfterTheOthers:
    """A real engine where the prompt "wait" waits until every other prompt finished, then
    the user presses Ctrl-C (SIGINT to this process)."""

    def __init__(self, engine: Engine, others: int) -> None:
        self._engine = engine
        self._others_left = others
        self._others_done = anyio.Event()

    async def generate(
        self, prompt: Any, params: SamplingParams, lora: str | None = None
    ) -> AsyncIterator[CompletionDelta]:
        if prompt == "wait":
            await self._others_done.wait()
            signal.raise_signal(signal.SIGINT)
            await anyio.sleep_forever()
        async for delta in self._engine.generate(prompt, params, lora=lora):
            yield delta
        self._others_left -= 1
        if not self._others_left:
            self._others_done.set()


@pytest.mark.parametrize("to_file", [True, False])
def test_ctrl_c_keeps_the_finished_results_and_exits_130(
    to_file: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @asynccontextmanager
    async def interrupted_engine(_args: object, config: EngineConfig) -> AsyncIterator[Any]:
        async with open_engine(config) as engine:
            yield InterruptedAfterTheOthers(engine, others=2)

    monkeypatch.setattr(cli_main, "_open_engine", interrupted_engine)
    output = tmp_path / "out.jsonl"
    args = ["--prompt", "wait", "--prompt", "a", "--prompt", "b"]
    args += ["--output", str(output)] if to_file else []
    # Python's own Ctrl-C handler, as a terminal's run has it: a shell starts background
    # jobs (`make test &`, nohup) with SIGINT ignored, and then no Ctrl-C arrives.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status, printed, err = run_cli(generate_args(*args), capsys)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == 130
    kept = f"; their results are in {output}" if to_file else ""
    assert error_lines(err) == [f"wavecore generate: interrupted: 2 of 3 prompts finished{kept}"]
    if to_file:
        rows = rows_by_index(output)
        assert [(row["index"], row["prompt"]) for row in rows] == [(1, "a"), (2, "b")]
    else:
        assert "2. a" in printed and "3. b" in printed and "1. wait" not in printed
    assert "Traceback" not in printed + err
