"""Open the transport a peer's registration asks for (``transfer.endpoint``), by protocol name."""

from __future__ import annotations

from typing import Any

from pdserve.cache_transfer.base import KVTransport
from pdserve.cache_transfer.shm import ShmWriter
from pdserve.errors import TransferError

PROTOCOLS = ("shm",)


def open_transport(protocol: str, endpoint: dict[str, Any] | None) -> KVTransport:
    """A transport to the peer described by its registration's ``transfer.endpoint``."""
    if protocol == "shm":
        name = (endpoint or {}).get("shm")
        if not name:
            raise TransferError("peer advertises no shared-memory segment (transfer.endpoint.shm)")
        return ShmWriter(name)
    raise TransferError(f"unsupported KV transfer protocol {protocol!r} (supported: {', '.join(PROTOCOLS)})")
