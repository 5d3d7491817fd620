"""What an instance publishes about itself in Redis, for routers and the planner: its registration
(:meth:`Presence.info`, refreshed by the heartbeat and pushed at once on a drain or a role switch:
role, KV geometry, load, transports, tiers, integrity) and its model's tokenizer files. The base of
:class:`~pdserve.worker.service.WorkerService`, which builds what it reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from pdserve.engine.cpu.host_cpu import usable_cores
from pdserve.engine.outputs import EngineLoad
from pdserve.engine.tiers.disk_tier import tier_id
from pdserve.errors import ConfigError, ControlPlaneError
from pdserve.scheduler import (
    DiskTierInfo,
    IdleCpuInfo,
    InstanceInfo,
    InstanceRegistry,
    IntegrityInfo,
    Keys,
    KVInfo,
    LoadInfo,
    PoolInfo,
    RatesInfo,
    TierInfo,
    TransferInfo,
    redis_errors,
)
from pdserve.scheduler.redis_client import RedisClient
from pdserve.tokenizer import pack_tokenizer_files, read_tokenizer_files
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.handler import RequestHandler
from pdserve.worker.idle_cpu import IdleCpuMeter
from pdserve.worker.kv_writers import Transports
from pdserve.worker.settings import WorkerSettings

log = logging.getLogger("pdserve.worker.service")

TOKENIZER_TTL_S = 7 * 24 * 3600
"""Expiry of the published tokenizer files (``Keys.tokenizer``): every instance using them renews it
(:data:`TOKENIZER_REFRESH_S`), so they outlive the last such instance by at most this."""
TOKENIZER_REFRESH_S = 60.0
"""How often an instance renews its published tokenizer's expiry (and publishes it again if gone)."""


