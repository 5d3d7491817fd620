"""Same-host KV transfer between GPU caches over CUDA IPC: the prefill pushes its blocks straight
into the decode instance's cache, device to device (over NVLink/PCIe between two GPUs), no host copy.

A decode instance exports its cache allocation once (:func:`export_cache`) and advertises the
result as its ``cuda_ipc`` endpoint (:class:`CudaIpcEndpoint`: the IPC handle, where the cache
lies in the allocation, which host, GPU and process own it). A prefill instance opens that handle
once per decode incarnation (:class:`CudaIpcWriter`; the worker caches writers per peer) and, per
hand-off, turns the byte segments into block indices and copies all blocks with one
``index_select`` and one ``index_copy_`` on a side stream, synchronized before ``write`` returns,
so the bytes have landed when ``prefilled`` is sent.

Why torch's own IPC sharing (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``, what
``torch.multiprocessing`` uses) rather than ``cudaIpcGetMemHandle`` through cuda-python: the
caching allocator sub-allocates, so a handle names a whole ``cudaMalloc`` block and the cache an
offset in it, which only the allocator knows (``shareIpcHandle``); a handle may be opened once per
process and context, and torch's consumer side keeps one mapping per handle for the process
(``getIpcDevPtr``) and closes it when the last storage over it goes, so a writer reopened after a
drop never trips over a mapping another one still holds; the opened memory is a storage, hence a
tensor, without ``__cuda_array_interface__`` plumbing; and it covers expandable segments where
torch does. These two methods are private API (checked with torch 2.11): the GPU test
(``tests/cache_transfer/test_cuda_ipc.py``) is what pins them.

Trust model: as with ``shm``, any process of the host that gets the handle (and can use the GPU)
can write into the cache; the endpoint lives in Redis only and the router never serves the handle
over HTTP (``router.http.app.BUFFER_FIELDS``). torch is imported inside functions only: importing this
module (and ``transports``) loads no torch, and a CPU instance never does.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import importlib.util
import logging
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from pdserve.cache_transfer.base import CUDA, KVTransport, LocalCache, TransportBackend
from pdserve.cache_transfer.regions import Segment
from pdserve.errors import ConfigError, TransferError

log = logging.getLogger(__name__)

PROTOCOL = "cuda_ipc"
MAX_STAGING_BYTES = 256 << 20
"""Most bytes one gather stages on the prefill GPU: a longer hand-off is copied in chunks of whole
blocks (each chunk one index_select and one index_copy_), so a long prompt cannot run it out of memory."""


# ---- where a cache lives ------------------------------------------------------------------------
def host_id() -> str:
    """This kernel's boot id: the same for every process (and container) of one host, new at each
    boot, so a peer can tell an endpoint of another machine. The host name where it is unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def pid_namespace() -> int | None:
    """This process's PID namespace (its inode): a peer's pid means something here only when equal."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, name: str) -> bytes:
    try:
        return base64.b64decode(str(text), validate=True)
    except (binascii.Error, ValueError):
        raise TransferError(f"peer's cuda_ipc endpoint has a malformed {name}") from None


@dataclasses.dataclass(frozen=True)
class CudaIpcEndpoint:
    """What a prefill needs to open a decode instance's GPU cache (``transfer.endpoint.cuda_ipc``)."""

    handle: bytes  # torch's shareable handle of the allocation holding the cache
    storage_bytes: int  # size of the cache's storage
    storage_offset: int  # where that storage starts in the allocation
    view_offset: int  # where the cache's first byte is in its storage
    nbytes: int  # the cache's bytes: num_blocks * block_bytes
    block_bytes: int
    ref_counter: bytes  # torch's producer-side reference counter (a file in /dev/shm) and its slot
    ref_counter_offset: int
    event: bytes  # an IPC event the opener waits on: the cache's bytes are ready after it
    event_sync: bool
    device_uuid: str  # the GPU holding the cache, as any process (whatever CUDA_VISIBLE_DEVICES) names it
    pci_bus_id: str
    device_name: str
    host: str  # host_id() of the owner
    pid: int
    pid_namespace: int | None

    @property
    def num_blocks(self) -> int:
        return self.nbytes // self.block_bytes

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("handle", "ref_counter", "event"):
            out[name] = _b64(out[name])
        return out

    @classmethod
    def from_json(cls, data: Any) -> CudaIpcEndpoint:
        """The endpoint a peer advertises; TransferError when it is not one (an older or other writer)."""
        if not isinstance(data, Mapping):
            raise TransferError(f"peer's cuda_ipc endpoint is not an object: {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise TransferError(f"peer's cuda_ipc endpoint lacks {', '.join(missing)}")
        values = dict(data)
        for name in ("handle", "ref_counter", "event"):
            values[name] = _unb64(values[name], name)
        try:
            endpoint = cls(**{n: values[n] for n in names})
            ints = (endpoint.storage_bytes, endpoint.storage_offset, endpoint.view_offset, endpoint.nbytes)
            if any(not isinstance(v, int) or v < 0 for v in ints) or not endpoint.block_bytes > 0:
                raise ValueError("sizes")
            if endpoint.nbytes % endpoint.block_bytes or endpoint.view_offset + endpoint.nbytes > (
                endpoint.storage_bytes
            ):
                raise ValueError("extent")
        except (TypeError, ValueError) as e:
            raise TransferError(f"peer's cuda_ipc endpoint is inconsistent ({e})") from None
        return endpoint


# ---- the copy -----------------------------------------------------------------------------------
def segment_blocks(segments: list[Segment], block_bytes: int) -> tuple[list[int], list[int]]:
    """The source and destination block indices the byte ``segments`` cover, in order. Every
    segment must be whole blocks (a partial one would mean another geometry: TransferError)."""
    src: list[int] = []
    dst: list[int] = []
    for s, d, n in segments:
        if n <= 0 or s % block_bytes or d % block_bytes or n % block_bytes:
            raise TransferError(
                f"segment ({s}, {d}, {n}) is not whole blocks of {block_bytes} bytes "
                "(cuda_ipc copies blocks: the two caches' geometries differ?)"
            )
        k = n // block_bytes
        src.extend(range(s // block_bytes, s // block_bytes + k))
        dst.extend(range(d // block_bytes, d // block_bytes + k))
    return src, dst


def push_blocks(
    src: Any, dst: Any, src_blocks: list[int], dst_blocks: list[int], max_rows: int | None = None
) -> int:
    """Copy rows ``src_blocks`` of ``src`` into rows ``dst_blocks`` of ``dst`` (both
    ``[num_blocks, block_bytes]`` uint8 tensors on one device): one ``index_select`` and one
    ``index_copy_`` per chunk of at most ``max_rows`` rows (default: :data:`MAX_STAGING_BYTES`),
    never a copy per block. Indices are checked here, on the host: an index out of range on a
    GPU is a device-side assert that poisons the process's CUDA context. Returns bytes copied."""
    import torch

    if len(src_blocks) != len(dst_blocks):
        raise TransferError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    if src.shape[1] != dst.shape[1]:
        raise TransferError(f"block sizes differ: {src.shape[1]} vs {dst.shape[1]} bytes")
    for name, blocks, rows in (
        ("source", src_blocks, src.shape[0]),
        ("destination", dst_blocks, dst.shape[0]),
    ):
        if blocks and not (min(blocks) >= 0 and max(blocks) < rows):
            raise TransferError(f"{name} block {max(blocks)} outside a cache of {rows} blocks")
    if len(set(dst_blocks)) != len(dst_blocks):
        raise TransferError("a destination block is written twice")
    block_bytes = int(src.shape[1])
    step = max_rows or max(1, MAX_STAGING_BYTES // block_bytes)
    for i in range(0, len(src_blocks), step):
        s = torch.tensor(src_blocks[i : i + step], dtype=torch.int64, device=src.device)
        d = torch.tensor(dst_blocks[i : i + step], dtype=torch.int64, device=dst.device)
        dst.index_copy_(0, d, src.index_select(0, s))
    return len(src_blocks) * block_bytes


def as_blocks(flat: Any, block_bytes: int) -> Any:
    """A flat uint8 cache as ``[num_blocks, block_bytes]`` (the same memory)."""
    import torch

    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise TransferError("cuda_ipc moves a cache given as a flat torch.uint8 tensor")
    if not flat.is_contiguous() or flat.numel() % block_bytes:
        raise TransferError(f"a cache of {flat.numel()} bytes is not contiguous blocks of {block_bytes}")
    return flat.view(-1, block_bytes)


# ---- the two processes --------------------------------------------------------------------------
def device_identity(index: int) -> tuple[str, str, str]:
    """A CUDA device's UUID, PCI bus id and name (what any process can tell it by)."""
    import torch

    p = torch.cuda.get_device_properties(index)
    bus = [getattr(p, f"pci_{part}_id", 0) for part in ("domain", "bus", "device")]  # not in the stubs
    return str(p.uuid), f"{bus[0]:04x}:{bus[1]:02x}:{bus[2]:02x}.0", p.name


def export_cache(flat: Any, block_bytes: int) -> CudaIpcEndpoint:
    """Share a decode instance's flat CUDA cache: its endpoint (once per process: the storage is
    rewrapped for torch's IPC reference counting)."""
    as_blocks(flat, block_bytes)
    if not flat.is_cuda:
        raise ConfigError(f"cuda_ipc exports a CUDA cache, not one on {flat.device}")
    (
        _device,
        handle,
        storage_bytes,
        storage_offset,
        ref_counter,
        ref_counter_offset,
        event,
        event_sync,
    ) = flat.untyped_storage()._share_cuda_()
    uuid, pci, name = device_identity(flat.device.index)
    return CudaIpcEndpoint(
        handle=bytes(handle),
        storage_bytes=int(storage_bytes),
        storage_offset=int(storage_offset),
        view_offset=int(flat.storage_offset()),  # in bytes: the tensor is uint8
        nbytes=int(flat.numel()),
        block_bytes=block_bytes,
        ref_counter=bytes(ref_counter),
        ref_counter_offset=int(ref_counter_offset),
        event=bytes(event or b""),
        event_sync=bool(event_sync),
        device_uuid=uuid,
        pci_bus_id=pci,
        device_name=name,
        host=host_id(),
        pid=os.getpid(),
        pid_namespace=pid_namespace(),
    )


def open_cache(endpoint: CudaIpcEndpoint, device: Any) -> Any:
    """Map a peer's exported cache into this process, on ``device`` (this side's own GPU: memory
    on another GPU is reached through peer access): the peer's cache as a flat uint8 tensor.

    Call it with the stream the copies will run on as the current one: the opener waits there
    on the exporter's event. The mapping is closed when the last tensor over it is gone."""
    import torch

    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            endpoint.handle,
            endpoint.storage_bytes,
            endpoint.storage_offset,
            endpoint.ref_counter,
            endpoint.ref_counter_offset,
            endpoint.event,
            endpoint.event_sync,
        )
    except (RuntimeError, TypeError) as e:
        raise TransferError(
            f"cannot open the CUDA IPC handle of pid {endpoint.pid}'s KV cache on "
            f"{endpoint.device_name} ({endpoint.device_uuid}, PCI {endpoint.pci_bus_id}) from {device}: "
            f"{e} (the two GPUs must be peers (nvidia-smi topo -p2p w), and containers must share "
            "the IPC and PID namespaces)"
        ) from None
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    flat.set_(storage, endpoint.view_offset, (endpoint.nbytes,), (1,))
    return flat


class CudaIpcWriter(KVTransport):
    """Pushes blocks of this instance's GPU cache into one decode instance's, opened over CUDA IPC
    on the first write (on a worker thread: opening can take a while) and kept until closed."""

    protocol = PROTOCOL

    def __init__(self, peer: Any, local: LocalCache) -> None:
        self.peer = CudaIpcEndpoint.from_json(peer)
        if self.peer.host != host_id():
            raise TransferError(
                f"the decode instance's cache is on another host (boot id {self.peer.host}): cuda_ipc "
                "works between processes of one host (across hosts, mooncake)"
            )
        if local.block_bytes is not None and local.block_bytes != self.peer.block_bytes:
            raise TransferError(f"block sizes differ: {local.block_bytes} vs {self.peer.block_bytes} bytes")
        self.device = local.view.device
        self._dst: Any = None
        self._stream: Any = None
        self._lock = threading.Lock()

    def _open(self) -> tuple[Any, Any]:
        import torch

        with self._lock:
            if self._dst is None:
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    flat = open_cache(self.peer, self.device)
                self._dst, self._stream = as_blocks(flat, self.peer.block_bytes), stream
                log.info(
                    "opened pid %d's KV cache (%.0f MiB on %s, %s) over CUDA IPC on %s",
                    self.peer.pid,
                    self.peer.nbytes / 2**20,
                    self.peer.device_name,
                    self.peer.pci_bus_id,
                    self.device,
                )
            return self._dst, self._stream

    def write(self, src: Any, segments: list[Segment]) -> int:
        """Copy whole blocks of ``src`` (this instance's flat CUDA cache) into the peer's; returns
        when the bytes have landed."""
        import torch

        if not segments:
            return 0
        src_blocks, dst_blocks = segment_blocks(segments, self.peer.block_bytes)
        source = as_blocks(src, self.peer.block_bytes)
        dst, stream = self._open()
        # The prefilled blocks are complete: the engine read the first token back to the host after
        # the step that wrote them. The side stream lets the copy overlap the engine's next steps.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            moved = push_blocks(source, dst, src_blocks, dst_blocks)
        stream.synchronize()  # landed before the caller tells decode "prefilled"
        return moved

    def current(self) -> bool:
        """False once the owner is known to be gone (its pid is checkable in this PID namespace):
        a dead decode instance's GPU memory is freed only when every mapping of it is closed."""
        if self.peer.pid_namespace is None or self.peer.pid_namespace != pid_namespace():
            return True
        try:
            os.kill(self.peer.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self) -> None:
        self._dst = self._stream = None  # the last tensor over the mapping: torch closes it


class CudaIpcBackend(TransportBackend):
    """GPU to GPU on one host: a decode instance exports its CUDA cache once at start and advertises
    the handle; prefills open it and push their blocks with one gather/scatter per hand-off."""

    protocol = PROTOCOL
    devices = (CUDA,)

    def __init__(self) -> None:
        self.local: LocalCache | None = None
        self._endpoint: CudaIpcEndpoint | None = None

    @classmethod
    def unsuited(cls, device: str) -> str | None:
        if device == CUDA:
            return None
        return f"cuda_ipc moves KV caches in GPU memory, and this instance's is on {device}"

    @classmethod
    def unavailable(cls) -> str | None:
        """torch missing, a CPU-only torch, or no visible GPU (torch is imported only once known
        to be installed; ``is_available`` creates no CUDA context)."""
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        import torch

        if torch.version.cuda is None:
            return f"torch {torch.__version__} is built without CUDA"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return None

    def open(self, local: LocalCache) -> None:
        self.check_device(local)
        reason = self.unavailable()
        if reason is not None:
            raise ConfigError(f"the cuda_ipc transport cannot run here: {reason}")
        if not local.block_bytes:
            raise ConfigError("cuda_ipc needs the cache's block size (LocalCache.block_bytes)")
        as_blocks(local.view, local.block_bytes)
        if local.shared:
            self._endpoint = export_cache(local.view, local.block_bytes)
            log.info(
                "KV cache (%.0f MiB on %s, %s) exported over CUDA IPC",
                self._endpoint.nbytes / 2**20,
                self._endpoint.device_name,
                self._endpoint.pci_bus_id,
            )
        self.local = local

    def endpoint(self) -> dict[str, Any] | None:
        return self._endpoint.to_json() if self._endpoint is not None else None

    def writer(self, peer: Any) -> CudaIpcWriter:
        if self.local is None:
            raise TransferError("the cuda_ipc transport is not open here")
        return CudaIpcWriter(peer, self.local)

    def close(self) -> None:
        """Stop advertising. Peers that hold the cache mapped keep it until they close their
        writers (they do once this instance leaves the live set); torch keeps the memory of a
        cache freed while mapped out of reuse (its IPC limbo), so a late write hits no other data."""
        self._endpoint = None
        self.local = None
