"""The lockstep group's store, signed with the engine's channel key.

The gloo group meets through a `TCPStore` the front end hosts: each member writes its
address there (`set`) and reads the others' (`wait`, `get`). The store itself has no
authentication, so whoever can reach its port could write a member's key and have the
group connect to it. `SignedStore` is a `torch.distributed.Store` written in Python
(torch's trampoline calls it from C++, also for `ProcessGroupGloo`'s rendezvous) over
the `TCPStore`: every value is written with a BLAKE2b MAC under a key derived from the
channel key, covering the value and its full key name, and a value read back that
fails the check is never used (a value copied from another key fails too): it is read
again until the store's timeout (a stranger's value written first is replaced by the
member's own write), then refused with `StoreAuthenticationError`, and the group fails
to form, naming the store. A stranger can stop a rendezvous (by writing a member's key
after the member did, or deleting keys) but cannot steer one.

What stays exposed: the values are signed, not encrypted (a stranger reading the store
learns the members' gloo addresses), and gloo's own connections between members,
which carry the votes, are not authenticated. Both listen on the engine's hosts only.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import timedelta

import torch.distributed as dist

from wavecore.channels import ChannelKey

STORE_CHANNEL = "group store"
_MAC_SIZE = 16
_REREAD_S = 0.01


class StoreAuthenticationError(RuntimeError):
    """A value in the group's store was not written by a holder of the channel key."""


class SignedStore(dist.Store):
    """`inner` with every value signed on `set` and checked on `get`. Counters (`add`)
    and key deletion pass through unsigned: the group's rendezvous uses neither."""

    def __init__(self, inner: dist.Store, key: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._key = key

    def _mac(self, name: str, value: bytes) -> bytes:
        mac = hashlib.blake2b(key=self._key, digest_size=_MAC_SIZE, person=b"wavecore-store")
        encoded = name.encode()
        mac.update(len(encoded).to_bytes(4, "big"))
        mac.update(encoded)
        mac.update(value)
        return mac.digest()

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._mac(key, data) + data)

    def get(self, key: str) -> bytes:
        """The value under `key`, once it is one a key holder wrote. A stranger's value
        may be there first (written before the member's own, which replaces it): it is
        read again until the store's timeout, then refused."""
        deadline = time.monotonic() + self._inner.timeout.total_seconds()
        while True:
            signed = self._inner.get(key)
            mac, value = signed[:_MAC_SIZE], signed[_MAC_SIZE:]
            if len(mac) == _MAC_SIZE and hmac.compare_digest(mac, self._mac(key, value)):
                return value
            if time.monotonic() >= deadline:
                raise StoreAuthenticationError(
                    f"the group store's value for {key!r} fails authentication: it was not "
                    "written by a holder of the engine's channel key"
                )
            # The store cannot wait for a change: polled, rendezvous only.
            time.sleep(_REREAD_S)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)


def open_group_store(
    host: str, port: int, *, size: int, timeout: timedelta, key: ChannelKey
) -> SignedStore:
    """A member's client of the group's store at `host:port` (`size` members and the
    front end), signed with `key`."""
    store = dist.TCPStore(host, port, size + 1, False, timeout=timeout)
    return SignedStore(store, key.derived(STORE_CHANNEL))
