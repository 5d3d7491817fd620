"""Test hooks: faults that only a test switches on, to prove the integrity checks catch them.

They are not flags and appear in no ``--help``: a test (or a benchmark measuring the checks) sets
``PDSERVE_TEST_FAULTS`` in a worker's environment, e.g. ``kv_flip_in_transit=1,seed=3``; a worker
that finds it set says so at WARNING when it starts. Each fault fires with its probability:

* ``kv_flip_in_transit``: a prefill's KV write carries one flipped byte (a random byte of a random
  chunk is inverted in the prefill's cache just for the copy of that chunk, after its digests were
  taken, and put back after it): what a transport that corrupts bytes would deliver, on every
  transport alike. The decode side's checksum must catch it.
* ``kv_corrupt_after_check``: a decode instance overwrites one received block with another's bytes
  after checking it (a stand-in for an engine bug the checksum cannot see): shadow verification
  (``--verify-fraction``) must catch it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random

from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "PDSERVE_TEST_FAULTS"


@dataclasses.dataclass
class FaultHooks:
    """What a test switched on (all off by default)."""

    kv_flip_in_transit: float = 0.0
    kv_corrupt_after_check: float = 0.0
    seed: int | None = None
    rng: random.Random = dataclasses.field(default_factory=random.Random, repr=False)

    @classmethod
    def from_env(cls) -> FaultHooks:
        """The faults ``PDSERVE_TEST_FAULTS`` asks for (none when unset)."""
        raw = os.environ.get(ENV, "").strip()
        hooks = cls()
        if not raw:
            return hooks
        names = {f.name for f in dataclasses.fields(cls) if f.name != "rng"}
        for part in raw.split(","):
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in names:
                raise ConfigError(f"{ENV}: unknown fault {name!r} (known: {', '.join(sorted(names))})")
            try:
                setattr(hooks, name, int(value) if name == "seed" else float(value))
            except ValueError:
                raise ConfigError(f"{ENV}: {name}={value!r} is not a number") from None
        hooks.rng = random.Random(hooks.seed)
        log.warning("TEST FAULTS ARE ON (%s=%s): this worker corrupts KV on purpose", ENV, raw)
        return hooks

    def fires(self, probability: float) -> bool:
        return probability > 0 and self.rng.random() < probability
