"""The table of KV transports: what --kv-transfer offers, writers by a peer's registration, and a
third transport added as one class and one table entry."""

from __future__ import annotations

import logging
import uuid
from typing import Any, ClassVar

import numpy as np
import pytest

from pdserve.cache_transfer import shm
from pdserve.cache_transfer.base import KVTransport, LocalCache, TransportBackend
from pdserve.cache_transfer.cuda_ipc import CudaIpcBackend
from pdserve.cache_transfer.mooncake import MooncakeBackend
from pdserve.cache_transfer.regions import block_regions
from pdserve.cache_transfer.shm import ShmBackend, ShmWriter
from pdserve.cache_transfer.transports import (
    KV_TRANSFERS,
    TRANSPORTS,
    close_backends,
    configured,
    open_backends,
    open_writer,
)
from pdserve.errors import ConfigError, TransferError

BLOCK = 64


class LoopWriter(KVTransport):
    protocol = "loop"

    def __init__(self, dst: np.ndarray) -> None:
        self.dst = dst

    def write(self, src: np.ndarray, segments: list[tuple[int, int, int]]) -> int:
        for s, d, n in segments:
            self.dst[d : d + n] = src[s : s + n]
        return sum(n for _, _, n in segments)


class LoopBackend(TransportBackend):
    """A third transport, in-process: the endpoint is a key into CACHES."""

    protocol = "loop"
    CACHES: ClassVar[dict[str, np.ndarray]] = {}
    opened: ClassVar[list[LoopBackend]] = []

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.key, self.closed = fail, None, False

    @classmethod
    def from_options(cls, options: Any) -> LoopBackend:
        return cls(fail=bool(options.get("loop_fail")))

    def open(self, local: LocalCache) -> None:
        if self.fail:
            raise ConfigError("loop cannot open")
        self.key = uuid.uuid4().hex
        self.CACHES[self.key] = local.view
        self.opened.append(self)

    def endpoint(self) -> dict[str, str] | None:
        return {"key": self.key} if self.key else None

    def writer(self, peer: Any) -> KVTransport:
        return LoopWriter(self.CACHES[peer["key"]])

    def close(self) -> None:
        self.CACHES.pop(self.key or "", None)
        self.closed = True


@pytest.fixture
def loop(monkeypatch):
    """LoopBackend registered: the one line a new transport adds."""
    monkeypatch.setitem(TRANSPORTS, "loop", LoopBackend)
    LoopBackend.opened.clear()
    return LoopBackend


def test_the_choices_of_kv_transfer_come_from_the_table() -> None:
    assert KV_TRANSFERS == ("auto", "shm", "mooncake", "cuda_ipc", "both")
    assert dict(TRANSPORTS) == {"shm": ShmBackend, "mooncake": MooncakeBackend, "cuda_ipc": CudaIpcBackend}
    assert configured("shm") == ["shm"] and configured("mooncake") == ["mooncake"]
    assert configured("both") == ["shm", "mooncake"]  # every one that moves a cache in host memory
    assert configured("both", {"device": "cuda"}) == ["mooncake", "cuda_ipc"]  # ... or on a GPU (staged)
    assert configured("cuda_ipc", {"device": "cuda"}) == ["cuda_ipc"]
    with pytest.raises(ConfigError, match="--kv-transfer must be one of auto, shm, mooncake, cuda_ipc, both"):
        configured("carrier-pigeon")


@pytest.mark.parametrize(
    "choice, device, says",
    [
        ("shm", "cuda", "the shm transport copies KV caches in host memory, and this instance's is on cuda"),
        ("cuda_ipc", "cpu", "cuda_ipc moves KV caches in GPU memory, and this instance's is on cpu"),
    ],
)
def test_a_transport_named_for_a_cache_it_cannot_move_is_refused(choice: str, device: str, says: str) -> None:
    """``--kv-transfer shm`` on a GPU instance (or cuda_ipc on a CPU one) stops the worker at start
    with the reason, rather than advertise a transport that cannot move its cache."""
    with pytest.raises(ConfigError, match=f"--kv-transfer {choice}: .*{says}"):
        configured(choice, {"device": device})
    view = np.zeros(BLOCK, np.uint8)
    with pytest.raises(ConfigError, match=says):  # and the backend refuses to open over it
        TRANSPORTS[choice]().open(LocalCache(view, device=device, block_bytes=BLOCK))


def test_auto_leaves_out_what_this_host_cannot_run_and_says_why(monkeypatch, caplog) -> None:
    monkeypatch.setattr(MooncakeBackend, "unavailable", classmethod(lambda cls: "no wheel here"))
    with caplog.at_level(logging.INFO, logger="pdserve.cache_transfer.transports"):
        assert configured("auto") == ["shm"]
    assert "mooncake left out (--kv-transfer auto): no wheel here" in caplog.text
    monkeypatch.setattr(MooncakeBackend, "unavailable", classmethod(lambda cls: None))
    assert configured("auto", {"transfer_address": "10.0.0.2"}) == ["shm", "mooncake"]