class Presence:
    """The registration and the tokenizer an instance publishes (:class:`WorkerService`'s base)."""

    settings: WorkerSettings
    id: str
    keys: Keys
    redis: RedisClient
    registry: InstanceRegistry
    started_at: float
    incarnation: str
    transports: Transports
    engine: EngineClient | None
    handler: RequestHandler | None
    tokenizer_digest: str | None
    _tokenizer_blob: bytes
    idle_cpu: IdleCpuMeter | None = None  # made by the first registration of a CPU instance

    @property
    def _shared_cache(self) -> bool:
        """The cache lives in shared memory, written by peers: a decode instance's, or any role's
        when it may become one (``--switchable``)."""
        return self.settings.role == "decode" or self.settings.switchable

    async def _publish_tokenizer(self) -> None:
        """Publish the model's tokenizer files for routers (they compute its prompts' token ids for
        prefix-cache routing), before the first registration names their digest.

        The key is the files' content digest, so the instances of one model share one value: it is
        written (``SET … EX`` :data:`TOKENIZER_TTL_S`) only when missing, and every
        :data:`TOKENIZER_REFRESH_S` each instance renews its expiry with one ``EXPIRE``, writing the
        value again if that finds it gone (Redis restarted or evicted it). The registration, renewed
        every heartbeat, only carries the digest: megabytes are sent at most once per start or loss.
        A failure here is logged, not fatal (routing works without it) and retried at the next
        renewal. The echo engine publishes nothing: its prompt ids are not its tokenizer's."""
        if self.settings.engine_kind == "echo":
            return
        model_dir = self.settings.model_dir
        assert model_dir is not None  # WorkerSettings requires it
        try:
            packed = await asyncio.to_thread(lambda: pack_tokenizer_files(read_tokenizer_files(model_dir)))
        except (ConfigError, OSError) as e:
            log.warning("not publishing the tokenizer for routers: %s", e)
            return
        self._tokenizer_blob, self.tokenizer_digest = packed
        try:
            await self._renew_tokenizer()
        except ControlPlaneError as e:
            log.warning("could not publish the tokenizer for routers (will retry): %s", e)

    async def _renew_tokenizer(self) -> None:
        """Renew the published tokenizer's expiry; publish it again when it is gone."""
        if self.tokenizer_digest is None:
            return
        key = self.keys.tokenizer(self.tokenizer_digest)
        with redis_errors("publishing the tokenizer"):
            if not await self.redis.expire(key, TOKENIZER_TTL_S):
                await self.redis.set(key, self._tokenizer_blob, ex=TOKENIZER_TTL_S)
                log.info("published the tokenizer for routers: %s (%d bytes)", key, len(self._tokenizer_blob))

    async def _push_heartbeat(self) -> None:
        """Publish the registration now (draining, a new role): routers see it within their
        live-set age instead of a heartbeat interval."""
        try:
            await self.registry.heartbeat(self.info())
        except ControlPlaneError as e:
            log.warning("could not publish the registration: %s", e)

    def info(self) -> InstanceInfo:
        """The registration the heartbeat refreshes, from the engine's last load snapshot."""
        assert self.engine is not None and self.handler is not None
        facts, load = self.engine.facts, self.engine.load
        roles = self.handler.roles
        return InstanceInfo(
            id=self.id,
            role=roles.role,
            model=self.settings.served_model_name,
            version="1",
            host=self.settings.host,
            pid=os.getpid(),
            started_at=self.started_at,
            kv=KVInfo(
                block_size=facts.block_size,
                num_blocks=facts.num_blocks,
                free_blocks=load.free_blocks,
                dtype=facts.dtype,
                layout=facts.layout,
                block_bytes=facts.block_bytes,
                num_layers=facts.num_layers,
                num_kv_heads=facts.num_kv_heads,
                head_dim=facts.head_dim,
                prefix_caching=facts.prefix_caching,
                weights=facts.weights,
                weights_digest=facts.weights_digest,
                batch_invariant=facts.batch_invariant,
                device=facts.device,
                device_name=facts.device_name,
                memory_bytes=facts.memory_bytes or None,
            ),
            load=load_info(load, self.handler.handing_off()),
            transfer=TransferInfo(
                protocols=[] if roles.role == "mixed" else self.protocols,  # a mixed one is never paired
                endpoint=self._endpoint() or None,
                incarnation=self.incarnation,
                writes=self.protocols or None,  # peers fetch blocks from it over these
            ),
            max_model_len=facts.max_model_len,
            draining=self.handler.draining,
            vocab_size=facts.vocab_size,
            max_num_seqs=self.settings.engine.max_num_seqs,
            tokenizer=self.tokenizer_digest,
            integrity=self._integrity(),
            tier=TierInfo(**dataclasses.asdict(load.tier)) if load.tier is not None else None,
            disk_tier=self._disk_tier_info(),
            pool=PoolInfo(hits=load.pool_hits, lookups=load.pool_lookups, evictions=load.pool_evictions)
            if facts.prefix_caching
            else None,
            rates=self._rates(),
            cpu=self._idle_cpu(facts.device),
            fetch=self.handler.fetches.info.model_copy() if self.handler.fetches.touched else None,
            switchable=self._shared_cache or None,  # a decode instance's start prepared every role
            roles=list(roles.history) or None,
            last_switch=roles.last_switch,
        )

    def _idle_cpu(self, device: str) -> IdleCpuInfo | None:
        """The host's idle CPUs lately, sampled now (None for a GPU instance: its capacity is its
        device's, and before two samples a second apart)."""
        if device != "cpu":
            return None
        if self.idle_cpu is None:
            self.idle_cpu = IdleCpuMeter(self.settings.engine.threads or usable_cores())
        return self.idle_cpu.sample()

    def _rates(self) -> RatesInfo | None:
        """What this instance measured lately (None before anything): the engine's prefill, decode
        and read-back rates from its last load snapshot, and per transport the seconds a block of its
        recent hand-offs took (the block's bytes over the rate ``Transports`` keeps for pacing)."""
        assert self.engine is not None
        load, block_bytes = self.engine.load, self.engine.facts.block_bytes
        transfer = {
            p: block_bytes / rate for p in self.transports.backends if (rate := self.transports.rate(p))
        }
        rates = RatesInfo(
            prefill_s_per_token=load.prefill_s_per_token,
            decode_s_per_token=load.decode_s_per_token,
            host_read_s_per_block=load.host_read_s_per_block,
            disk_read_s_per_block=load.disk_read_s_per_block,
            transfer_s_per_block=transfer or None,
            fetch_s_per_block=self.handler.fetches.rate.value if self.handler is not None else None,
        )
        return rates if rates.model_dump(exclude_none=True) else None

    @property
    def protocols(self) -> list[str]:
        """The KV transports this instance offers, in the order it prefers them."""
        return list(self.transports.backends)

    @property
    def disk_tier_id(self) -> str | None:
        """The id of the disk tier this instance shares (its host and directory), or None."""
        assert self.engine is not None
        directory = self.engine.facts.disk_tier
        return tier_id(self.settings.host, directory) if directory else None

    def _disk_tier_info(self) -> DiskTierInfo | None:
        """The disk tier's id, directory and counters, from the engine's last load snapshot."""
        assert self.engine is not None
        tier, directory = self.engine.load.disk, self.engine.facts.disk_tier
        if tier is None or directory is None or (tid := self.disk_tier_id) is None:
            return None
        return DiskTierInfo(id=tid, path=directory, **dataclasses.asdict(tier))

    def _integrity(self) -> IntegrityInfo | None:
        """A decode instance's KV checks so far (None before the first: nothing to show)."""
        assert self.handler is not None
        integrity = self.handler.ctx.integrity
        return integrity.model_copy() if integrity.kv_checked or integrity.kv_mismatches else None

    def _endpoint(self) -> dict[str, Any]:
        """Where peers write into this instance's cache: a decode instance's (its prefill peers), or
        any whose cache is shared (``--switchable``: peers write the blocks it fetches from them)."""
        if self.handler is None or not self._shared_cache:
            return {}
        endpoints = {protocol: b.endpoint() for protocol, b in self.transports.backends.items()}
        return {protocol: endpoint for protocol, endpoint in endpoints.items() if endpoint is not None}


def load_info(load: EngineLoad, handing_off: int) -> LoadInfo:
    """The load a heartbeat publishes: the engine's sequences, and the prefills handing off their
    KV apart (``handing_off``). Counted as ``waiting`` they looked like online work to the batch
    workers (no ``background`` flag covers them), which then ran at ``--busy-concurrency`` on every
    P/D stack, their own lines' hand-offs enough to keep it there."""
    return LoadInfo(
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        step_tokens=load.step_tokens,
        background=load.background,
        handing_off=handing_off,
    )
