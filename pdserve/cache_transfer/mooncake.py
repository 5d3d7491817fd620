"""Cross-host KV transfer over the Mooncake transfer engine (TCP, or RDMA where the NICs exist).

Each instance that offers ``mooncake`` runs one :class:`MooncakeAgent`: a transfer engine started
with ``P2PHANDSHAKE`` (no metadata service; ``redis://`` metadata is not compiled into the CPU
wheel and would abort the process) that binds a random RPC port and has the instance's whole KV
cache registered. A decode instance publishes :attr:`MooncakeAgent.endpoint` (its ``ip:port``
session, the registered buffer's address and length) in its registration; a prefill instance
writes its blocks straight into those addresses, adjacent blocks merged, one batch call per
hand-off. The optional extra ``pip install 'pdserve[mooncake]'`` brings the CPU-only wheel.
:class:`MooncakeBackend` is the transport as the worker sees it (``base.TransportBackend``).

Trust model: anyone who can reach the engine's ports can read and write the registered KV cache (as
with NCCL, NIXL and Mooncake everywhere), so the transfer network must be private. The wheel cannot
be told which interface to listen on: ``initialize``'s first argument (``--transfer-address``) and
``MC_TCP_BIND_ADDRESS`` only set the address it *advertises*; its handshake port is bound to
``0.0.0.0`` and its TCP data port to ``[::]`` (checked with mooncake-transfer-engine 0.3.13). Keep
those ports off untrusted networks with a firewall or network namespace. The endpoint (session,
buffer address) is published in Redis only, never over HTTP (router ``/v1/instances``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.cache_transfer.base import CPU, CUDA, KVTransport, LocalCache, TransportBackend
from pdserve.cache_transfer.regions import Region, Segment
from pdserve.cache_transfer.staging import HostStaging
from pdserve.errors import ConfigError, TransferError

log = logging.getLogger(__name__)

PROTOCOL = "mooncake"
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
SYSTEM_LIBRARIES = ("libibverbs1", "libnuma1", "libcurl4")  # what the wheel's engine.so links against
RETRY_DELAY_S = 0.05
BOUNCE_BYTES = 64 << 20
"""A prefill's host bounce buffer for a GPU cache: a write is sent in pieces of at most this."""
DEFAULT_STAGING_MB = 1024
"""A decode instance's landing pool for a GPU cache (``--mooncake-staging-mb``): the hand-offs in
flight into it at once, not the cache, are what it must hold."""


def load_engine_class() -> Any:
    """The wheel's ``TransferEngine`` class, or a ConfigError that says what to install."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines are one per transfer
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        missing = "pip install 'pdserve[mooncake]'"
        if "shared object" in str(e):  # the wheel is there; a system library its engine.so needs is not
            missing = f"apt-get install {' '.join(SYSTEM_LIBRARIES)}"
        raise ConfigError(f"the mooncake KV transport cannot load ({e}); {missing}") from None
    return TransferEngine


def unavailable() -> str | None:
    """Why this host cannot run the Mooncake transport (wheel or system libraries missing); None if it can."""
    try:
        load_engine_class()
    except ConfigError as e:
        return str(e)
    return None


def available() -> bool:
    """Whether this host can run the Mooncake transport (wheel and system libraries present)."""
    return unavailable() is None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the duration (the engine's C++ logging writes there)."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def rdma_devices() -> list[str]:
    """The host's RDMA devices (HCAs), as the kernel lists them."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


