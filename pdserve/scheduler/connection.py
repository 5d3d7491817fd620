"""Connecting to Redis: settings from a URL, a resilient asyncio client, a startup wait, and the one
place where redis-py errors become :class:`~pdserve.errors.ControlPlaneError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.errors import ConfigError, ControlPlaneError

logger = logging.getLogger(__name__)

MIN_REDIS_VERSION = (6, 2)
"""XAUTOCLAIM, XTRIM MINID, GETDEL and ZRANGE's BYSCORE/REV forms all arrived in Redis 6.2."""

DEFAULT_URL = "redis://127.0.0.1:6379/0"
RedisObserver = Callable[[str, "float | None", "BaseException | None"], None]
"""``observe(op, seconds, error)`` after a Redis round trip of the kind ``op``: its duration (None
where it is not a plain round trip, e.g. a blocking read) and the error that ended it, if any.
For metrics; it must be cheap and must not raise."""
_SSL_CERT_REQS = ("none", "optional", "required")
_QUERY_OPTIONS = ("db", "ssl_cert_reqs", "ssl_ca_certs", "client_name")


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
        """Parse ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS) or ``unix:///path``.

        Query options: ``db``, ``ssl_cert_reqs`` (none|optional|required), ``ssl_ca_certs``,
        ``client_name``. User and password may be percent-encoded.
        """
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(
                f"unsupported Redis URL scheme {parts.scheme!r} in {redact_url(url)!r}: "
                "use redis://, rediss:// or unix://"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = sorted(set(query) - set(_QUERY_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown Redis URL option {unknown[0]!r}; known: {', '.join(_QUERY_OPTIONS)}")
        fields: dict[str, Any] = {
            "username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password is not None else None,
        }
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
        return f"{'rediss' if self.ssl else 'redis'}://{user}{self.host}:{self.port}/{self.db}"

    def connect(self) -> aioredis.Redis:
        """A pooled asyncio client (bytes responses) that retries connection errors with backoff.

        A command whose reply was lost may run twice after a retry; inbox consumers therefore
        treat ``(request_id, attempt)`` as the identity of a request.
        """
        kwargs: dict[str, Any] = {
            "db": self.db,
            "username": self.username,
            "password": self.password,
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "health_check_interval": self.health_check_interval_s,
            "retry": Retry(ExponentialBackoff(cap=self.retry_cap_s, base=self.retry_base_s), self.retries),
            "retry_on_error": [ConnectionError, RedisTimeoutError],
            "decode_responses": False,
            "max_connections": self.max_connections,
            "client_name": self.client_name,
        }
        if self.unix_socket_path:
            kwargs["unix_socket_path"] = self.unix_socket_path
        else:
            kwargs.update(host=self.host, port=self.port, socket_keepalive=True)
            if self.ssl:
                kwargs.update(ssl=True, ssl_cert_reqs=self.ssl_cert_reqs, ssl_ca_certs=self.ssl_ca_certs)
        return aioredis.Redis(**kwargs)


def require_bytes_responses(client: aioredis.Redis) -> None:
    """Raise ValueError unless ``client`` returns bytes (``decode_responses=False``, as connect() makes)."""
    if client.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("pdserve's scheduler needs a Redis client with decode_responses=False")


def uses_tls(client: aioredis.Redis) -> bool:
    """Whether the client speaks TLS (a ``rediss://`` URL)."""
    return "SSL" in client.connection_pool.connection_class.__name__


def redis_address(client: aioredis.Redis) -> str:
    """Where a client points, for messages (never includes the password)."""
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


async def wait_for_redis(
    client: aioredis.Redis,
    timeout_s: float = 10.0,
    *,
    min_version: tuple[int, int] = MIN_REDIS_VERSION,
    max_delay_s: float = 1.0,
) -> str:
    """PING until Redis answers (logging each retry), then check its version; return the version.

    Raises ControlPlaneError when Redis is still unreachable after ``timeout_s``, rejects the
    credentials, or is older than ``min_version``.
    """
    where = redis_address(client)
    deadline = time.monotonic() + timeout_s
    delay = min(0.05, max_delay_s)
    attempts = 0
    while True:
        attempts += 1
        remaining = deadline - time.monotonic()
        try:
            await asyncio.wait_for(client.ping(), timeout=max(remaining, 0.05))
            break
        except (AuthenticationError, ResponseError) as e:
            raise ControlPlaneError(f"Redis at {where} refused the connection: {e}") from e
        except (RedisError, OSError, TimeoutError) as e:  # the builtin: asyncio's timeouts
            reason = str(e) or type(e).__name__
            if uses_tls(client) and (
                isinstance(e, (TimeoutError, RedisTimeoutError, ssl.SSLError)) or "SSL" in reason
            ):
                reason = (
                    f"the TLS handshake did not complete ({reason}): is {where} a TLS port? rediss:// needs "
                    "one; a plain Redis port takes redis://"
                )
            if time.monotonic() + delay >= deadline:
                raise ControlPlaneError(
                    f"Redis at {where} is unreachable after {timeout_s:g} s ({attempts} attempts): {reason}"
                ) from e
            logger.warning(
                "Redis at %s is not reachable (%s); retry %d in %.2f s", where, reason, attempts, delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
    return await check_server_version(client, min_version)


async def check_server_version(
    client: aioredis.Redis, min_version: tuple[int, int] = MIN_REDIS_VERSION
) -> str:
    """Return the server's version string; raise ControlPlaneError if it is older than ``min_version``.

    A server that forbids INFO (some managed services) is assumed recent enough, with a warning.
    """
    with redis_errors("reading the Redis server version"):
        try:
            info = await client.info("server")
        except ResponseError as e:
            logger.warning(
                "cannot check the version of Redis at %s (%s); assuming >= %s",
                redis_address(client),
                e,
                ".".join(map(str, min_version)),
            )
            return "unknown"
    version = str(info.get("redis_version", "0"))
    numbers = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2])
    if numbers < min_version:
        need = ".".join(map(str, min_version))
        raise ControlPlaneError(
            f"Redis at {redis_address(client)} is version {version}; pdserve needs >= {need} "
            "(XAUTOCLAIM, XTRIM MINID)"
        )
    return version


@contextlib.contextmanager
def redis_errors(action: str) -> Iterator[None]:
    """Translate redis-py errors raised inside the block into ControlPlaneError naming ``action``."""
    try:
        yield
    except RedisError as e:
        raise ControlPlaneError(f"Redis failed while {action}: {e or type(e).__name__}") from e


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
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable url>"
    if password is None:
        return url
    return url.replace(f":{password}@", ":***@", 1)
