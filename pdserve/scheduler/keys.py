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
ANONYMOUS_OWNER = "anonymous"
"""Stands for the owner without an API key ("") in key names (a key digest is 32 hex digits)."""
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
        """Stream of inbox entries that could not be decoded, or whose handling crashed the instance
        ``--max-deliveries`` times, kept for inspection (bounded, expiring)."""
        return f"{self.inbox(instance_id)}:dead"

    def outbox(self, router_id: str) -> str:
        """Stream of token/finish/error events for the requests of one router."""
        return f"{PREFIX}:{self.cluster}:outbox:{{{validate_id(router_id, 'router id')}}}"

    # per-instance and shared values

    def prefix_index(self, instance_id: str, tier: str = "pool") -> str:
        """Set of the chain hashes (:mod:`pdserve.block_hash`) of the full KV blocks one instance
        holds in one tier: ``pool``, its prefix cache (the key without a suffix), or ``host``, the
        host tier below it (``…:host``); expires with the instance's registration (hash tag = the
        instance, so an instance's sets share a slot)."""
        key = f"{PREFIX}:{self.cluster}:prefix:{{{validate_id(instance_id, 'instance id')}}}"
        if tier == "pool":
            return key
        return f"{key}:{validate_id(tier, 'tier')}"

    def prefix_index_scratch(self, instance_id: str, tier: str = "pool") -> str:
        """Where a full replacement of :meth:`prefix_index` is written before one RENAME (same slot)."""
        return f"{self.prefix_index(instance_id, tier)}:new"

    def prefix_disk(self, tier_id: str) -> str:
        """Set of the chain hashes of the blocks one disk tier holds (``--kv-disk-path``: the files
        of one host's directory for one model namespace; ``tier_id`` from ``disk_tier.tier_id``),
        one set per tier, not per instance: written by whichever instance sharing it stored or
        removed a file, its expiry renewed by each of them (hash tag = ``disk:<tier_id>``, which no
        instance's tag can be: ids have no ':')."""
        return f"{PREFIX}:{self.cluster}:prefix:{{disk:{validate_id(tier_id, 'disk tier id')}}}"

    def prefix_disk_scratch(self, tier_id: str, writer: str) -> str:
        """Where one instance writes a full replacement of :meth:`prefix_disk` before one RENAME
        (its own name: two instances of a tier may replace it at once)."""
        return f"{self.prefix_disk(tier_id)}:new:{validate_id(writer, 'instance id')}"

    @property
    def plan(self) -> str:
        """Stream of the planner's decisions and their inputs (``pdserve plan``), newest last."""
        return f"{self._reg}:plan"

    def tokenizer(self, digest: str) -> str:
        """A model's tokenizer files as instances publish them for routers, by content digest."""
        return f"{PREFIX}:{self.cluster}:tokenizer:{{{validate_id(digest, 'tokenizer digest')}}}"

    # the Batch API: one hash tag per file or batch, so each object's keys (and the Lua scripts that
    # update them) stay on one cluster slot; the listing indexes live in the registry's slot

    def file(self, file_id: str) -> str:
        """A file's metadata (string JSON, expiring with the file)."""
        return f"{PREFIX}:{self.cluster}:file:{{{validate_id(file_id, 'file id')}}}"

    def file_content(self, file_id: str) -> str:
        """A file's bytes when files are kept in Redis (the default)."""
        return f"{self.file(file_id)}:content"

    def file_partial(self, file_id: str) -> str:
        """A file's bytes while they are being stored, piece by piece (expiring; renamed to
        :meth:`file_content` when complete)."""
        return f"{self.file(file_id)}:partial"

    def file_batches(self, file_id: str) -> str:
        """Set of the ids of the batches that read a file (it cannot be deleted while one is active)."""
        return f"{self.file(file_id)}:batches"

    @property
    def files(self) -> str:
        """The index of every owner's files, before each owner had its own (``owner_files``): read
        once, by ``batchstore.reindex``, and deleted."""
        return f"{self._reg}:files"

    def batch(self, batch_id: str) -> str:
        """A batch's record (string JSON, changed only by compare-and-set scripts)."""
        return f"{PREFIX}:{self.cluster}:batch:{{{validate_id(batch_id, 'batch id')}}}"

    def batch_results(self, batch_id: str) -> str:
        """Hash line number -> the line's output JSON (each line written once)."""
        return f"{self.batch(batch_id)}:out"

    def batch_errors(self, batch_id: str) -> str:
        """Hash line number -> the line's error JSON (each line written once, never in both hashes)."""
        return f"{self.batch(batch_id)}:err"

    def batch_chunks(self, batch_id: str) -> str:
        """Hash chunk number -> the id of the rq job that owns the chunk now."""
        return f"{self.batch(batch_id)}:chunks"

    def batch_finalize(self, batch_id: str) -> str:
        """Hash of a batch's failed tries at writing its output files (``tries``, ``retry_at``)."""
        return f"{self.batch(batch_id)}:finalize"

    def batch_lease(self, batch_id: str, chunk: int) -> str:
        """Held (short TTL, renewed) by the batch worker running a chunk; its absence means nobody is."""
        return f"{self.batch(batch_id)}:lease:{int(chunk)}"

    @property
    def batches(self) -> str:
        """The index of every owner's batches, before each owner had its own (``owner_batches``):
        read once, by ``batchstore.reindex``, and deleted."""
        return f"{self._reg}:batches"

    # an owner (a tenant: its API key's digest, or "" without keys) has its own indexes and usage,
    # on one slot (hash tag = the owner), so a listing or a quota check reads nothing of the others

    def owner(self, owner: str) -> str:
        """The prefix of an owner's keys (``anonymous`` stands for the owner without an API key)."""
        return f"{PREFIX}:{self.cluster}:owner:{{{validate_id(owner or ANONYMOUS_OWNER, 'owner')}}}"

    def owner_files(self, owner: str) -> str:
        """Sorted set of an owner's file ids, scored by creation time (ms): its listing."""
        return f"{self.owner(owner)}:files"

    def owner_file_expiry(self, owner: str) -> str:
        """Sorted set of an owner's file ids, scored by expiry (unix s): when its usage forgets them."""
        return f"{self.owner(owner)}:files:expiry"

    def owner_file_sizes(self, owner: str) -> str:
        """Hash file id -> bytes of an owner's files (its stored bytes are their sum)."""
        return f"{self.owner(owner)}:files:bytes"

    def owner_batches(self, owner: str) -> str:
        """Sorted set of an owner's batch ids, scored by creation time (ms): its listing."""
        return f"{self.owner(owner)}:batches"

    def owner_active(self, owner: str) -> str:
        """Set of an owner's batch ids not yet final (its batches in flight)."""
        return f"{self.owner(owner)}:batches:active"

    @property
    def owners(self) -> str:
        """Set of the owners that stored a file or made a batch (``pdserve status`` shows each)."""
        return f"{self._reg}:owners"

    @property
    def active_batches(self) -> str:
        """Set of the ids of batches not yet in a final state (what batch workers watch)."""
        return f"{self._reg}:batches:active"

    @property
    def batch_reaper_lock(self) -> str:
        """Held by the one batch worker that checks the active batches at a time."""
        return f"{self._reg}:batches:reaper"

    @property
    def batch_queue(self) -> str:
        """The rq queue name of this cluster's batch jobs (rq keys it as ``rq:queue:<name>``)."""
        return f"pdserve-batch-{self.cluster}"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"invalid registry kind {kind!r}: expected one of {KINDS}")
