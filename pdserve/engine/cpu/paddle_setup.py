"""Import Paddle once, on pdserve's terms.

Before the import: refuse a CPU below the supported floor with a clear error (a SIGILL later
would be the worst failure a user can see) and set what makes Paddle's bundled MKL fast on this
CPU (``host_cpu.tune_environment``). After it: Paddle's import installs its own handler, level and
format on the root logger (and warns about a missing ccache, a C++ build cache that means nothing
here); both are undone. Every pdserve module takes Paddle from here.
"""

import logging
import sys
import warnings

from pdserve.engine.cpu import host_cpu

log = logging.getLogger(__name__)

HOST = host_cpu.detect()
host_cpu.check_floor(HOST)
_paddle_was_loaded = "paddle" in sys.modules
TUNING = host_cpu.tune_environment(HOST)  # settings applied, logged by the engine at start

_root = logging.getLogger()
_saved = (list(_root.handlers), _root.level, _root.propagate)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*ccache.*")
    import paddle
    import paddle.incubate.nn.functional as incubate_functional
    import paddle.nn.functional as functional
_root.handlers[:], _root.level, _root.propagate = _saved[0], _saved[1], _saved[2]

if TUNING and _paddle_was_loaded:
    log.warning("Paddle was imported before pdserve could apply %s; it may not take effect", TUNING)

__all__ = ["HOST", "TUNING", "functional", "incubate_functional", "paddle"]
