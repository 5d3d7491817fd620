"""Where Redis is and the client for it: a URL parsed into :class:`RedisSettings`, which makes the
asyncio client the rest of pdserve uses (:data:`RedisClient`), and :class:`ReplicaWait`, the setting
that makes writes wait for replicas. A reader follows URL → settings → client here, in that order;
what a client then says to its server is redis_server.py's.

Three deployments, one client type to the rest of pdserve: a single server (``redis://``,
``rediss://``, ``unix://``), a primary found through Redis Sentinel (``redis+sentinel://``: every new
connection asks the Sentinels where the primary is, so a failover needs no restart), and a Redis
Cluster (``redis+cluster://``: commands and pipelines are routed to the shard owning each key's slot).
URLs are shown in messages without their password (:func:`redact_url`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, TypeAlias
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry
from redis.sentinel import Sentinel as SyncSentinel

from pdserve.errors import ConfigError, ControlPlaneError

DEFAULT_URL = "redis://127.0.0.1:6379/0"
RedisClient: TypeAlias = "aioredis.Redis | aioredis.RedisCluster"
"""What :meth:`RedisSettings.connect` returns: a client of one server (direct or through Sentinel) or
of a Redis Cluster. pdserve uses only commands both route the same way (multi-key ones on one slot)."""
RedisPipeline: TypeAlias = "Pipeline | ClusterPipeline"
Mode = Literal["single", "sentinel", "cluster"]
SENTINEL_PORT = 26379
_SSL_CERT_REQS = ("none", "optional", "required")
_QUERY_OPTIONS = ("db", "ssl_cert_reqs", "ssl_ca_certs", "client_name")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_SCHEMES = "redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://"


@dataclasses.dataclass(frozen=True)
class RedisSettings:
    """Where Redis is and how to talk to it. Build one with :meth:`from_url`, then :meth:`connect`.

    ``socket_timeout_s`` must exceed every ``block_ms`` used with this client (the readers block
    for 1 s); a silent peer is then detected by the timeout or by TCP keepalive.
    """

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    ssl: bool = False
    ssl_cert_reqs: str = "required"
    ssl_ca_certs: str | None = None
    unix_socket_path: str | None = None
    mode: Mode = "single"
    nodes: tuple[tuple[str, int], ...] = ()
    """The Sentinels (``mode="sentinel"``) or the cluster's startup nodes (``mode="cluster"``)."""
    service_name: str = ""
    """The primary's name the Sentinels monitor (``sentinel monitor <name> ...``)."""
    sentinel_username: str | None = None
    sentinel_password: str | None = dataclasses.field(default=None, repr=False)
    client_name: str | None = None
    socket_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    health_check_interval_s: int = 15
    retries: int = 3
    retry_base_s: float = 0.05
    retry_cap_s: float = 1.0
    max_connections: int | None = None

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisSettings:
        """Parse a Redis URL. User and password may be percent-encoded in every form.

        - ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS), ``unix:///path``;
        - ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]``: the
          Sentinels (port 26379 unless given) and the name of the primary they monitor; the password
          is the data nodes'; Sentinels that want one of their own take ``sentinel_password`` (and
          ``sentinel_username``) in the query;
        - ``redis+cluster://[[user]:password@]host[:port][,host[:port]...]``: some of the cluster's
          nodes (the client discovers the rest); a cluster has only db 0.

        Query options: ``db``, ``ssl_cert_reqs`` (none|optional|required), ``ssl_ca_certs``,
        ``client_name``.
        """
        scheme, sep, rest = url.partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster"):
            hint = (
                " (TLS to a Sentinel or a Cluster is not supported yet)"
                if scheme.startswith("rediss+")
                else ""
            )
            raise ConfigError(
                f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)!r}: use {_SCHEMES}{hint}"
            )
        if scheme in ("redis+sentinel", "redis+cluster"):
            return cls._from_nodes_url(url, scheme, rest, overrides)
        parts = urlsplit(url)
        query = _query(parts.query, _QUERY_OPTIONS)
        fields: dict[str, Any] = _credentials(parts.username, parts.password)
        if scheme == "unix":
            if not parts.path:
                raise ConfigError(f"unix:// Redis URL needs a socket path: {redact_url(url)!r}")
            fields["unix_socket_path"] = parts.path
        else:
            try:
                port = parts.port
            except ValueError:
                raise ConfigError(f"bad port in Redis URL {redact_url(url)!r}") from None
            fields.update(host=parts.hostname or "127.0.0.1", port=port or 6379, ssl=scheme == "rediss")
            db_path = parts.path.strip("/")
            if db_path:
                query.setdefault("db", db_path)
        fields.update(_query_fields(query, url))
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def _from_nodes_url(cls, url: str, scheme: str, rest: str, overrides: dict[str, Any]) -> RedisSettings:
        """``redis+sentinel://`` and ``redis+cluster://``: a comma-separated list of nodes."""
        netloc, _, path = rest.partition("/")
        path, _, query_string = path.partition("?")
        if "?" in netloc:
            netloc, _, query_string = netloc.partition("?")
        sentinel = scheme == "redis+sentinel"
        query = _query(query_string, _QUERY_OPTIONS + (_SENTINEL_OPTIONS if sentinel else ()))
        userinfo, at, hosts = netloc.rpartition("@")
        fields: dict[str, Any] = {}
        if at:
            user, colon, password = userinfo.partition(":")
            fields = _credentials(user or None, password if colon else None)
        default_port = SENTINEL_PORT if sentinel else 6379
        fields["nodes"] = tuple(_node(item, default_port, url) for item in hosts.split(","))
        fields["host"], fields["port"] = fields["nodes"][0]
        segments = [part for part in path.split("/") if part]
        if sentinel:
            if not segments:
                raise ConfigError(
                    f"redis+sentinel:// URL needs the monitored primary's name as its path "
                    f"(redis+sentinel://host:port/<service>[/db]): {redact_url(url)!r}"
                )
            if len(segments) > 2:
                raise ConfigError(f"redis+sentinel:// URL path is /<service>[/db]: {redact_url(url)!r}")
            fields["service_name"] = unquote(segments[0])
            if len(segments) == 2:
                query.setdefault("db", segments[1])
            for name in _SENTINEL_OPTIONS:
                if name in query:
                    fields[name] = query.pop(name)
        else:
            if len(segments) > 1 or (segments and segments[0] != "0") or query.get("db", "0") != "0":
                raise ConfigError(f"a Redis Cluster has only db 0: {redact_url(url)!r}")
        fields["mode"] = "sentinel" if sentinel else "cluster"
        fields.update(_query_fields(query, url))
        fields.update(overrides)
        return cls(**fields)

    @property
    def display_url(self) -> str:
        """The address for logs and error messages, without the password."""
        user = f"{self.username}@" if self.username else ""
        if self.password:
            user = f"{self.username or ''}:***@"
        if self.unix_socket_path:
            return f"unix://{user}{self.unix_socket_path}?db={self.db}"
        nodes = ",".join(_join_host(host, port) for host, port in self.nodes)
        if self.mode == "sentinel":
            return f"redis+sentinel://{user}{nodes}/{self.service_name}/{self.db}"
        if self.mode == "cluster":
            return f"redis+cluster://{user}{nodes}"
        return f"{'rediss' if self.ssl else 'redis'}://{user}{_join_host(self.host, self.port)}/{self.db}"

    def connect(self) -> RedisClient:
        """A pooled asyncio client (bytes responses) that retries connection errors with backoff.

        A command whose reply was lost may run twice after a retry; inbox consumers therefore
        treat ``(request_id, attempt)`` as the identity of a request. Through Sentinel each new
        connection asks where the primary is, and a connection to a demoted primary (READONLY) is
        dropped, so after a failover the retries reach the new primary.
        """
        kwargs: dict[str, Any] = {
            "username": self.username,
            "password": self.password,
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_keepalive": True,
            "health_check_interval": self.health_check_interval_s,
            "retry": Retry(ExponentialBackoff(cap=self.retry_cap_s, base=self.retry_base_s), self.retries),
            "retry_on_error": [ConnectionError, RedisTimeoutError],
            "decode_responses": False,
            "client_name": self.client_name,
        }
        if self.mode == "cluster":
            nodes = [ClusterNode(host, port) for host, port in self.nodes]
            # max_connections is per node here (redis-py's default 100 when unset)
            limit: dict[str, Any] = {"max_connections": self.max_connections} if self.max_connections else {}
            return aioredis.RedisCluster(startup_nodes=nodes, **kwargs, **limit)
        kwargs.update(db=self.db, max_connections=self.max_connections)
        if self.mode == "sentinel":
            sentinels = Sentinel(
                list(self.nodes),
                sentinel_kwargs={
                    "retry": Retry(NoBackoff(), 0),  # the data connection's retries ask them again
                    "username": self.sentinel_username,
                    "password": self.sentinel_password,
                    "socket_timeout": self.connect_timeout_s,
                    "socket_connect_timeout": self.connect_timeout_s,
                    "socket_keepalive": True,
                    "decode_responses": False,
                },
            )
            return sentinels.master_for(self.service_name, redis_class=aioredis.Redis, **kwargs)
        if self.unix_socket_path:
            kwargs.pop("socket_keepalive")
            kwargs["unix_socket_path"] = self.unix_socket_path
        else:
            kwargs.update(host=self.host, port=self.port)
            if self.ssl:
                kwargs.update(ssl=True, ssl_cert_reqs=self.ssl_cert_reqs, ssl_ca_certs=self.ssl_ca_certs)
        return aioredis.Redis(**kwargs)

    def connect_sync(self) -> redis.Redis:
        """A blocking client for rq (the Batch API's job queue), which speaks only redis-py's
        synchronous API; ConfigError for a cluster, which rq does not support."""
        if self.mode == "cluster":
            raise ConfigError(
                "the Batch API runs on rq, which does not support Redis Cluster: use a single Redis "
                "or redis+sentinel://"
            )
        kwargs: dict[str, Any] = {
            "username": self.username,
            "password": self.password,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_keepalive": True,
            "health_check_interval": self.health_check_interval_s,
            "retry": SyncRetry(
                ExponentialBackoff(cap=self.retry_cap_s, base=self.retry_base_s), self.retries
            ),
            "retry_on_error": [ConnectionError, RedisTimeoutError],
            "client_name": self.client_name,
            "db": self.db,
        }
        if self.mode == "sentinel":
            sentinels = SyncSentinel(
                list(self.nodes),
                sentinel_kwargs={
                    "retry": SyncRetry(NoBackoff(), 0),
                    "username": self.sentinel_username,
                    "password": self.sentinel_password,
                    "socket_timeout": self.connect_timeout_s,
                    "socket_connect_timeout": self.connect_timeout_s,
                },
            )
            return sentinels.master_for(self.service_name, **kwargs)
        if self.unix_socket_path:
            kwargs.pop("socket_keepalive")
            return redis.Redis(unix_socket_path=self.unix_socket_path, **kwargs)
        if self.ssl:
            kwargs.update(ssl=True, ssl_cert_reqs=self.ssl_cert_reqs, ssl_ca_certs=self.ssl_ca_certs)
        return redis.Redis(host=self.host, port=self.port, **kwargs)


