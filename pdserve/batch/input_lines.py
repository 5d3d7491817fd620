"""The parsed input lines a batch worker keeps, so that the chunks of a batch read and parse its
input file once per worker."""

from __future__ import annotations

import collections

from pdserve.batch.validation import Line

INPUT_CACHE_BYTES = 256 << 20
"""What the parsed input lines a batch worker keeps may weigh (:class:`InputLines`): the two
largest uploads (``--max-file-bytes``' default, 100 MiB) at once, or many small batches."""
LINE_OVERHEAD_BYTES = 300
"""A parsed line's Python objects beyond its bytes (the ``Line`` and its strings' headers)."""


class InputLines:
    """The parsed input lines of the batches this worker ran lately, least recently used dropped
    first once they weigh more than ``max_bytes`` (the newest is kept whatever it weighs): two
    batches running at once each read and parse their file once, not at every chunk."""

    def __init__(self, max_bytes: int = INPUT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[str, tuple[list[Line], int]] = collections.OrderedDict()

    def get(self, batch_id: str) -> list[Line] | None:
        entry = self._entries.get(batch_id)
        if entry is None:
            return None
        self._entries.move_to_end(batch_id)
        return entry[0]

    def put(self, batch_id: str, lines: list[Line]) -> None:
        self.pop(batch_id)
        size = sum(len(line.body) + len(line.custom_id) + LINE_OVERHEAD_BYTES for line in lines)
        self._entries[batch_id] = (lines, size)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def pop(self, batch_id: str) -> None:
        entry = self._entries.pop(batch_id, None)
        if entry is not None:
            self.bytes -= entry[1]

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._entries
