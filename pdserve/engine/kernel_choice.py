"""How the engine picks a fast implementation or its fallback, the same way for ``--kernels``,
``--attention`` and ``--gemm``: a mode from a fixed list; the forced fast mode loads or fails with a
``ConfigError``; ``auto`` loads or falls back with one warning saying why, never a crash."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")


def check_mode(what: str, mode: str, modes: tuple[str, ...]) -> None:
    """Refuse a mode outside ``modes``, naming the flag and the variable that set it."""
    if mode not in modes:
        raise ConfigError(
            f"{what} (--{what.replace('_', '-')}, PDSERVE_{what.upper()}) must be one of {', '.join(modes)}, got {mode!r}"
        )


def load_or_fall_back(
    what: str,
    mode: str,
    load: Callable[[], T],
    errors: tuple[type[Exception], ...],
    unavailable: str,
    fallback: str,
) -> tuple[T | None, str]:
    """``load()``'s result and ``""``, or, when it raises one of ``errors``: in ``auto``, None and the
    reason (``unavailable`` and the error, then ``fallback``), logged once as a warning; in the forced
    mode, a ``ConfigError``."""
    try:
        return load(), ""
    except errors as e:
        if mode != "auto":
            raise ConfigError(f"{what}={mode}: {unavailable}: {e}") from e
        why = f"{unavailable} ({type(e).__name__}: {e}); {fallback}"
        log.warning("%s", why)
        return None, why