def _query(query_string: str, known: tuple[str, ...]) -> dict[str, str]:
    query = {k: v[-1] for k, v in parse_qs(query_string).items()}
    unknown = sorted(set(query) - set(known))
    if unknown:
        raise ConfigError(f"unknown Redis URL option {unknown[0]!r}; known: {', '.join(known)}")
    return query


def _query_fields(query: dict[str, str], url: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if "db" in query:
        fields["db"] = _parse_db(query["db"], url)
    if "ssl_cert_reqs" in query:
        reqs = query["ssl_cert_reqs"].lower()
        if reqs not in _SSL_CERT_REQS:
            raise ConfigError(f"ssl_cert_reqs must be one of {_SSL_CERT_REQS}, got {reqs!r}")
        fields["ssl_cert_reqs"] = reqs
    for name in ("ssl_ca_certs", "client_name"):
        if name in query:
            fields[name] = query[name]
    return fields


def _credentials(username: str | None, password: str | None) -> dict[str, Any]:
    return {
        "username": unquote(username) if username else None,
        "password": unquote(password) if password is not None else None,
    }


def _node(item: str, default_port: int, url: str) -> tuple[str, int]:
    """``host[:port]`` or ``[v6 address][:port]`` of a node list."""
    item = item.strip()
    if item.startswith("["):
        host, _, tail = item[1:].partition("]")
        port_text = tail.removeprefix(":")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ConfigError(f"empty host in the node list of Redis URL {redact_url(url)!r}")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ConfigError(f"bad port {port_text!r} in Redis URL {redact_url(url)!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"bad port {port} in Redis URL {redact_url(url)!r}")
    return host, port


def _join_host(host: str, port: object) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_db(value: str, url: str) -> int:
    try:
        db = int(value)
    except ValueError:
        raise ConfigError(f"Redis db must be a number, got {value!r} in {redact_url(url)!r}") from None
    if db < 0:
        raise ConfigError(f"Redis db must be >= 0, got {db}")
    return db


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: for banners, logs and status output."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    return re.sub(r"(?<=sentinel_password=)[^&]*", "***", f"{scheme}{sep}{netloc}{slash}{tail}")


@dataclasses.dataclass(frozen=True)
class ReplicaWait:
    """``WAIT replicas timeout_ms`` after a batch of writes, on the same connection in the same round
    trip: the writes count as done only once ``replicas`` replicas hold them, so a failover to one
    of those replicas keeps them (Redis replication is otherwise asynchronous). ``replicas`` 0: off.
    """

    replicas: int = 0
    timeout_ms: int = 500

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.timeout_ms < 1:
            raise ConfigError(
                f"--redis-wait-replicas must be >= 0 and --redis-wait-timeout-ms >= 1, "
                f"got {self.replicas} and {self.timeout_ms}"
            )

    def check_url(self, url: str) -> None:
        """A cluster pipeline spreads writes over shards; one WAIT cannot cover them all."""
        if self.replicas and url and RedisSettings.from_url(url).mode == "cluster":
            raise ConfigError(
                "--redis-wait-replicas needs one primary (redis://, redis+sentinel://): on a Redis Cluster "
                "each shard would need its own WAIT"
            )

    def stage(self, pipe: RedisPipeline) -> bool:
        """Queue the WAIT as the pipeline's last command; True if one was queued."""
        if self.replicas:
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms)
        return bool(self.replicas)

    def check(self, acknowledged: object, what: str) -> None:
        """Raise ControlPlaneError when WAIT's reply says fewer replicas than asked hold the writes."""
        if isinstance(acknowledged, BaseException):
            raise ControlPlaneError(f"Redis failed while {what}: {acknowledged}")
        if not isinstance(acknowledged, int) or acknowledged < self.replicas:
            raise ControlPlaneError(
                f"{what}: {acknowledged} of {self.replicas} replicas acknowledged within {self.timeout_ms} ms "
                "(a failover could lose it)"
            )


NO_WAIT = ReplicaWait()
WAIT_REPLICAS_HELP = (
    "make every inbox send and outbox publish wait until this many replicas hold it (Redis WAIT), so "
    "a Sentinel failover cannot lose a message already counted as sent; a write not replicated in time "
    "fails (retried). 0: off (default %(default)s)"
)
WAIT_TIMEOUT_HELP = "how long --redis-wait-replicas waits, in ms (default %(default)s)"
