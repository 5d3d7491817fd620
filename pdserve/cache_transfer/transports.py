"""The one table of KV transports, and what ``--kv-transfer`` and a peer's registration select from it.

Adding a transport: one module implementing :class:`~pdserve.cache_transfer.base.TransportBackend`
and one line in :data:`TRANSPORTS` (its flags, if it has any, in ``worker/settings.py``).

Importing this module loads no transport's heavy dependency (no torch, no Mooncake wheel): each
backend loads its own when asked whether it can run, or opened.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pdserve.cache_transfer.base import CPU, KVTransport, LocalCache, TransportBackend
from pdserve.cache_transfer.cuda_ipc import CudaIpcBackend
from pdserve.cache_transfer.mooncake import MooncakeBackend
from pdserve.cache_transfer.shm import ShmBackend
from pdserve.errors import ConfigError, TransferError

log = logging.getLogger(__name__)

# protocol name -> backend; the order is the order an instance advertises them in
TRANSPORTS: dict[str, type[TransportBackend]] = {
    ShmBackend.protocol: ShmBackend,
    MooncakeBackend.protocol: MooncakeBackend,
    CudaIpcBackend.protocol: CudaIpcBackend,
}
AUTO, ALL = "auto", "both"  # every available transport; every transport for the cache's device
KV_TRANSFERS = (AUTO, *TRANSPORTS, ALL)  # the choices of --kv-transfer


def configured(choice: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """The protocols ``--kv-transfer choice`` offers: ``auto`` those this host can run with these
    worker settings (``options``; the reason each other one is left out is logged), ``both`` all
    of those that move a cache where this one lives (``options["device"]``, "cpu" when not
    given: shm and mooncake in host memory, cuda_ipc on a GPU), a protocol name just that one (a
    ConfigError when it cannot move a cache on that device)."""
    device = (options or {}).get("device") or CPU
    if choice == AUTO:
        offered = []
        for protocol, backend in TRANSPORTS.items():
            reason = backend.left_out_of_auto(options or {})
            if reason is None:
                offered.append(protocol)
            else:
                log.info("KV transport %s left out (--kv-transfer auto): %s", protocol, reason)
        return offered
    if choice == ALL:
        return [protocol for protocol, backend in TRANSPORTS.items() if backend.unsuited(device) is None]
    if choice in TRANSPORTS:
        reason = TRANSPORTS[choice].unsuited(device)
        if reason is not None:
            raise ConfigError(f"--kv-transfer {choice}: {reason}")
        return [choice]
    raise ConfigError(f"--kv-transfer must be one of {', '.join(KV_TRANSFERS)}, got {choice!r}")


def open_writer(
    backends: Mapping[str, TransportBackend], protocol: str, endpoint: Mapping[str, Any] | None
) -> KVTransport:
    """A writer over ``protocol`` into the peer whose registration's ``transfer.endpoint`` is
    ``endpoint``, through this instance's open backend of that protocol (``backends``)."""
    if protocol not in TRANSPORTS:
        raise TransferError(
            f"unsupported KV transfer protocol {protocol!r} (supported: {', '.join(TRANSPORTS)})"
        )
    backend = backends.get(protocol)
    if backend is None:
        raise TransferError(f"this instance does not offer the {protocol} transport (--kv-transfer)")
    peer = (endpoint or {}).get(protocol)
    if not peer:
        raise TransferError(f"peer advertises no {protocol} endpoint (transfer.endpoint.{protocol})")
    return backend.writer(peer)


def open_backends(
    protocols: list[str], options: Mapping[str, Any], local: LocalCache
) -> dict[str, TransportBackend]:
    """Each of ``protocols`` configured from ``options`` (see ``TransportBackend.from_options``) with
    its local side open over ``local``; blocking (engines start). If one fails, those already open
    are closed before the error propagates."""
    backends: dict[str, TransportBackend] = {}
    try:
        for protocol in protocols:
            backend = TRANSPORTS[protocol].from_options(options)
            backend.open(local)
            backends[protocol] = backend
    except BaseException:
        close_backends(backends)
        raise
    return backends


def close_backends(backends: Mapping[str, TransportBackend]) -> None:
    """Close every local side (before the cache's memory goes); one failing does not stop the others."""
    for protocol, backend in backends.items():
        try:
            backend.close()
        except Exception:
            log.exception("closing the %s transport failed", protocol)
