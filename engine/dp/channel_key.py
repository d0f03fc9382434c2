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
5. With TLS files in the config (`tls_cert_file`, ...), the key carries them
   (`ChannelKey.with_tls`) and every tcp channel runs over TLS (`channels/tls.py`);
   spawned processes get them with the key, headless ranks from their own flags.
"""

from __future__ import annotations

import os

from wavecore.channels import KEY_ENVIRONMENT, ChannelKey, ChannelTLS
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
    """Rules 2 and 5: the key of this engine's channels, with its TLS files if any;
    `headless` when some rank starts elsewhere (or this is one). Raises ValueError naming
    what is wrong."""
    return _shared_key(config, headless=headless).with_tls(_tls(config))


def _shared_key(config: EngineConfig, *, headless: bool) -> ChannelKey:
    if config.channel_key_file is not None:
        return ChannelKey.load(config.channel_key_file)
    text = os.environ.get(KEY_ENVIRONMENT)
    if text:
        return ChannelKey.from_hex(text, source=f"${KEY_ENVIRONMENT}")
    if headless:
        raise ValueError(_NEEDS_KEY)
    return ChannelKey.generate()


def _tls(config: EngineConfig) -> ChannelTLS | None:
    if config.tls_cert_file is None or config.tls_key_file is None or config.tls_ca_file is None:
        return None  # EngineConfig has all three or none
    return ChannelTLS.load(
        config.tls_cert_file,
        config.tls_key_file,
        config.tls_ca_file,
        server_name=config.tls_server_name,
    )
