"""TLS on the tcp channels (`channels/tls.py`): dp 2 over `tls+tcp`, one rank spawned
and one headless (`wavecore rank --tls-*`), serves exactly, and its sockets speak TLS
only; a peer whose certificate the CA did not sign cannot connect; missing or bad
files are refused, named. Certificates come from the `openssl` command (skipped
without it)."""

from __future__ import annotations

import pickle
import shutil
import socket
import subprocess
from pathlib import Path

import anyio
import pynng
import pytest
from anyio.abc import Process
from dp_helpers import (
    HANG_GUARD,
    collect,
    expected_tokens,
    headless_rank_is_refused,
    start_headless_rank,
    tokens_of,
)

from wavecore.channels import (
    KEY_ENVIRONMENT,
    ChannelKey,
    ChannelTLS,
    Hello,
    open_pull,
    open_push,
)
from wavecore.engine.api import open_dp_engine
from wavecore.engine.cli.main import main
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams

OPENSSL = shutil.which("openssl")
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command"),
]
_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem signs node.pem (for 127.0.0.1); stranger-ca.pem signs stranger.pem."""
    directory = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run([str(OPENSSL), *args], cwd=directory, check=True, capture_output=True)

    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ca in (("node", "ca"), ("stranger", "stranger-ca")):
        openssl(
            "req", "-x509", *_EC, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-subj", "/CN=ca"
        )
        openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=x")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-extfile", "san.ext",
        )  # fmt: skip
    return directory


def tls_of(certs: Path, name: str = "node", ca: str = "ca") -> ChannelTLS:
    return ChannelTLS.load(f"{certs}/{name}.pem", f"{certs}/{name}.key", f"{certs}/{ca}.pem")


def speaks_tls_only(address: str) -> bool:
    """Whether a listener at `address` (tcp://host:port) answers a plain nng peer's
    greeting as a TLS server does (an alert, or closing), not with nng's own greeting."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD) as plain:
        plain.sendall(b"\x00SP\x00\x00\x70\x00\x00")  # nng's header for a PUSH peer
        try:
            answer = plain.recv(8)
        except ConnectionResetError:
            return True  # refused outright
    return not answer.startswith(b"\x00SP")


async def test_a_tcp_channel_under_tls_takes_only_peers_the_ca_signed(certs: Path) -> None:
    key = ChannelKey.generate()
    node = key.with_tls(tls_of(certs))
    with anyio.fail_after(HANG_GUARD):
        async with open_pull(listen="tcp://127.0.0.1:0", signer=node.signer("x")) as rx:
            assert rx.address.startswith("tcp://127.0.0.1:")
            assert speaks_tls_only(rx.address)
            # A peer holding the channel key, with a certificate of another CA: no
            # connection, whichever side checks first.
            for stranger in (tls_of(certs, "stranger", "stranger-ca"), tls_of(certs, "stranger")):
                with pynng.Push0() as dialer:
                    dialer.tls_config = stranger.dialer_config("127.0.0.1")
                    with pytest.raises(pynng.CryptoError):
                        dialer.dial(f"tls+{rx.address}", block=True)
            async with open_push(dial=rx.address, signer=node.signer("x")) as tx:
                hello = Hello(
                    wire_version=1,
                    protocol_version=1,
                    config_hash="c",
                    registry_fingerprint="r",
                    peer_name="over tls",
                )
                await tx.send(hello)
                assert await rx.receive() == hello


async def test_dp_2_over_tls_spawned_and_headless_serves_exactly(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENVIRONMENT, ChannelKey.generate().hex())
    files = {
        "tls_cert_file": f"{certs}/node.pem",
        "tls_key_file": f"{certs}/node.key",
        "tls_ca_file": f"{certs}/ca.pem",
    }
    config = EngineConfig(executor="null", dp_size=2, transport="tcp", **files)
    flags = ["--executor", "null", "--tls-cert", files["tls_cert_file"]]
    flags += ["--tls-key", files["tls_key_file"], "--tls-ca", files["tls_ca_file"]]
    headless: list[Process] = []

    async def start(address: str) -> None:
        headless.append(await start_headless_rank(address, 1, 2, *flags))

    prompts = [f"tls {i}" for i in range(6)]
    results: dict[str, list[int]] = {}
    try:
        with anyio.fail_after(HANG_GUARD):
            async with (
                anyio.create_task_group() as starter,
                open_dp_engine(
                    config,
                    master="127.0.0.1:0",
                    local_ranks=[0],
                    on_listening=lambda address: starter.start_soon(start, address),
                ) as engine,
            ):

                async def run(prompt: str) -> None:
                    deltas = await collect(engine, prompt, SamplingParams(max_tokens=8))
                    results[prompt] = tokens_of(deltas)

                async with anyio.create_task_group() as tg:
                    for prompt in prompts:
                        tg.start_soon(run, prompt)
                counts = (await engine.stats()).ranks
                assert [rank.rank for rank in counts] == [0, 1]
                addresses = engine.core_client.wiring.addresses  # type: ignore[attr-defined]
                assert addresses and all(speaks_tls_only(a) for a in addresses.values())
    finally:
        for process in headless:
            if process.returncode is None:
                process.kill()
            await process.wait()
    assert results == {prompt: expected_tokens(prompt, 8) for prompt in prompts}


async def test_a_rank_whose_certificate_the_ca_did_not_sign_cannot_join(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It holds the channel key, but cannot connect: the start ends naming it."""
    monkeypatch.setenv(KEY_ENVIRONMENT, ChannelKey.generate().hex())
    config = EngineConfig(
        executor="null",
        dp_size=2,
        transport="tcp",
        startup_timeout=4.0,
        tls_cert_file=f"{certs}/node.pem",
        tls_key_file=f"{certs}/node.key",
        tls_ca_file=f"{certs}/ca.pem",
    )
    argv = ["rank", "--dp-rank", "1", "--dp-size", "2", "--executor", "null"]
    argv += ["--tls-cert", f"{certs}/stranger.pem", "--tls-key", f"{certs}/stranger.key"]
    argv += ["--tls-ca", f"{certs}/ca.pem"]
    await headless_rank_is_refused(config, argv)


def test_missing_or_bad_tls_files_are_refused_by_name(
    certs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    missing = f"{tmp_path}/missing.pem"
    # On the command line: one line, exit status 2, before anything starts.
    monkeypatch.setenv(KEY_ENVIRONMENT, ChannelKey.generate().hex())
    argv = ["rank", "--dp-rank", "1", "--dp-size", "2", "--master", "127.0.0.1:1"]
    argv += ["--executor", "null", "--tls-cert", missing, "--tls-key", f"{certs}/node.key"]
    assert main([*argv, "--tls-ca", f"{certs}/ca.pem"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read the TLS certificate file {missing}" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match=f"cannot read the TLS certificate file {missing}"):
        ChannelTLS.load(missing, f"{certs}/node.key", f"{certs}/ca.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"the TLS CA file {garbage} is not a valid PEM"):
        ChannelTLS.load(f"{certs}/node.pem", f"{certs}/node.key", str(garbage))
    with pytest.raises(ValueError, match=f"the TLS certificate {garbage} and key"):
        ChannelTLS.load(str(garbage), f"{certs}/node.key", f"{certs}/ca.pem")
    with pytest.raises(ValueError, match="go together; only tls_cert_file given"):
        EngineConfig(transport="tcp", tls_cert_file=f"{certs}/node.pem")
    with pytest.raises(ValueError, match="TLS files protect tcp channels; transport is 'ipc'"):
        EngineConfig(
            tls_cert_file=f"{certs}/node.pem",
            tls_key_file=f"{certs}/node.key",
            tls_ca_file=f"{certs}/ca.pem",
        )


def test_the_tls_files_travel_with_the_key_and_the_private_key_is_never_shown(
    certs: Path,
) -> None:
    tls = tls_of(certs)
    key = ChannelKey.generate().with_tls(tls)
    assert pickle.loads(pickle.dumps(key)).tls == tls  # how spawned processes get it
    assert "PRIVATE KEY" not in repr(tls) and "PRIVATE KEY" in tls.key
