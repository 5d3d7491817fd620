"""Fixtures of the worker tests."""

from __future__ import annotations

import uuid

import pytest
from redis_support import sync_client


@pytest.fixture
def cluster(redis_url):
    """A cluster name of the test's own in the shared Redis, its keys deleted afterwards."""
    name = f"w{uuid.uuid4().hex[:6]}"
    client = sync_client(redis_url)
    yield name
    for key in client.scan_iter(f"pdserve:{name}:*"):
        client.delete(key)
    client.close()
