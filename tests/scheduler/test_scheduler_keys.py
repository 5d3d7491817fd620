"""The key schema is a contract (docs/design.md): pin the literal strings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pdserve.scheduler as scheduler
from pdserve.scheduler import Keys


def test_literal_keys_of_the_default_cluster() -> None:
    k = Keys()
    assert k.instance("prefill-0") == "pdserve:{default}:instance:prefill-0"
    assert k.instances == "pdserve:{default}:instances"
    assert k.router("r-1a2b") == "pdserve:{default}:router:r-1a2b"
    assert k.routers == "pdserve:{default}:routers"
    assert k.inbox("decode-0") == "pdserve:default:inbox:{decode-0}"
    assert k.dead_letters("decode-0") == "pdserve:default:inbox:{decode-0}:dead"
    assert k.outbox("r-1a2b") == "pdserve:default:outbox:{r-1a2b}"


def test_literal_keys_of_a_named_cluster() -> None:
    k = Keys("prod.eu-1")
    assert k.instance("host1@8001") == "pdserve:{prod.eu-1}:instance:host1@8001"
    assert k.index("instance") == "pdserve:{prod.eu-1}:instances"
    assert k.member("router", "r1") == "pdserve:{prod.eu-1}:router:r1"
    assert k.index("router") == "pdserve:{prod.eu-1}:routers"
    assert k.inbox("p0") == "pdserve:prod.eu-1:inbox:{p0}"
    assert k.outbox("r1") == "pdserve:prod.eu-1:outbox:{r1}"


def test_registry_keys_share_the_cluster_hash_tag_and_streams_their_owner() -> None:
    k = Keys("c1")
    for key in (k.instance("a"), k.instances, k.router("b"), k.routers):
        assert key[key.index("{") + 1 : key.index("}")] == "c1"
    assert k.inbox("a").endswith("{a}")
    assert k.outbox("b").endswith("{b}")


@pytest.mark.parametrize("bad", ["", "a b", "x:y", "{x}", "a}", "*", "-lead", "é", "a" * 129, "a\n"])
def test_bad_ids_are_rejected_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid instance id") as info:
        Keys().instance(bad)
    assert repr(bad) in str(info.value)


def test_bad_cluster_name_and_kind() -> None:
    with pytest.raises(ValueError, match=r"invalid cluster name 'a:b'"):
        Keys("a:b")
    with pytest.raises(ValueError, match="invalid registry kind"):
        Keys().index("worker")  # type: ignore[arg-type]


def test_keys_equality() -> None:
    assert Keys("x") == Keys("x") and Keys("x") != Keys("y")
    assert len({Keys("x"), Keys("x")}) == 1


def _isort_key(name: str) -> tuple[int, str]:
    """ruff RUF022's order: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_public_api_is_sorted_and_importable() -> None:
    assert scheduler.__all__ == sorted(scheduler.__all__, key=_isort_key)
    for name in scheduler.__all__:
        assert hasattr(scheduler, name), name


def test_scheduler_imports_neither_router_nor_worker() -> None:
    for path in Path(scheduler.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            bad = [n for n in names if n.startswith(("pdserve.router", "pdserve.worker"))]
            assert not bad, f"{path.name} imports {bad}"
