"""The Redis control plane shared by routers and workers: key schema, connection, message
schemas, registries (TTL liveness + cached live set) and the inbox/outbox streams.

It imports nothing from ``pdserve.router`` or ``pdserve.worker``; both depend on it. The names
below load their module on first use, so importing one light module (``keys``) does not load
redis-py.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "keys": (
        "DEFAULT_CLUSTER",
        "INBOX_GROUP",
        "Keys",
        "Kind",
        "validate_id",
    ),
    "inbox_messages": (
        "Abort",
        "DisaggregateInfo",
        "FetchBlocks",
        "FetchHint",
        "FetchedBlocks",
        "GenerateRequest",
        "InboxMessage",
        "PeerInfo",
        "PhaseDeadlines",
        "Prefilled",
        "ReserveBlocks",
        "ReserveReply",
        "SetRole",
        "Tokenize",
    ),
    "message_schema": (
        "SCHEMA_VERSION",
        "Role",
    ),
    "messages": (
        "Message",
        "decode_as",
        "decode_message",
        "encode",
    ),
    "outbox_messages": (
        "ANY_ATTEMPT",
        "ErrorInfo",
        "LogprobInfo",
        "RequestDelta",
        "StepOutput",
        "Timing",
        "TopLogprob",
        "Usage",
    ),
    "registration": (
        "DiskTierInfo",
        "FetchInfo",
        "InstanceInfo",
        "IdleCpuInfo",
        "IntegrityInfo",
        "KVInfo",
        "LoadInfo",
        "PoolInfo",
        "RatesInfo",
        "RoleChange",
        "RouterInfo",
        "SwitchOutcome",
        "TierInfo",
        "TrafficInfo",
        "TransferInfo",
        "VerifyInfo",
    ),
    "outbox_reader": ("OutboxReader",),
    "prefix_index": ("PrefixIndex",),
    "redis_client": ("RedisSettings",),
    "redis_server": (
        "MIN_REDIS_VERSION",
        "check_server_version",
        "redis_address",
        "redis_errors",
        "wait_for_redis",
    ),
    "registry": (
        "DEFAULT_TTL_S",
        "Heartbeat",
        "InstanceRegistry",
        "LiveSetCache",
        "Registry",
        "RouterRegistry",
    ),
    "streams": (
        "DEAD_LETTER_MAXLEN",
        "DEAD_LETTER_TTL_S",
        "INBOX_MAXLEN",
        "INBOX_TTL_S",
        "MAX_DELIVERIES",
        "OUTBOX_MAXLEN",
        "OUTBOX_TTL_S",
        "Entry",
        "Inbox",
        "Outbox",
        "send_to_inbox",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
# ruff RUF022's order: CONSTANTS, then Classes, then functions
__all__ = sorted(_MODULE_OF, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # next time without __getattr__
    return value


def __dir__() -> list[str]:
    return __all__
