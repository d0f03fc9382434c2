"""`wavecore generate`: prompt sources, JSONL output in input order, clear usage errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from wavecore.engine.cli.main import UsageError, build_parser, load_jobs, main


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(args)
    return status, capsys.readouterr().out


def test_jsonl_output_has_one_object_per_prompt_in_input_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "first plain line\n"
        + json.dumps({"prompt": "second", "max_tokens": 3})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "third"}]})
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    status, printed = run_cli(
        [
            "generate",
            "--executor",
            "null",
            "--prompts-file",
            str(prompts),
            "--max-tokens",
            "5",
            "--output",
            str(output),
        ],
        capsys,
    )
    assert status == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
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


def test_bad_prompt_lines_are_reported_with_their_place(tmp_path: Path) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text("fine\n" + json.dumps({"prompt": "x", "temperature": -2}) + "\n")
    args = build_parser().parse_args(["generate", "--prompts-file", str(prompts)])
    with pytest.raises(UsageError, match=r"bad.jsonl:2: .*temperature"):
        load_jobs(args, io.StringIO())
    prompts.write_text(json.dumps({"prompt": "x", "colour": "red"}) + "\n")
    with pytest.raises(UsageError, match=r"bad.jsonl:1: unknown field\(s\) \['colour'\]"):
        load_jobs(args, io.StringIO())


def test_no_prompts_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["generate"])
    stdin = io.StringIO("")
    stdin.isatty = lambda: True  # type: ignore[method-assign]
    with pytest.raises(UsageError, match="no prompts"):
        load_jobs(args, stdin)
    status, printed = run_cli(
        ["generate", "--executor", "null", "--prompt", "x", "--top-p", "0"], capsys
    )
    assert status == 2
    assert "top_p" in printed


def test_prompts_come_from_stdin_when_none_are_given() -> None:
    args = build_parser().parse_args(["generate", "--chat"])
    jobs = load_jobs(args, io.StringIO("one\n\ntwo\n"))
    assert [job.prompt for job in jobs] == [
        [{"role": "user", "content": "one"}],
        [{"role": "user", "content": "two"}],
    ]
