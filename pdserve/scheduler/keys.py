"""Every Redis key pdserve uses, declared once (docs/design.md "Redis key schema" is the contract).

Registry keys share the hash tag ``{<cluster>}`` so the live-set read (ZRANGE + MGET) and the
register transaction stay on one Redis Cluster slot. Each stream carries its owner's id as hash
tag, so streams spread over the shards of a cluster while a stream and its dead-letter stream
share a slot.
"""

from __future__ import annotations

import re
from typing import Literal

PREFIX = "pdserve"
DEFAULT_CLUSTER = "default"
INBOX_GROUP = "engine"
"""Consumer group of every inbox stream."""

Kind = Literal["instance", "router"]
"""What a registry holds: inference instances or routers."""

KINDS: tuple[Kind, ...] = ("instance", "router")

# An id is a key component and a hash tag: no ':' (the separator), no braces (hash tag syntax),
# no whitespace or glob characters (so `redis-cli --scan --pattern` keeps working).
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+=-]{0,127}")


def validate_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it can be used as a key component, else raise ValueError naming it."""
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise ValueError(
            f"invalid {what} {value!r}: use 1-128 characters from [A-Za-z0-9._@+=-], starting with a "
            "letter or digit (no ':', braces, spaces or glob characters)"
        )
    return value


class Keys:
    """Builds the key names of one pdserve cluster (a namespace inside one Redis database)."""

    __slots__ = ("_reg", "cluster")

    def __init__(self, cluster: str = DEFAULT_CLUSTER) -> None:
        self.cluster = validate_id(cluster, "cluster name")
        self._reg = f"{PREFIX}:{{{cluster}}}"

    def __repr__(self) -> str:
        return f"Keys(cluster={self.cluster!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keys) and other.cluster == self.cluster

    def __hash__(self) -> int:
        return hash(self.cluster)

    # registry: `pdserve:{<cluster>}:<kind>:<id>` (string JSON, PX ttl) + `pdserve:{<cluster>}:<kind>s` (zset)

    def member(self, kind: Kind, member_id: str) -> str:
        """Registration key of one instance or router."""
        _check_kind(kind)
        return f"{self._reg}:{kind}:{validate_id(member_id, f'{kind} id')}"

    def index(self, kind: Kind) -> str:
        """Sorted set of registered ids of one kind, scored by the key's expiry (unix ms)."""
        _check_kind(kind)
        return f"{self._reg}:{kind}s"

    def instance(self, instance_id: str) -> str:
        return self.member("instance", instance_id)

    @property
    def instances(self) -> str:
        return self.index("instance")

    def router(self, router_id: str) -> str:
        return self.member("router", router_id)

    @property
    def routers(self) -> str:
        return self.index("router")

    # streams: hash tag = the owner's id

    def inbox(self, instance_id: str) -> str:
        """Stream of requests and control messages for one instance (consumer group ``engine``)."""
        return f"{PREFIX}:{self.cluster}:inbox:{{{validate_id(instance_id, 'instance id')}}}"

    def dead_letters(self, instance_id: str) -> str:
        """Stream of inbox entries that could not be decoded, kept for inspection (bounded, expiring)."""
        return f"{self.inbox(instance_id)}:dead"

    def outbox(self, router_id: str) -> str:
        """Stream of token/finish/error events for the requests of one router."""
        return f"{PREFIX}:{self.cluster}:outbox:{{{validate_id(router_id, 'router id')}}}"

    # per-instance and shared values

    def prefix_index(self, instance_id: str) -> str:
        """Set of the chain hashes (:mod:`pdserve.block_hash`) of the full KV blocks one instance's
        prefix cache holds; expires with the instance's registration (hash tag = the instance)."""
        return f"{PREFIX}:{self.cluster}:prefix:{{{validate_id(instance_id, 'instance id')}}}"

    def prefix_index_scratch(self, instance_id: str) -> str:
        """Where a full replacement of :meth:`prefix_index` is written before one RENAME (same slot)."""
        return f"{self.prefix_index(instance_id)}:new"

    def tokenizer(self, digest: str) -> str:
        """A model's tokenizer files as instances publish them for routers, by content digest."""
        return f"{PREFIX}:{self.cluster}:tokenizer:{{{validate_id(digest, 'tokenizer digest')}}}"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"invalid registry kind {kind!r}: expected one of {KINDS}")
