"""Open the transport a peer's registration asks for (``transfer.endpoint``), by protocol name."""

from __future__ import annotations

from typing import Any

from pdserve.cache_transfer.base import KVTransport
from pdserve.errors import TransferError

PROTOCOLS = ("shm", "mooncake")


def open_transport(protocol: str, endpoint: dict[str, Any] | None, agent: Any = None) -> KVTransport:
    """A transport to the peer described by its registration's ``transfer.endpoint``.

    ``agent`` is this process's :class:`~pdserve.cache_transfer.mooncake.MooncakeAgent`, for ``mooncake``.
    """
    endpoint = endpoint or {}
    if protocol == "shm":
        from pdserve.cache_transfer.shm import ShmWriter

        name = endpoint.get("shm")
        if not name:
            raise TransferError("peer advertises no shared-memory segment (transfer.endpoint.shm)")
        return ShmWriter(name)
    if protocol == "mooncake":
        from pdserve.cache_transfer.mooncake import MooncakeWriter

        if agent is None:
            raise TransferError("this instance does not offer the mooncake transport (--kv-transfer)")
        peer = endpoint.get("mooncake")
        if not peer:
            raise TransferError("peer advertises no mooncake endpoint (transfer.endpoint.mooncake)")
        return MooncakeWriter(agent, peer)
    raise TransferError(f"unsupported KV transfer protocol {protocol!r} (supported: {', '.join(PROTOCOLS)})")
