"""Where the outcome of each prompt goes the moment it is known.

With `--output`, every outcome is one JSON line, written and flushed as it happens, so
a run that stops early (`--fail-fast`, a dead engine, a kill) keeps all it finished.
Lines come in finishing order; each carries the prompt's input position as `index`.
A failure is also one line on stderr.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from rich.console import Console

from wavecore.engine.cli.prompts import PromptJob, UsageError


def print_error(console: Console, command: str, message: str) -> None:
    """One line, whatever its length, taken literally (no markup, emoji or wrapping)."""
    console.print(
        f"wavecore {command}: {message}",
        style="red",
        markup=False,
        emoji=False,
        highlight=False,
        soft_wrap=True,
    )


class OutputError(Exception):
    """The `--output` file cannot be written (a full disk, a device that refuses)."""


@contextmanager
def open_output(path: str | None) -> Iterator[TextIO | None]:
    """The `--output` file, opened before the run so a bad path fails before any work."""
    if path is None:
        yield None
        return
    try:
        sink = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the `with` below
    except OSError as error:
        raise UsageError(f"--output {path}: {error.strerror}") from None
    try:
        with sink:
            yield sink
    except OSError as error:  # closing flushes again what a failed write left
        raise OutputError(f"--output {path}: {error.strerror}") from None


class ResultLog:
    """Records each prompt's outcome: a line in the output file, and for a failure a line
    on stderr too."""

    def __init__(self, sink: TextIO | None, errors: Console) -> None:
        self._sink = sink
        self._errors = errors
        self.finished = 0
        self.failures = 0

    def succeeded(self, job: PromptJob) -> None:
        self.finished += 1
        self._write(job.result())

    def failed(self, index: int, where: str, message: str) -> None:
        self.failures += 1
        line = f"{where}: {message}"
        print_error(self._errors, "generate", line)
        self._write({"index": index, "error": line})

    def _write(self, row: dict[str, Any]) -> None:
        if self._sink is None:
            return
        try:
            self._sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            self._sink.flush()
        except OSError as error:
            raise OutputError(f"--output {self._sink.name}: {error.strerror}") from None
