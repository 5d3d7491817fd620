"""Where the splitwise KV writes go: this instance's open transport backends, and one writer per
decode peer through them. Apart from the hand-off's state machines (prefill_handoff.py writes
through it, decode_lease.py lands through its backends), so the writers' lifetime (reopened after a
peer's restart, closed only when no copy holds them) reads in one place."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

from pdserve.cache_transfer.base import KVTransport, TransportBackend
from pdserve.cache_transfer.transports import close_backends, open_writer

log = logging.getLogger(__name__)

WRITERS_IDLE_S = 10.0  # how long closing the backends waits for copies still running on their threads
T = TypeVar("T")


class Transports:
    """This instance's open KV transport backends (by protocol), and one writer per decode peer
    through them, dropped after a failure (the next hand-off reopens it).

    A writer is keyed by the peer's id, endpoint and incarnation (new at every start): a peer
    restarted under the same id, whose shm segment has the same name, is never written through the
    old mapping; nor is one whose endpoint no longer leads to the cache the writer opened
    (``KVTransport.current``), when a router's view of the registration is behind. Writers of peers
    that left the live set are closed (:meth:`prune`), so a dead peer's segment is not kept mapped.
    A writer dropped while a write holds it (:meth:`write`, :meth:`writer`) is closed when that
    write is done: by the copy's thread when it returns, even if the coroutine that awaited it was
    cancelled (shutdown), and :meth:`close_backends` waits for running copies first.
    """

    def __init__(self, backends: dict[str, TransportBackend] | None = None) -> None:
        self._open: dict[str, _Writer] = {}
        self.backends: dict[str, TransportBackend] = backends if backends is not None else {}
        self._idle = threading.Condition()  # guards users/dropped; notified when a copy ends
        self._copies = 0  # copies running on their threads
        self._rates: dict[str, float] = {}  # protocol -> bytes/s its recent writes moved at

    def rate(self, protocol: str) -> float | None:
        """Bytes per second writes over ``protocol`` moved lately (None before the first)."""
        return self._rates.get(protocol)

    def observe(self, protocol: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        seen, known = nbytes / seconds, self._rates.get(protocol)
        self._rates[protocol] = seen if known is None else (known + seen) / 2

    def get(self, protocol: str, peer_id: str, transfer: dict[str, Any]) -> KVTransport:
        """``transfer`` is the peer's registered TransferInfo."""
        key = (protocol, transfer.get("endpoint"), transfer.get("incarnation"))
        cached = self._open.get(peer_id)
        if cached is not None and cached.key == key and cached.transport.current():
            return cached.transport
        self.drop(peer_id)
        transport = open_writer(self.backends, protocol, key[1])
        self._open[peer_id] = _Writer(key, transport)
        return transport

    @contextlib.contextmanager
    def writer(self, protocol: str, peer_id: str, transfer: dict[str, Any]) -> Iterator[KVTransport]:
        """:meth:`get`, held open until the block ends even if it is dropped meanwhile."""
        held = self._hold(protocol, peer_id, transfer)
        try:
            yield held.transport
        finally:
            self._release(held)

    async def write(
        self,
        protocol: str,
        peer_id: str,
        transfer: dict[str, Any],
        copy: Callable[[KVTransport, str | None], T],
    ) -> T:
        """``copy(writer, incarnation it was opened for)`` on a thread, the writer held until the
        copy returns: a cancelled caller (shutdown) stops waiting, the copy does not, and the writer
        closes only after it (:meth:`close_backends` waits for it too)."""
        held = self._hold(protocol, peer_id, transfer)
        with self._idle:
            self._copies += 1

        def run() -> T:
            try:
                return copy(held.transport, held.key[2])
            finally:
                self._release(held, copy_ended=True)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, not logged
            raise

    def _hold(self, protocol: str, peer_id: str, transfer: dict[str, Any]) -> _Writer:
        self.get(protocol, peer_id, transfer)
        held = self._open[peer_id]
        with self._idle:
            held.users += 1
        return held

    def _release(self, held: _Writer, copy_ended: bool = False) -> None:
        with self._idle:
            held.users -= 1
            close = held.dropped and not held.users
            if copy_ended:
                self._copies -= 1
            self._idle.notify_all()
        if close:
            held.transport.close()

    def drop(self, peer_id: str) -> None:
        cached = self._open.pop(peer_id, None)
        if cached is not None:
            with self._idle:
                cached.dropped = True
                close = not cached.users
            if close:
                cached.transport.close()

    @property
    def peers(self) -> list[str]:
        """The ids of the peers this instance holds a writer to."""
        return list(self._open)

    def prune(self, departed: Collection[str] = ()) -> list[str]:
        """Close the writers of the ``departed`` peers and those no longer ``current``; their ids."""
        gone = [p for p, w in self._open.items() if p in departed or not w.transport.current()]
        for peer_id in gone:
            log.info("closing the KV writer to %s: the peer is gone or restarted", peer_id)
            self.drop(peer_id)
        return gone

    def close(self) -> None:
        """Close every writer; the backends stay open (:meth:`close_backends`)."""
        for peer_id in list(self._open):
            self.drop(peer_id)

    def close_backends(self, wait_s: float = WRITERS_IDLE_S) -> None:
        """Close the backends' local sides, before the cache's memory goes: first wait (up to
        ``wait_s``) for copies still running on their threads, which read this cache."""
        with self._idle:
            if not self._idle.wait_for(lambda: not self._copies, timeout=wait_s):
                log.warning("closing the KV transports while %d copies still run", self._copies)
        close_backends(self.backends)
        self.backends.clear()


@dataclasses.dataclass
class _Writer:
    """One peer's open writer: what it was opened for, and how many writes hold it now."""

    key: tuple[str, Any, str | None]  # protocol, the peer's endpoint, its incarnation
    transport: KVTransport
    users: int = 0
    dropped: bool = False
