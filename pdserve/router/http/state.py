"""What one router app builds at startup and every endpoint shares: :class:`RouterState`.

Its own module so the endpoints (:mod:`.serving`, :mod:`.tokenize`, :mod:`.app`) all depend on it
and it on none of them.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from pdserve.batchstore.batch_queue import BatchQueue
from pdserve.batchstore.batches import BatchStore
from pdserve.batchstore.files import FileStore
from pdserve.batchstore.reindex import reindex
from pdserve.errors import ConfigError, PdserveError
from pdserve.router.api.errors import NoCapacityError
from pdserve.router.http.admission import Admission
from pdserve.router.http.metrics import RouterMetrics
from pdserve.router.http.settings import RouterSettings
from pdserve.router.http.traffic import TrafficWindow
from pdserve.router.routing.dispatch import Dispatcher
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.outbox_reader import OutboxReader
from pdserve.scheduler.redis_client import RedisClient, RedisSettings
from pdserve.scheduler.redis_server import outage_limit_s, wait_for_redis
from pdserve.scheduler.registration import RouterInfo
from pdserve.scheduler.registry import Heartbeat, InstanceRegistry, LiveSetCache, RouterRegistry

logger = logging.getLogger(__name__)


class RouterState:
    """What the lifespan builds and every endpoint shares (one per app)."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.started_at = time.time()
        self.redis: RedisClient | None = None
        self.reader: OutboxReader | None = None
        self.heartbeat: Heartbeat[RouterInfo] | None = None
        self._dispatcher: Dispatcher | None = None
        self.files: FileStore | None = None
        self.batches: BatchStore | None = None
        self._batch_queue: BatchQueue | None = None
        self.metrics = RouterMetrics() if settings.metrics else None
        self._traffic: TrafficWindow | None = None  # what it served lately, with its registration
        self.admission = Admission(
            settings.max_in_flight, settings.max_queued, settings.first_token_timeout_s
        )

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            raise NoCapacityError("the router is starting or stopping")
        return self._dispatcher

    async def start(self) -> None:
        """Connect to Redis, start reading the outbox, register, and start the watcher."""
        s = self.settings
        try:
            self.redis = RedisSettings.from_url(s.redis_url, client_name=s.router_id).connect()
            await wait_for_redis(self.redis, s.redis_wait_s)
            keys = Keys(s.cluster)
            routers = RouterRegistry(self.redis, keys, s.ttl_s)
            if await routers.get(s.router_id) is not None:  # two readers would trim each other's outbox
                raise ConfigError(
                    f"--router-id {s.router_id} is registered by a live router; pick another id"
                )
            self.files = FileStore(
                self.redis, keys, s.max_file_bytes, s.file_ttl_s, s.files_dir or None, s.quotas
            )
            self.batches = BatchStore(self.redis, keys, quotas=s.quotas)
            try:  # what the old shared indexes listed goes to each owner's, once
                await reindex(self.redis, keys)
            except PdserveError as e:
                logger.warning(
                    "could not move the old file and batch indexes (tried again at the next start): %s", e
                )
            observe = self.metrics.on_redis if self.metrics is not None else None
            live = LiveSetCache(
                InstanceRegistry(self.redis, keys, s.ttl_s), s.live_set_max_age_s, observe=observe
            )
            # with replica waits, a failover to a replica of the primary loses nothing counted as sent
            waits = s.redis_wait_replicas > 0
            self.reader = OutboxReader(
                self.redis,
                keys,
                s.router_id,
                observe=observe,
                fail_after_s=await outage_limit_s(self.redis, waits),
                trust_failover=waits,
            )
            await self.reader.start()
            self.heartbeat = Heartbeat(routers, self._router_info)
            await self.heartbeat.start()
            dispatcher = Dispatcher(self.redis, keys, live, self.reader, s, metrics=self.metrics)
            if self.metrics is not None:
                self.metrics.watch_live(live)
            dispatcher.start()
            self._dispatcher = dispatcher
        except BaseException:
            await self.stop()
            raise
        logger.info("router %s ready on %s (cluster %s)", s.router_id, s.url, s.cluster)

    def batch_queue(self) -> BatchQueue:
        """The rq queue of batch jobs (its blocking client made on first use; ConfigError on a
        Redis Cluster, which rq does not support)."""
        if self._batch_queue is None:
            s = self.settings
            client = RedisSettings.from_url(s.redis_url, client_name=s.router_id).connect_sync()
            self._batch_queue = BatchQueue(client, Keys(s.cluster))
        return self._batch_queue

    async def stop(self) -> None:
        """Stop the watcher, fail what is still in flight, deregister, disconnect."""
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            await dispatcher.stop()
        if self.reader is not None:
            await self.reader.stop()
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.redis is not None:
            await self.redis.aclose()
        if self._batch_queue is not None:
            self._batch_queue.connection.close()

    def _router_info(self) -> RouterInfo:
        s = self.settings
        shadow = self._dispatcher.shadow if self._dispatcher is not None else None
        if self._traffic is None and self.metrics is not None:
            self._traffic = TrafficWindow(self.metrics, s.traffic_window_s)
        return RouterInfo(
            id=s.router_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            port=s.port,
            started_at=self.started_at,
            verify=shadow.info.model_copy() if shadow is not None else None,
            traffic=self._traffic.info() if self._traffic is not None else None,
        )
