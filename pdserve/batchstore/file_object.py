"""What a file of the Batch API is: OpenAI's file object (:class:`FileObject`, with the tenant that
owns it), its purposes, the default size and age limits, and the ids files and batches take. How
files are stored is files.py's.
"""

from __future__ import annotations

import secrets
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

Purpose = Literal["batch", "batch_output"]
PURPOSES: tuple[str, ...] = ("batch", "batch_output")
"""What a client may upload (``batch``) and what pdserve writes (a batch's output and error files)."""

DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024
DEFAULT_FILE_TTL_S = 30 * 24 * 3600
"""Thirty days, as OpenAI keeps a batch's output files."""
HOLD_GRACE_S = 3600
"""How long past its batch's expiry an input file is kept at least (an expiring batch's error file
names the lines that did not run by their ``custom_id``, read from the input file)."""


class FileObject(BaseModel):
    """OpenAI's file object."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: Purpose
    status: Literal["processed"] = "processed"
    owner: str = Field(default="", exclude=True)
    """The tenant that made it (a digest of its API key, ``router.http.tenants``; ``""``: anonymous).
    Stored with the metadata, never shown to clients."""

    def visible_to(self, owner: str | None) -> bool:
        """``owner`` may see the file (None: pdserve itself, which sees every file)."""
        return owner is None or self.owner == owner


def _stored(info: FileObject) -> bytes:
    """A file's metadata as Redis keeps it: the client's view plus the owner."""
    return orjson.dumps({**info.model_dump(mode="json"), "owner": info.owner})


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (``file-…``, ``batch_…``), valid as a key component."""
    return prefix + secrets.token_hex(12)
