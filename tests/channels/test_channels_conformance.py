"""The conformance suite over inproc, ipc and tcp, on asyncio and trio."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from wavecore.channels import Codec, open_pull, open_push
from wavecore.channels.testing import check_channel_pair

pytestmark = pytest.mark.anyio
_names = itertools.count()


def _addresses(transport: str, tmp_path: Path) -> str:
    if transport == "inproc":
        return f"inproc://conformance-{next(_names)}"
    if transport == "ipc":
        return f"ipc://{tmp_path}/c{next(_names)}.ipc"
    return "tcp://127.0.0.1:0"


@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
@pytest.mark.parametrize("listener", ["pull", "push"])
async def test_push_pull_conformance(transport: str, listener: str, tmp_path: Path) -> None:
    @asynccontextmanager
    async def push_pull(codec: Codec) -> AsyncIterator[tuple[object, object]]:
        address = _addresses(transport, tmp_path)
        if listener == "pull":
            async with open_pull(listen=address, codec=codec) as rx:  # noqa: SIM117 - the inner channel dials the outer one's address
                async with open_push(dial=rx.address, codec=codec) as tx:
                    yield tx, rx
        else:
            async with open_push(listen=address, codec=codec) as tx:  # noqa: SIM117 - the inner channel dials the outer one's address
                async with open_pull(dial=tx.address, codec=codec) as rx:
                    yield tx, rx

    await check_channel_pair(push_pull)
    assert not [p async for p in anyio.Path(tmp_path).glob("*.ipc")], "ipc files left behind"
