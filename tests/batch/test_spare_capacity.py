"""The batch worker's spare-capacity gate: how many lines may be in flight for a live set."""

from __future__ import annotations

from pdserve.batch.runner import SpareCapacity
from pdserve.scheduler.messages import InstanceInfo
from tests.router_support import instance


def info(
    instance_id: str, role: str, running: int = 0, waiting: int = 0, background: int = 0, **kw
) -> InstanceInfo:
    i = instance(instance_id, role, running=running, waiting=waiting, **kw)
    i.load.background = background
    i.max_num_seqs = 16
    return i


GATE = SpareCapacity(state=None, max_load=0.5, concurrency=8, busy_concurrency=2)  # type: ignore[arg-type]


def test_idle_instances_take_the_full_concurrency() -> None:
    assert GATE.limit([info("m", "mixed")], "tiny") == 8
    assert GATE.limit([info("p", "prefill"), info("d", "decode", running=5, background=5)], "tiny") == 8


def test_online_work_anywhere_lowers_it() -> None:
    assert GATE.limit([info("m", "mixed", running=3, background=2)], "tiny") == 2
    assert GATE.limit([info("p", "prefill", waiting=1), info("d", "decode")], "tiny") == 2


def test_no_room_means_none() -> None:
    full = info("m", "mixed", running=6, waiting=2, background=8)  # 8 of 16 held: max_load 0.5
    assert GATE.limit([full], "tiny") == 0
    assert GATE.limit([info("p", "prefill"), info("d", "decode", running=8, background=8)], "tiny") == 0
    assert GATE.limit([info("p", "prefill")], "tiny") == 0  # a prefill instance alone cannot finish a line
    assert GATE.limit([info("m", "mixed", draining=True)], "tiny") == 0
    assert GATE.limit([info("m", "mixed", model="other")], "tiny") == 0
    assert GATE.limit([full, info("m2", "mixed")], "tiny") == 8
