"""Tenants: who a request comes from, as far as the router's API keys tell.

With API keys set (``--api-key``, ``--api-key-file``), a request's tenant is a digest of the key it
carried (:func:`key_digest`: the first 16 bytes of its SHA-256, in hex); the key itself is never
stored, sent or logged. Without keys every request is the one anonymous tenant (``""``). The router
puts the tenant in the ASGI scope (:data:`TENANT`) when it authorizes the request; the Batch API
records it as the owner of each file and batch (another tenant gets 404), and the generation
endpoints salt the prefix cache with it (:func:`tenant_salt`), so one tenant's prompt never shows
in another's ``cached_tokens``. A batch worker's in-process router has no keys: its runner names
the batch's owner in a header that only :class:`TrustedTenant`, the wrapper of that in-process app,
reads (a network client cannot set the scope key).
"""

from __future__ import annotations

import hashlib

from starlette.types import ASGIApp, Receive, Scope, Send

TENANT = "pdserve.tenant"
"""The ASGI scope key of the request's tenant (set by ``RouterApp``, or :class:`TrustedTenant`)."""
ANONYMOUS = ""
"""The tenant of every request to a router with no API keys."""
TENANT_HEADER = b"x-pdserve-tenant"
"""The header a batch worker's runner names a line's tenant in (read by :class:`TrustedTenant` only)."""
DIGEST_HEX = 32


def key_digest(key: bytes) -> str:
    """The tenant of an API key: the first 16 bytes of its SHA-256, hex (never the key itself)."""
    return hashlib.sha256(key).hexdigest()[:DIGEST_HEX]


def tenant_of(scope: Scope) -> str:
    """The request's tenant (anonymous when nothing set one)."""
    return str(scope.get(TENANT, ANONYMOUS))


def tenant_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The prefix-cache salt a request of ``tenant`` runs with, given the client's own
    ``cache_salt``: the anonymous tenant keeps the client's; a keyed tenant gets its digest (with
    a client salt: a digest of both), so its cached blocks are its own."""
    if not tenant:
        return cache_salt
    if cache_salt is None:
        return tenant
    return hashlib.sha256(f"{tenant}\0{cache_salt}".encode()).hexdigest()[:DIGEST_HEX]


class TrustedTenant:
    """An in-process app whose caller is trusted to name the tenant in :data:`TENANT_HEADER` (a
    batch worker's runner, sending a batch's lines as its owner). Never serve it on a socket."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            named = next((v for k, v in scope["headers"] if k == TENANT_HEADER), None)
            if named is not None:
                scope = {**scope, TENANT: named.decode("ascii", "replace")}
        await self.app(scope, receive, send)
