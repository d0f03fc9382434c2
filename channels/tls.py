"""TLS for tcp channels: nng's `tls+tcp` transport with certificates the operator gives.

Signed frames (`frame_signer`) keep a stranger from forging or replaying anything, but
travel in clear: on a network others can watch, prompts and outputs can be read. With
`ChannelTLS`, a channel whose address is `tcp://` runs over `tls+tcp://` instead
(`sockets` does the swap, so addresses elsewhere stay `tcp://`), and both ends prove
themselves: a listener asks every dialer for a certificate the CA signed (mutual
TLS), a dialer checks the listener's certificate against the CA and the name it dials
(the host of the address, or `server_name` when every process shares one certificate
issued to that name). A peer without such a certificate cannot even connect.

The PEM texts are read once, by `load`, which names the file that is missing or not
valid; they travel to spawned processes inside the `ChannelKey` (pickled through
multiprocessing's pipe, never argv).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pynng

_MODE = pynng.TLSConfig
_REQUIRED = pynng.TLSConfig.AUTH_MODE_REQUIRED


@dataclass(frozen=True, slots=True)
class ChannelTLS:
    """One process's certificate and key, and the CA its peers' certificates come from."""

    cert: str
    key: str = field(repr=False)
    ca: str
    server_name: str | None = None

    @classmethod
    def load(
        cls, cert_file: str, key_file: str, ca_file: str, *, server_name: str | None = None
    ) -> ChannelTLS:
        """Read the PEM files, refusing (ValueError naming the file) any that is missing,
        unreadable or not what it should be."""
        tls = cls(
            _read(cert_file, "certificate"),
            _read(key_file, "key"),
            _read(ca_file, "CA"),
            server_name,
        )
        try:
            pynng.TLSConfig(_MODE.MODE_CLIENT, ca_string=tls.ca, auth_mode=_REQUIRED)
        except pynng.NNGException as error:
            raise ValueError(
                f"the TLS CA file {ca_file} is not a valid PEM certificate: {error}"
            ) from None
        try:
            pynng.TLSConfig(_MODE.MODE_SERVER, own_cert_string=tls.cert, own_key_string=tls.key)
        except pynng.NNGException as error:
            raise ValueError(
                f"the TLS certificate {cert_file} and key {key_file} are not a valid PEM "
                f"certificate and its private key: {error}"
            ) from None
        return tls

    def listener_config(self) -> pynng.TLSConfig:
        return pynng.TLSConfig(
            _MODE.MODE_SERVER,
            own_cert_string=self.cert,
            own_key_string=self.key,
            ca_string=self.ca,
            auth_mode=_REQUIRED,
        )

    def dialer_config(self, host: str) -> pynng.TLSConfig:
        return pynng.TLSConfig(
            _MODE.MODE_CLIENT,
            server_name=self.server_name or host,
            own_cert_string=self.cert,
            own_key_string=self.key,
            ca_string=self.ca,
            auth_mode=_REQUIRED,
        )


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the TLS {what} file {path}: {error}") from None


def secure_address(
    socket: pynng.Socket, address: str, tls: ChannelTLS | None, *, listen: bool
) -> str:
    """The address to listen on or dial: a `tcp://` one under `tls` becomes `tls+tcp://`,
    with the socket configured for its side; any other is returned as it is."""
    if tls is None or not address.startswith("tcp://"):
        return address
    if listen:
        socket.tls_config = tls.listener_config()
    else:
        host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        socket.tls_config = tls.dialer_config(host)
    return f"tls+{address}"
