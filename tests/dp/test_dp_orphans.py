"""An embedding program that is SIGKILLed runs no `finally`: its coordinator and ranks
must notice by themselves that it is gone, end, and leave no ipc directory behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

import anyio
import pytest
from dp_helpers import HANG_GUARD

pytestmark = pytest.mark.anyio

# Prints its engine's child processes and ipc directory, then serves until killed.
EMBEDDING_PROGRAM = """
import json
import sys

import anyio

from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig


async def main(dp_mode: str) -> None:
    config = EngineConfig(
        executor="null", dp_size=2, dp_mode=dp_mode, max_num_seqs=8, startup_timeout=60.0
    )
    async with open_engine(config) as engine:
        wiring = engine.core_client.wiring
        pids = [process.pid for process in wiring.processes.values()]
        print(json.dumps({"pids": pids, "ipc_directory": wiring.ipc_directory}), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
"""


def start_program(script: Path, dp_mode: str, stderr: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(script), dp_mode], stdout=subprocess.PIPE, stderr=stderr
    )


def first_line(program: subprocess.Popen[bytes]) -> bytes:
    """The program's first line (blocking); its stdout is closed after it."""
    assert program.stdout is not None
    with program.stdout:
        return program.stdout.readline()


def kill(program: subprocess.Popen[bytes]) -> None:
    program.kill()  # SIGKILL: nothing of the program's own runs any more
    program.wait()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on pidfds (Linux)")
@pytest.mark.parametrize("dp_mode", ["lockstep", "independent"])
async def test_killing_the_embedding_program_ends_its_processes_and_removes_the_ipc_directory(
    tmp_path: Path, dp_mode: str
) -> None:
    script = tmp_path / "embedding_program.py"
    script.write_text(EMBEDDING_PROGRAM)
    errors = tmp_path / "stderr.txt"
    with errors.open("wb") as stderr:
        program = start_program(script, dp_mode, stderr)
    pidfds: dict[int, int] = {}
    try:
        try:
            with anyio.fail_after(HANG_GUARD):
                line = await anyio.to_thread.run_sync(first_line, program, abandon_on_cancel=True)
            assert line, f"the program ended before its engine started:\n{errors.read_text()}"
            started = json.loads(line)
            directory = anyio.Path(started["ipc_directory"])
            assert await directory.is_dir()
            # Opened while they surely run: a pidfd is readable once its process has ended
            # (these are not our children, so there is no waitpid), and it never refers
            # to a later process that reuses the number.
            pidfds = {pid: os.pidfd_open(pid) for pid in started["pids"]}
            assert len(pidfds) == 3  # the coordinator and two ranks
        finally:
            kill(program)
        ended: list[int] = []
        with anyio.move_on_after(HANG_GUARD):
            for pid, pidfd in pidfds.items():
                await anyio.wait_readable(pidfd)
                ended.append(pid)
        still_running = sorted(set(pidfds) - set(ended))
        assert not still_running, f"running after the embedding program died: {still_running}"
        assert not await directory.exists()
    finally:
        for pidfd in pidfds.values():
            os.close(pidfd)