class MooncakeAgent:
    """This process's transfer engine, with one local buffer (the KV cache) registered."""

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        if protocol not in MOONCAKE_PROTOCOLS:
            raise ConfigError(
                f"--mooncake-protocol must be one of {', '.join(MOONCAKE_PROTOCOLS)}, got {protocol!r}"
            )
        if protocol == "rdma" and not rdma_devices():
            # the engine would fall back to TCP without saying so: say it, and ask for TCP outright
            log.warning("--mooncake-protocol rdma, but this host has no RDMA device: using tcp")
            protocol = "tcp"
        self.host = host
        self.protocol = protocol
        self._engine = load_engine_class()()
        with _quiet_stderr():  # glog's pre-init warning and a benign "segment descriptor not found"
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransferError(f"mooncake transfer engine did not start on {host} ({protocol}): error {rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._buffer: np.ndarray | None = None
        self._lock = threading.Lock()  # one batch at a time per agent: the engine's sessions are shared
        log.info(
            "mooncake transfer engine (%s) at %s; it listens on every interface whatever the address "
            "(the wheel cannot bind one): keep its ports on a private network",
            protocol,
            self.session,
        )

    def register(self, buffer: np.ndarray) -> None:
        """Register the KV cache (a uint8 view that stays alive and never moves)."""
        if self._buffer is not None:
            raise TransferError("a mooncake agent registers one buffer")
        rc = self._engine.register_memory(buffer.ctypes.data, buffer.nbytes)
        if rc != 0:
            raise TransferError(f"mooncake could not register {buffer.nbytes} bytes of KV cache: error {rc}")
        self._buffer = buffer

    @property
    def endpoint(self) -> dict[str, Any]:
        """What peers need to write into the registered buffer (``transfer.endpoint.mooncake``)."""
        assert self._buffer is not None, "register the KV cache first"
        return {
            "session": self.session,
            "addr": self._buffer.ctypes.data,
            "length": self._buffer.nbytes,
            "protocol": self.protocol,
        }

    def write(self, peer: dict[str, Any], src: np.ndarray, segments: list[Segment]) -> int:
        """One batch write of ``segments`` from ``src`` (the registered buffer) into ``peer``."""
        if self._buffer is None or src.ctypes.data != self._buffer.ctypes.data:
            raise TransferError("mooncake writes only from the registered KV cache")
        base, remote, length = src.ctypes.data, int(peer["addr"]), int(peer["length"])
        for _, d, n in segments:
            if d + n > length:
                raise TransferError(f"segment {d}+{n} exceeds peer cache of {length} bytes")
        local = [base + s for s, _, _ in segments]
        dst = [remote + d for _, d, _ in segments]
        sizes = [n for _, _, n in segments]
        with self._lock:
            rc = self._engine.batch_transfer_sync_write(peer["session"], local, dst, sizes)
            if rc != 0:
                # Mooncake 0.3.13 can reject the first batch after an idle gap (lane queue-full,
                # upstream #4209): one retry, then the request fails and the router retries it.
                log.warning("mooncake write to %s failed (%d); retrying once", peer["session"], rc)
                time.sleep(RETRY_DELAY_S)
                rc = self._engine.batch_transfer_sync_write(peer["session"], local, dst, sizes)
        if rc != 0:
            raise TransferError(f"mooncake write to {peer['session']} failed: error {rc}")
        return sum(sizes)

    def close(self) -> None:
        """Unregister the buffer (before the cache's memory goes away: no peer may write into it after)."""
        if self._buffer is not None:
            self._engine.unregister_memory(self._buffer.ctypes.data)
            self._buffer = None


def default_address() -> str:
    """The address peers most likely reach this host at: that of the default route's interface."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a route
            return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class MooncakeWriter(KVTransport):
    """Writes into one peer's registered KV cache through this process's agent."""

    protocol = PROTOCOL

    def __init__(
        self, agent: MooncakeAgent, peer: dict[str, Any], staging: HostStaging | None = None
    ) -> None:
        missing = [k for k in ("session", "addr", "length") if k not in peer]
        if missing:
            raise TransferError(f"peer's mooncake endpoint lacks {', '.join(missing)}")
        self.agent = agent
        self.peer = peer
        self.staging = staging

    def write(self, src: Any, segments: list[Segment]) -> int:
        """From a host cache, straight; from a GPU cache (``src`` its device view), through this
        instance's host bounce buffer: device → buffer, then the write from there, in pieces of at
        most the buffer's size (one write at a time holds it)."""
        staging = self.staging
        if staging is None:
            return self.agent.write(self.peer, src, segments)
        moved = 0
        with staging.bounce:
            for piece in _pieces(segments, staging.nbytes):
                staging.out([(s, n) for s, _, n in piece])
                at, local = 0, []
                for _, d, n in piece:
                    local.append((at, d, n))
                    at += n
                moved += self.agent.write(self.peer, staging.buffer, local)
        return moved


def _pieces(segments: list[Segment], most: int) -> list[list[Segment]]:
    """``segments`` cut into runs of at most ``most`` bytes each (a segment split where needed)."""
    out: list[list[Segment]] = [[]]
    room = most
    for s, d, n in segments:
        while n:
            take = min(n, room)
            out[-1].append((s, d, take))
            s, d, n, room = s + take, d + take, n - take, room - take
            if not room:
                out.append([])
                room = most
    return [piece for piece in out if piece]


class MooncakeBackend(TransportBackend):
    """One :class:`MooncakeAgent` over this instance's whole cache when it is in host memory (a
    prefill's too: writes go from registered memory), or over a bounded host staging beside a GPU
    cache (staging.py: a decode instance's landing pool, a prefill's bounce buffer). Options:
    ``transfer_address`` (default: :func:`default_address`), ``mooncake_protocol`` (the wire,
    ``tcp`` or ``rdma``) and ``mooncake_staging_mb``: the worker's flags of those names."""

    protocol = PROTOCOL
    devices = (CPU, CUDA)  # a GPU cache through host staging (staging.py)

    def __init__(self, address: str = "", wire: str = "tcp", staging_mb: int = DEFAULT_STAGING_MB) -> None:
        self.address, self.wire, self.staging_mb = address, wire, staging_mb
        self.agent: MooncakeAgent | None = None
        self.staging: HostStaging | None = None
        self._landing = False  # peers write into this cache: its staging is a landing pool

    @classmethod
    def unavailable(cls) -> str | None:
        return unavailable()

    @classmethod
    def left_out_of_auto(cls, options: Mapping[str, Any]) -> str | None:
        """Mooncake listens on every interface whatever address it is given, so ``auto`` offers it
        only where the operator named the private address peers reach it at."""
        reason = cls.unsuited(options.get("device") or CPU) or cls.unavailable()
        if reason is None and not options.get("transfer_address"):
            reason = (
                "no --transfer-address given (Mooncake's ports listen on every interface: give the "
                "private address to offer it, or --kv-transfer mooncake)"
            )
        return reason

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MooncakeBackend:
        return cls(
            options.get("transfer_address") or "",
            options.get("mooncake_protocol") or "tcp",
            options.get("mooncake_staging_mb") or DEFAULT_STAGING_MB,
        )

    def open(self, local: LocalCache) -> None:
        self.check_device(local)
        agent = MooncakeAgent(self.address or default_address(), self.wire)
        if local.device == CUDA:  # the engine registers host memory: staging beside the device cache
            self._landing = local.shared
            nbytes = self.staging_mb << 20 if local.shared else min(BOUNCE_BYTES, self.staging_mb << 20)
            self.staging = HostStaging(local.view, nbytes, unit=local.block_bytes or 1)
            log.info(
                "mooncake stages the GPU's KV cache through %d MiB of host memory (%s)",
                self.staging.nbytes >> 20,
                "its landing pool" if local.shared else "its bounce buffer",
            )
        try:
            agent.register(self.staging.buffer if self.staging is not None else local.view)
        except BaseException:
            self.close()
            raise
        self.agent = agent

    def reserve_landing(self, nbytes: int) -> int | None:
        """A decode instance's GPU cache: an extent of its landing pool (NoLandingRoom when full)."""
        if self.staging is None or not self._landing:
            return None
        return self.staging.reserve(nbytes)

    def land(self, regions: list[Region], landing: int | None = None) -> None:
        """With a GPU cache: the bytes a peer wrote at ``landing``, into these regions of the cache."""
        if self.staging is not None and landing is not None:
            self.staging.into_device(landing, regions)

    def release_landing(self, landing: int, nbytes: int) -> None:
        if self.staging is not None:
            self.staging.release(landing, nbytes)

    def endpoint(self) -> dict[str, Any] | None:
        return self.agent.endpoint if self.agent is not None else None

    def writer(self, peer: Any) -> MooncakeWriter:
        if self.agent is None:
            raise TransferError("the mooncake transport is not open here")
        return MooncakeWriter(self.agent, peer, self.staging)

    def close(self) -> None:
        """Unregister the cache (before its memory goes: no peer may write into it after)."""
        if self.agent is not None:
            self.agent.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
