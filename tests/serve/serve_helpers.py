"""Shared helpers of the server tests: `wavecore serve` in a subprocess on a free port,
OpenAI-style error bodies, and waiting for requests a paused engine holds."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import anyio
import httpx

# Hang guards only: every wait below normally ends in well under a second.
STARTUP_GUARD = 120.0
EXIT_GUARD = 60.0


@dataclass
class ServerProcess:
    """A running `wavecore serve`; `lines` collects its stdout, line by line (all of
    it once the process has exited and `stderr()` was read)."""

    process: subprocess.Popen[str]
    url: str = ""
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)
    _reader: threading.Thread = field(init=False)
    _err: str | None = None

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        command = [sys.executable, "-m", "wavecore.engine.cli.main", "serve", "--port", "0"]
        process = subprocess.Popen(
            [*command, *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        server = cls(process)
        address = server.wait_for("serving on ")
        server.url = address.removeprefix("serving on ").strip()
        server.wait_for("ready: ")
        return server

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, prefix: str) -> str:
        """The next stdout line that starts with `prefix` (the lines before are kept)."""
        while True:
            try:
                line = self._queue.get(timeout=STARTUP_GUARD)
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line; stdout so far: {self.lines}") from None
            if line is None:
                raise AssertionError(
                    f"the server exited before printing {prefix!r}: {self.lines}, "
                    f"stderr: {self.stderr()}"
                )
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def stderr(self) -> str:
        """What the server wrote on stderr, once it has exited (its pipes then closed)."""
        if self.process.poll() is None:
            return "(still running)"
        if self._err is None:
            assert self.process.stderr is not None and self.process.stdout is not None
            self._reader.join(timeout=EXIT_GUARD)
            while (line := self._queue.get_nowait()) is not None:
                self.lines.append(line)
            self._err = self.process.stderr.read()
            self.process.stderr.close()
            self.process.stdout.close()
        return self._err

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=EXIT_GUARD, **kwargs)  # type: ignore[arg-type]

    def terminate(self) -> tuple[int, str]:
        """SIGTERM, then the exit status and stderr."""
        self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(timeout=EXIT_GUARD)
        return status, self.stderr()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=EXIT_GUARD)
        self.stderr()


def serve(*flags: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A fixture body: the server for the fixture's scope, SIGTERMed (exit 0) after."""
    server = ServerProcess.start(*flags, env=env)
    try:
        yield server
    except BaseException:
        server.kill()
        raise
    status, err = server.terminate()
    assert status == 0, err


NULL_FLAGS: Sequence[str] = ("--executor", "null", "--max-num-seqs", "8")


def error_of(response: httpx.Response, status: int) -> dict[str, object]:
    """The OpenAI-style error body of `response`, which must have `status`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


async def wait_held(client: httpx.AsyncClient, count: int) -> None:
    """Until `count` requests are held by the paused engine (admin /stats)."""
    with anyio.fail_after(EXIT_GUARD):
        # The condition lives in another process: polled, under the hang guard above.
        while len((await client.get("/stats")).json()["held"]) != count:  # noqa: ASYNC110
            await anyio.sleep(0.01)
