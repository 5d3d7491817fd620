"""What one router process's requests share, and the watcher that fails a request whose instance left.

One :class:`Dispatcher` per router process holds the cached live set, the two policies, the prefix
lookup, this router's in-flight count per instance, the inbox sender, and the watcher task that
notices instances leaving the live set (or stalling). Each client choice runs its attempts as a
``RoutedGeneration`` (generation.py), which the watcher sees as a :class:`WatchedGeneration`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from pdserve.errors import ControlPlaneError
from pdserve.router.http.metrics import RouterMetrics
from pdserve.router.http.settings import RouterSettings
from pdserve.router.routing.policies import PolicyRequest, PrefixWeights
from pdserve.router.routing.prefix_lookup import LocalIndex, PrefixLookup
from pdserve.router.routing.prompt_ids import PromptTokenizer
from pdserve.router.routing.selection import Route, Selector
from pdserve.router.routing.sender import InboxSender
from pdserve.router.routing.shadow import ShadowVerifier
from pdserve.scheduler.inbox_messages import Abort, PeerInfo
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.outbox_reader import OutboxReader
from pdserve.scheduler.prefix_index import PrefixIndex
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.registration import InstanceInfo
from pdserve.scheduler.registry import LiveSetCache
from pdserve.scheduler.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class WatchedGeneration(Protocol):
    """What the watcher needs of an open generation."""

    @property
    def watched(self) -> tuple[str, ...]:
        """Instances whose death ends the current attempt."""
        ...

    @property
    def has_tokens(self) -> bool:
        """The current attempt has produced tokens."""
        ...

    def progress_at(self) -> float:
        """time.monotonic() of the worker's latest progress on the current attempt."""
        ...

    def lost(self, instance_id: str, why: str) -> None:
        """``instance_id``, which the current attempt depends on, left the live set or stalled."""
        ...


class Dispatcher:
    """Routing state shared by all requests of one router process."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        live: LiveSetCache[InstanceInfo],
        reader: OutboxReader,
        settings: RouterSettings,
        clock: Callable[[], float] = time.time,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        """None: metrics are off (``--no-metrics``)."""
        self.redis = redis
        self.keys = keys
        self.live = live
        self.reader = reader
        self.settings = settings
        self.router_id = settings.router_id
        self.clock = clock
        weights = PrefixWeights(
            settings.prefix_load_tokens,
            settings.prefix_transfer_weight,
            settings.local_prefill_tokens,
            settings.prefix_host_tier_weight,
            settings.prefix_disk_tier_weight,
        )
        self.selector = Selector(
            settings.prefill_policy, settings.decode_policy, settings.aggregated_fallback, weights
        )
        index = PrefixIndex(redis, keys, settings.ttl_s) if settings.prefix_index == "redis" else LocalIndex()
        self.prefix = PrefixLookup(PromptTokenizer(redis, keys, nice=settings.prepare_nice), index)
        """Prompt lengths and cached prefixes, for a policy that places by them."""
        self.in_flight = self.selector.in_flight
        """This router's open requests per instance id (prefill counts until the first token)."""
        self.generations: dict[str, WatchedGeneration] = {}
        """The open generations by request id (each adds itself, and removes itself on close)."""
        self.num_retries = 0
        self.num_migrations = 0
        self.stopping = False
        self._peers: dict[str, tuple[InstanceInfo, PeerInfo]] = {}
        self.sender = InboxSender(
            redis, keys, observe=metrics.on_redis if metrics is not None else None, wait=settings.replica_wait
        )
        self._watcher: asyncio.Task[None] | None = None
        self.shadow = ShadowVerifier(self, settings.verify_fraction) if settings.verify_fraction > 0 else None
        """Shadow verification (``--verify-fraction``), None when off."""

    def route(
        self, live: Sequence[InstanceInfo], request: PolicyRequest, exclude: Collection[str] = ()
    ) -> Route:
        """Where to run ``request`` now (see :meth:`Selector.route`)."""
        return self.selector.route(live, request, exclude)

    def peer(self, info: InstanceInfo) -> PeerInfo:
        """The PeerInfo of an instance, built once per registration value seen."""
        cached = self._peers.get(info.id)
        if cached is None or cached[0] is not info:
            peer = PeerInfo(id=info.id, host=info.host, transfer=info.transfer.model_dump(exclude_none=True))
            self._peers[info.id] = cached = (info, peer)
        return cached[1]

    # -- in-flight counts and aborts, for the generations -----------------------------------------

    def hold(self, instance_id: str) -> None:
        """One more open attempt on ``instance_id``."""
        self.in_flight[instance_id] = self.in_flight.get(instance_id, 0) + 1

    def release(self, instance_id: str) -> None:
        """One open attempt fewer on ``instance_id``."""
        n = self.in_flight.get(instance_id, 0) - 1
        if n > 0:
            self.in_flight[instance_id] = n
        else:
            self.in_flight.pop(instance_id, None)

    def abort_soon(self, route: Route, request_id: str, attempt: int, reason: str) -> None:
        """Send Abort to every instance of ``route`` without waiting (cancellation cannot stop it)."""
        msg = Abort(request_id=request_id, reason=reason, attempt=attempt)
        for instance_id in route.instance_ids:
            self.sender.send_nowait(instance_id, msg)

    # -- watcher -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the watcher: one task per router that fails requests whose instance left the live set."""
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name=f"watcher-{self.router_id}")

    async def stop(self) -> None:
        """Stop the watcher and retries (requests still open end with the reader's error), flush aborts."""
        self.stopping = True
        if self._watcher is not None:
            await cancel_and_wait(self._watcher)
            self._watcher = None
        if self.shadow is not None:
            await self.shadow.stop()
        await self.sender.drain()
        self.sender.close()

    async def _watch(self) -> None:
        trust_after = 0.0  # after a Redis outage, instances need one TTL to register again
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            if not self.generations:
                continue
            try:
                alive = {info.id for info in await self.live.get()}
                # after an outage, or another Redis found answering (a failover): instances need one
                # TTL to register again
                if time.monotonic() < max(trust_after, self.reader.changed_at + self.settings.ttl_s):
                    continue
                if self._missing(alive):
                    if not await self.reader.confirm_primary():  # not the Redis it knew: no evidence
                        trust_after = time.monotonic() + self.settings.ttl_s
                        continue
                    self.live.invalidate()  # read again, after the check, before blaming anyone
                    alive = {info.id for info in await self.live.get()}
                self.check_instances(alive)
            except ControlPlaneError as e:  # the OutboxReader reports a lasting outage to every request
                logger.debug("watcher could not read the live set: %s", e)
                trust_after = time.monotonic() + self.settings.ttl_s
            except Exception:
                logger.exception("watcher failed; continuing")

    def _missing(self, alive: Collection[str]) -> bool:
        """Whether some generation waits on an instance not in ``alive``."""
        return any(i not in alive for gen in self.generations.values() for i in gen.watched)

    def check_instances(self, alive: Collection[str]) -> None:
        """Fail (or retry, or migrate) every generation that waits on an instance not in ``alive``,
        or on one that has sent it nothing for ``stall_timeout_s`` once its tokens flowed."""
        stalled_before = time.monotonic() - self.settings.stall_timeout_s
        for gen in list(self.generations.values()):
            for instance_id in gen.watched:
                if instance_id not in alive:
                    gen.lost(instance_id, "stopped responding")
                    break
            else:
                if gen.has_tokens and gen.watched and gen.progress_at() < stalled_before:
                    gen.lost(gen.watched[-1], f"sent nothing for {self.settings.stall_timeout_s:g} s")