def test_auto_offers_mooncake_only_where_its_address_is_given(monkeypatch, caplog) -> None:
    """Mooncake's ports listen on every interface, so ``auto`` opens them only when the operator
    named the private address (``--transfer-address``); ``--kv-transfer mooncake`` still forces it."""
    monkeypatch.setattr(MooncakeBackend, "unavailable", classmethod(lambda cls: None))
    with caplog.at_level(logging.INFO, logger="pdserve.cache_transfer.transports"):
        assert configured("auto") == ["shm"]
        assert configured("auto", {"transfer_address": ""}) == ["shm"]
    assert "mooncake left out (--kv-transfer auto): no --transfer-address given" in caplog.text
    assert configured("auto", {"transfer_address": "10.0.0.2"}) == ["shm", "mooncake"]
    assert configured("mooncake") == ["mooncake"] and configured("both") == ["shm", "mooncake"]


def test_a_writer_needs_a_known_protocol_offered_here_and_advertised_by_the_peer() -> None:
    with pytest.raises(
        TransferError,
        match=r"unsupported KV transfer protocol 'nvlink' \(supported: shm, mooncake, cuda_ipc\)",
    ):
        open_writer({}, "nvlink", {"nvlink": "x"})
    with pytest.raises(
        TransferError, match=r"this instance does not offer the shm transport \(--kv-transfer\)"
    ):
        open_writer({}, "shm", {"shm": "pdserve-x"})
    with pytest.raises(TransferError, match=r"peer advertises no shm endpoint \(transfer.endpoint.shm\)"):
        open_writer({"shm": ShmBackend()}, "shm", {"mooncake": {}})
    with pytest.raises(TransferError, match="peer advertises no shm endpoint"):
        open_writer({"shm": ShmBackend()}, "shm", None)


def test_shm_advertises_the_segment_of_a_shared_cache_and_writes_into_it() -> None:
    segment = shm.create_segment(f"pdserve-test-{uuid.uuid4().hex[:8]}", 8 * BLOCK)
    dst = np.ndarray((8 * BLOCK,), dtype=np.uint8, buffer=segment.buf)
    decode, prefill = ShmBackend(), ShmBackend()
    src = np.arange(8 * BLOCK, dtype=np.uint8)
    decode.open(LocalCache(dst, segment.name))
    prefill.open(LocalCache(src))  # a prefill's cache is not shared: nothing to advertise
    try:
        assert decode.endpoint() == segment.name and prefill.endpoint() is None
        writer = open_writer({"shm": prefill}, "shm", {"shm": decode.endpoint()})
        assert isinstance(writer, ShmWriter)
        assert (
            writer.write_blocks(src, block_regions([1, 2], BLOCK), block_regions([6, 0], BLOCK)) == 2 * BLOCK
        )
        assert np.array_equal(dst[6 * BLOCK : 7 * BLOCK], src[BLOCK : 2 * BLOCK])
        assert np.array_equal(dst[:BLOCK], src[2 * BLOCK : 3 * BLOCK])
        writer.close()
    finally:
        close_backends({"shm": decode, "shm2": prefill})
        del dst
        segment.close()
    assert decode.endpoint() is None


def test_a_third_transport_is_one_class_and_one_table_entry(loop) -> None:
    assert configured("loop") == ["loop"] and "loop" in configured("auto") and "loop" in configured("both")
    src, dst = np.full(4 * BLOCK, 7, np.uint8), np.zeros(4 * BLOCK, np.uint8)
    prefill = open_backends(["loop"], {}, LocalCache(src))
    decode = open_backends(["loop"], {}, LocalCache(dst))
    writer = open_writer(prefill, "loop", {"loop": decode["loop"].endpoint()})
    assert writer.write_blocks(src, block_regions([0], BLOCK), block_regions([3], BLOCK)) == BLOCK
    assert dst[3 * BLOCK :].tolist() == [7] * BLOCK and not dst[: 3 * BLOCK].any()
    close_backends(prefill | {"other": decode["loop"]})
    assert all(b.closed for b in loop.opened)


def test_when_one_backend_fails_to_open_those_already_open_are_closed(loop, monkeypatch) -> None:
    class Failing(LoopBackend):
        protocol = "failing"

        @classmethod
        def from_options(cls, options: Any) -> LoopBackend:
            return cls(fail=True)

    monkeypatch.setitem(TRANSPORTS, "failing", Failing)
    with pytest.raises(ConfigError, match="loop cannot open"):
        open_backends(["loop", "failing"], {}, LocalCache(np.zeros(BLOCK, np.uint8)))
    (opened,) = loop.opened
    assert opened.closed


def test_closing_goes_on_past_a_backend_that_fails_to_close(loop, caplog) -> None:
    class Stuck(LoopBackend):
        def close(self) -> None:
            raise RuntimeError("stuck")

    stuck, fine = Stuck(), LoopBackend()
    with caplog.at_level(logging.ERROR):
        close_backends({"stuck": stuck, "loop": fine})
    assert fine.closed and "closing the stuck transport failed" in caplog.text
