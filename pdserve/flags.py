"""Command-line flags whose defaults come from ``PDSERVE_<FLAG>`` environment variables.

Shared by ``pdserve.cli`` and ``pdserve.router.http.settings``; imports nothing from pdserve, so any
layer may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def env(name: str, default: Any = None, kind: Callable[[str], Any] = str) -> Any:
    """Default for a flag from ``PDSERVE_<NAME>``; a malformed value names the variable."""
    raw = os.environ.get(f"PDSERVE_{name}")
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(
            f"pdserve: error: environment variable PDSERVE_{name}={raw!r} is not a valid {kind.__name__}"
        ) from None


def add_flag(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    kind: Callable[[str], Any],
    default: Any,
    help: str,
    **kw: Any,
) -> None:
    """``--some-flag`` defaulting from ``PDSERVE_SOME_FLAG``, which its help names."""
    var = _var(name)
    p.add_argument(name, type=kind, default=env(var, default, kind), help=f"{help} [env PDSERVE_{var}]", **kw)


def boolean(raw: str) -> bool:
    """A flag or variable value: 1/true/yes/on or 0/false/no/off."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


# ---- flags declared on settings dataclasses ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Flag:
    """How a settings field appears on the command line (``dataclasses.field(metadata={"flag": ...})``)."""

    help: str
    name: str | None = None  # default: --<field name without a trailing _s, dashes for underscores>
    kind: Callable[[str], Any] | None = None  # default: the type of the field's default
    choices: Sequence[str] | None = None


def setting(default: Any, help: str, *, repr: bool = True, **flag: Any) -> Any:
    """A settings field with its one default and the flag (and ``PDSERVE_*`` variable) made from it."""
    if default is None and flag.get("kind") is None:
        raise TypeError("a flag whose default is None needs kind=")
    return dataclasses.field(default=default, repr=repr, metadata={"flag": Flag(help, **flag)})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field, Flag, str]]:
    """``(field, flag, --name)`` of each field of ``cls`` that has a flag, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("flag")
        if spec is not None:
            name = spec.name or "--" + f.name.removesuffix("_s").replace("_", "-")
            out.append((f, spec, name))
    return out


def add_flags(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, exclude: Sequence[str] = ()
) -> None:
    """One flag per flagged field of ``cls`` (dest: the field's name), defaults from the field."""
    for f, spec, name in flag_fields(cls):
        if f.name in exclude:
            continue
        if f.default is True or f.default is False:
            p.add_argument(
                name,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=env(_var(name), f.default, boolean),
                help=f"{spec.help} [env PDSERVE_{_var(name)}]",
            )
            continue
        kind = spec.kind or type(f.default)
        choices = list(spec.choices) if spec.choices else None
        add_flag(
            p,
            name,
            kind,
            f.default,
            spec.help,
            dest=f.name,
            metavar=None if choices else _var(name),
            choices=choices,
        )


def from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """An instance of ``cls`` from the parsed flags of its fields (``values`` win)."""
    given = {f.name: getattr(args, f.name) for f, _, _ in flag_fields(cls) if hasattr(args, f.name)}
    return cls(**(given | values))


def to_argv(settings: Any) -> list[str]:
    """The flags that rebuild ``settings`` in a child process: every flagged value that is set, so
    that the child's own ``PDSERVE_*`` variables cannot override what the parent decided.

    Fields holding settings dataclasses themselves (e.g. a worker's engine) are expanded in place.
    """
    argv: list[str] = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value) and not f.metadata.get("flag"):
            argv += to_argv(value)
    for f, _, name in flag_fields(type(settings)):
        value = getattr(settings, f.name)
        if value is None or value == "":  # unset: the child works it out as the parent would have
            continue
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        else:
            argv += [name, str(value)]
    return argv


def _var(name: str) -> str:
    return name.lstrip("-").upper().replace("-", "_")
