"""Telling one instance to take a role, and waiting until its registration says how that went."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import cast

from pdserve.errors import ConfigError, NotFoundError, UnavailableError
from pdserve.scheduler import InstanceRegistry, Keys, Role, SetRole, SwitchOutcome, send_to_inbox
from pdserve.scheduler.redis_client import RedisClient

ROLES = ("prefill", "decode", "mixed")


async def switch_role(
    redis: RedisClient,
    keys: Keys,
    instance_id: str,
    role: str,
    reason: str | None = None,
    wait_s: float = 10.0,
) -> SwitchOutcome:
    """Send ``SetRole`` to a live instance and wait (up to ``wait_s``) for its registration to
    name this switch (``last_switch``): its outcome, done or refused with the reason. Raises
    NotFoundError for an instance that is not live, UnavailableError when it does not answer."""
    if role not in ROLES:
        raise ConfigError(f"a role is one of {', '.join(ROLES)}, not {role!r}")
    registry = InstanceRegistry(redis, keys)
    if await registry.get(instance_id) is None:
        raise NotFoundError(f"instance {instance_id} is not registered in cluster {keys.cluster}")
    switch_id = f"switch-{uuid.uuid4().hex[:12]}"
    msg = SetRole(request_id=switch_id, role=cast(Role, role), reason=reason)
    await send_to_inbox(redis, keys, instance_id, msg)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        info = await registry.get(instance_id)
        if info is not None and info.last_switch is not None and info.last_switch.id == switch_id:
            return info.last_switch
        await asyncio.sleep(0.1)
    raise UnavailableError(
        f"instance {instance_id} did not say within {wait_s:g} s whether it took the role {role} "
        "(an older pdserve does not know the message: it dead-letters it)"
    )
