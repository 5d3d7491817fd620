"""The KV transport interfaces: a backend per protocol, and the writer it opens to one peer.

A transport is chosen per prefill/decode pair (``disaggregate_info.protocol``); both sides walk
their block lists in block-table order (see regions.py). Each protocol is one module implementing
:class:`TransportBackend` (``shm.py``, ``mooncake.py``, ``cuda_ipc.py``), registered in
``transports.TRANSPORTS``; this module knows none of them, and the worker names none of them.

A cache lives in host memory (``device`` "cpu": its view a numpy uint8 array) or in GPU memory
("cuda": a flat ``torch.uint8`` CUDA tensor); each backend says which it moves (``devices``).
This module never imports torch: the CPU path must not load it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pdserve.cache_transfer.regions import Region, pair_regions
from pdserve.errors import ConfigError

B = TypeVar("B", bound="TransportBackend")


class NoLandingRoom(Exception):
    """A staged cache's landing pool has no room for a reservation now: the peer asks again."""


class KVTransport(abc.ABC):
    """Writes local cache bytes into one peer's cache."""

    protocol: str

    @abc.abstractmethod
    def write(self, src: Any, segments: list[tuple[int, int, int]]) -> int:
        """Copy ``src[s:s+n]`` to the peer at ``d`` for each ``(s, d, n)``; returns bytes moved.

        ``src`` is the local cache's :attr:`LocalCache.view` (numpy on a host cache, torch on a GPU)."""

    def write_blocks(self, src: Any, src_regions: list[Region], dst_regions: list[Region]) -> int:
        return self.write(src, pair_regions(src_regions, dst_regions))

    def fence(self) -> str | None:
        """The incarnation of the peer whose cache this writer reaches now, read where the bytes
        land (shm: the segment's fence, written by its owner at start), "" when that cache names
        none; None where the protocol cannot read it there (the writer then reaches the incarnation
        whose endpoint it was opened from). The prefill side checks it against the incarnation that
        reserved the blocks before every chunk it writes, and after the last."""
        return None

    def current(self) -> bool:
        """Whether the peer's endpoint still leads to the cache this writer opened (False: the
        peer restarted under the same endpoint, so the writer must be reopened). Cheap; True
        where a protocol cannot tell (the registration's incarnation still tells)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or mappings to the peer."""


CPU, CUDA = "cpu", "cuda"  # where a KV cache lives (EngineFacts.device, KVInfo.device)


@dataclasses.dataclass(frozen=True)
class LocalCache:
    """This instance's KV cache, as a backend's local side sees it."""

    view: Any
    """The whole cache as bytes, alive and unmoved until the backend is closed: a numpy uint8 array
    on a host cache (``device`` "cpu"), a flat ``torch.uint8`` CUDA tensor on a GPU ("cuda")."""
    shm_name: str | None = None  # the shared-memory segment holding it (a decode instance's), if any
    device: str = CPU
    block_bytes: int | None = None  # bytes of one block: what a block-wise backend (cuda_ipc) copies
    shared: bool = False
    """Peers write into this cache (a decode instance's): a backend that must export it to advertise
    an endpoint does so only then (a prefill's cache is never exported)."""
    incarnation: str | None = None
    """This start of the instance (``TransferInfo.incarnation``): a backend that can put it where
    peers write (the shm segment's fence) does, so a writer can tell a restarted cache of one name."""


class TransportBackend(abc.ABC):
    """One KV transport protocol on this instance: its local side, its advertised endpoint, and
    writers into peers' caches. The worker opens one per offered protocol at start-up, publishes
    each :meth:`endpoint` as its registration's ``transfer.endpoint[protocol]``, opens writers
    through it by the pair's protocol, and closes it at shutdown, before the cache's memory goes.
    """

    protocol: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = (CPU,)
    """Where the caches it moves may live (``LocalCache.device``): host memory by default."""

    @classmethod
    def unsuited(cls, device: str) -> str | None:
        """Why this transport cannot move a cache that lives on ``device``; None when it can."""
        if device in cls.devices:
            return None
        return (
            f"the {cls.protocol} transport moves KV caches in {' or '.join(cls.devices)} memory, not {device}"
        )

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this host cannot run the transport (``--kv-transfer auto`` then leaves it out); None if it can.

        Cheap: loads no engine, opens nothing."""
        return None

    @classmethod
    def left_out_of_auto(cls, options: Mapping[str, Any]) -> str | None:
        """Why ``--kv-transfer auto`` does not offer this transport with these worker settings, or
        None when it does: by default, the cache's device (``options["device"]``, "cpu" when not
        given: :meth:`unsuited`), then whatever :meth:`unavailable` says."""
        return cls.unsuited(options.get("device") or CPU) or cls.unavailable()

    @classmethod
    def from_options(cls: type[B], options: Mapping[str, Any]) -> B:
        """A closed backend configured from the worker's settings by field name (its flags' dests);
        each backend reads only the options it declares, missing ones take their defaults."""
        return cls()

    @abc.abstractmethod
    def open(self, local: LocalCache) -> None:
        """Open the local side over this instance's cache (start engines, register memory); a
        ConfigError when the cache lives where this transport cannot move it (:meth:`check_device`)."""

    @abc.abstractmethod
    def endpoint(self) -> Any:
        """What peers need to write into this cache (JSON-able), or None when peers cannot write here."""

    @abc.abstractmethod
    def writer(self, peer: Any) -> KVTransport:
        """A writer into the peer whose registration advertises ``peer`` as this protocol's endpoint."""

    def reserve_landing(self, nbytes: int) -> int | None:
        """Where a peer should write ``nbytes`` of blocks into this cache through this transport
        when not at the blocks' own offsets: an offset into the memory this backend registered (a
        staged GPU cache's landing pool), reserved until :meth:`release_landing`; None (the
        default): at the blocks' own offsets. :class:`NoLandingRoom` when none is free now."""
        return None

    def land(self, regions: list[Region], landing: int | None = None) -> None:  # noqa: B027 - optional hook
        """A peer's ``prefilled`` says its bytes for these regions of this cache were written through
        this transport (at ``landing`` when :meth:`reserve_landing` gave one): make them the cache's
        (a staged transport copies them from host memory into the device cache). Called before the
        request continues here; by default nothing to do."""

    def release_landing(self, landing: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Give back what :meth:`reserve_landing` reserved, once no write into it can land."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Close the local side: afterwards no peer can write into this cache through it."""

    @classmethod
    def check_device(cls, local: LocalCache) -> None:
        """ConfigError when ``local`` lives where this transport cannot move it (:meth:`unsuited`)."""
        reason = cls.unsuited(local.device)
        if reason is not None:
            raise ConfigError(reason)
