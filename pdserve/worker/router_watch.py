"""Whether the routers an instance serves are still alive, and what is done about those that are gone:
their requests are aborted and they are told (retryable), their new work refused. A router is gone
once its registration key has been missing in every check for one TTL with Redis answering all
along (one missing read is no proof: Redis may have restarted or failed over). Mixed into
:class:`~pdserve.worker.handler.RequestHandler`, whose state it reads.
"""

from __future__ import annotations

import logging

from pdserve.errors import ControlPlaneError
from pdserve.scheduler import RouterRegistry
from pdserve.worker.handoff_context import Context
from pdserve.worker.messenger import Owner
from pdserve.worker.splitwise import Splitwise

log = logging.getLogger("pdserve.worker.handler")

ROUTER_CHECK_S = 1.0  # how often the liveness of the routers we serve is checked
FORGET_MISSING_ROUTER_S = 300.0  # a router missing this long with no work here is no longer tracked


class RouterWatch:
    """The router-liveness half of :class:`~pdserve.worker.handler.RequestHandler`."""

    ctx: Context
    routers: RouterRegistry
    owners: dict[str, Owner]
    splitwise: Splitwise
    _routers_seen: dict[str, float]
    _routers_missing_since: dict[str, float]

    def _forget(self, key: str) -> Owner | None:
        raise NotImplementedError  # RequestHandler's

    def control_plane_failed(self) -> None:
        """Redis failed us: a router's key found missing before now is no evidence that it died (a
        restarted or failed-over Redis lacks it until the router's next heartbeat)."""
        self._routers_missing_since.clear()

    async def _router_alive(self, router_id: str) -> bool:
        """Checked at most once a second per router while it is seen: new work of a router that is
        gone is refused."""
        if self.ctx.clock.monotonic() - self._routers_seen.get(router_id, float("-inf")) < ROUTER_CHECK_S:
            return True
        return router_id not in await self._routers_gone({router_id})

    async def _routers_gone(self, routers: set[str]) -> set[str]:
        """Those of ``routers`` whose key has been missing in every check for one TTL, with Redis
        answering all along: a live router renews its key every TTL/3, so one missing read is no
        proof (Redis may have restarted, or failed over to a replica the key had not reached)."""
        now = self.ctx.clock.monotonic()
        try:
            alive = await self.routers.alive(routers)
        except ControlPlaneError:
            self.control_plane_failed()
            return set()
        missing = self._routers_missing_since
        for router_id in alive:
            missing.pop(router_id, None)
            self._routers_seen[router_id] = now
        return {r for r in routers - alive if now - missing.setdefault(r, now) >= self.routers.ttl_s}

    async def _drop_orphans(self) -> None:
        """Abort the requests of routers that are gone, and tell those routers (retryable): if one is
        alive after all, its requests are retried or migrated rather than left waiting."""
        routers = {o.router_id for o in self.owners.values()} | self.splitwise.router_ids()
        now = self.ctx.clock.monotonic()
        self._routers_missing_since = {
            r: t
            for r, t in self._routers_missing_since.items()
            if r in routers or now - t < FORGET_MISSING_ROUTER_S
        }
        self._routers_seen = {r: t for r, t in self._routers_seen.items() if now - t < ROUTER_CHECK_S}
        if not routers:
            return
        gone = await self._routers_gone(routers)
        if not gone:
            return
        told: list[tuple[Owner, bool]] = []
        for key, owner in list(self.owners.items()):
            if owner.router_id in gone:
                log.info("router %s is gone: aborting %s", owner.router_id, owner.request_id)
                self._forget(key)
                await self.ctx.engine.abort(key, "router gone")
                told.append((owner, True))
        told += [(owner, True) for owner in await self.splitwise.drop_routers(gone)]
        await self.ctx.messenger.fail_many(told, self._router_gone_error())

    def _router_gone_error(self) -> ControlPlaneError:
        return ControlPlaneError(
            f"this request's router has not been registered in Redis for {self.routers.ttl_s:g} s;"
            f" instance {self.ctx.instance_id} dropped it"
        )
