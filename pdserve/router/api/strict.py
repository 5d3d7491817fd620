"""The base of every request model: unknown fields and loose types are refused, not ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A request object: an unknown field, or ``"5"``/``true`` for a number, fails validation
    (a 400 naming the field), so a client never believes pdserve honoured what it ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)
