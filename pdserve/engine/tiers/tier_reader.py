"""The batcher's view of the tiers below the pool (:class:`pdserve.engine.batcher.ReadBack`): the
host tier, then the disk tier. A prompt's blocks after its pool hits are planned block by block
from whichever tier holds each (host memory first: cheaper), read (each checked by its tier) and
written into fresh pool blocks; the first block neither holds, or whose check fails, ends the run
(computed from there). So the admission plan is: pool, host tier, disk tier, recompute.

It also times what a read-back costs, per tier and block (:attr:`TierReader.host_rate`,
:attr:`TierReader.disk_rate`: reading, checking and copying into the pool, two ``perf_counter``
calls around each block's read and write, which happen one by one anyway); routers weigh a read-back
against a recompute with it (the registration's ``rates``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.engine.rates import RateMeter
from pdserve.engine.tiers.disk_tier import DiskTier
from pdserve.engine.tiers.host_tier import HostTier


class TierReader:
    """Plans, verified reads, and writes into the pool's blocks through ``write`` (the cache's
    ``write_blocks``); counts each tier's hits (its own) and misses (blocks it was asked for)."""

    def __init__(
        self,
        host: HostTier | None,
        write: Callable[[list[int], bytes], None],
        disk: DiskTier | None = None,
    ) -> None:
        self.tier = host  # the host tier (kept under its old name: tests read it)
        self.disk = disk
        self._write = write
        self._from_disk = 0  # blocks the last read took from the disk tier
        self.host_rate = RateMeter()
        """Seconds per block read back from the host tier (read, checksum, copy into the pool)."""
        self.disk_rate = RateMeter()
        """Seconds per block read back from the disk tier (file read, checks, copy into the pool)."""
        self._read: list[tuple[bool, float]] = []  # the last read's blocks: (from disk, seconds)

    def _where(self, hashes: list[bytes]) -> list[str]:
        """For the leading run of ``hashes`` some tier holds: which one ("host" or "disk")."""
        where = []
        for h in hashes:
            if self.tier is not None and h in self.tier:
                where.append("host")
            elif self.disk is not None and h in self.disk:
                where.append("disk")
            else:
                break
        return where

    def plan(self, hashes: list[bytes]) -> int:
        self._from_disk = 0
        return len(self._where(hashes))

    def read(self, hashes: list[bytes]) -> list[bytes]:
        """Each block from the highest tier that holds it (the disk tier's copy when the host tier's
        fails its checksum); the run ends at the first block no tier gives."""
        good: list[bytes] = []
        host = disk = 0
        timed: list[tuple[bool, float]] = []  # per block read: (from disk, seconds)
        clock = time.perf_counter
        for h in hashes:
            t0 = clock()
            data = None
            if self.tier is not None and h in self.tier:
                got = self.tier.read([h])  # a failed checksum drops the entry: the disk may hold it
                data = got[0] if got else None
                host += data is not None
            from_disk = False
            if data is None and self.disk is not None:
                data = self.disk.read_one(h)
                from_disk = data is not None
            if data is None:
                break
            disk += from_disk
            good.append(data)
            timed.append((from_disk, clock() - t0))
        if self.tier is not None and host > 1:  # read one at a time: its head the most recent again
            self.tier.touch(hashes[: len(good)])
        self._from_disk = disk
        self._read = timed
        return good

    def write(self, blocks: list[int], data: list[bytes]) -> None:
        """Copy the blocks :meth:`read` gave into the pool, and count each block's read and copy
        into its tier's rate."""
        clock = time.perf_counter
        timed, self._read = self._read, []
        spent = {False: 0.0, True: 0.0}  # from disk -> seconds
        count = {False: 0, True: 0}
        for i, (block, block_data) in enumerate(zip(blocks, data, strict=True)):  # one copy each
            t0 = clock()
            self._write([block], block_data)
            if i < len(timed):
                from_disk, read_s = timed[i]
                spent[from_disk] += read_s + clock() - t0
                count[from_disk] += 1
        self.host_rate.add(spent[False], count[False])
        self.disk_rate.add(spent[True], count[True])

    def missed(self, num_blocks: int) -> None:
        """``num_blocks`` of an admitted prompt's blocks past the pool were computed: each tier
        missed those and the blocks a lower tier served."""
        if self.tier is not None:
            self.tier.stats.misses += num_blocks + self._from_disk
        if self.disk is not None:
            with self.disk._lock:
                self.disk.stats.misses += num_blocks
        self._from_disk = 0
