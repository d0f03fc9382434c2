"""The key an engine's channels are signed with, and each channel's name.

Theory of operation:

1. Every frame between the front end, the coordinator and the ranks is signed with the
   engine's `ChannelKey` (`wavecore.channels.frame_signer`): a process that can reach
   a socket but lacks the key cannot inject, forge, splice or replay anything.
2. Where it comes from (`engine_channel_key`): `EngineConfig.channel_key_file` (a hex
   file, e.g. `openssl rand -hex 32`), else the environment variable
   `WAVECORE_CHANNEL_KEY` (hex), else a fresh random key per engine. Local ranks and
   the coordinator get it through the spawn (multiprocessing's pipe, never argv).
   Headless ranks (`wavecore rank`) must be given the same file or variable as the
   front end: with no key given, a front end expecting them refuses to start, and so
   does a headless rank, saying so.
3. Both ends of a channel name it alike, so that each channel has its own derived key:
   a frame recorded on one channel is refused on every other. A rank's input is named
   by a random id the rank gives in its hello (`RankHello.input_channel`).
4. A rank's input listens in the rank and the front end dials it, at the address the
   rank's (signed) hello gives: had the front end listened, whoever connected to that
   socket would have been handed a share of the rank's requests.
"""

from __future__ import annotations

import os

from wavecore.channels import KEY_ENVIRONMENT, ChannelKey
from wavecore.engine.config import EngineConfig

RANK_HANDSHAKE = "rank handshake"
COORDINATOR_HANDSHAKE = "coordinator handshake"
RANK_OUTPUTS = "rank outputs"
COORDINATOR_INPUT = "coordinator input"
COORDINATOR_PUBLISH = "coordinator publish"

_NEEDS_KEY = (
    "headless ranks need the engine's channel key: give the same channel_key_file "
    f"(--channel-key-file; hex, e.g. `openssl rand -hex 32`) or ${KEY_ENVIRONMENT} to the "
    "front end and to every `wavecore rank`"
)


def rank_input(channel: str) -> str:
    return f"rank input {channel}"


def engine_channel_key(config: EngineConfig, *, headless: bool) -> ChannelKey:
    """Rule 2: the key of this engine's channels; `headless` when some rank starts
    elsewhere (or this is one). Raises ValueError naming what is wrong."""
    if config.channel_key_file is not None:
        return ChannelKey.load(config.channel_key_file)
    text = os.environ.get(KEY_ENVIRONMENT)
    if text:
        return ChannelKey.from_hex(text, source=f"${KEY_ENVIRONMENT}")
    if headless:
        raise ValueError(_NEEDS_KEY)
    return ChannelKey.generate()
