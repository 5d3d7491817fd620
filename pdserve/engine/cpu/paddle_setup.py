"""Import Paddle once, on pdserve's terms.

Before the import: refuse a CPU below the supported floor with a clear error (a SIGILL later
would be the worst failure a user can see) and set what makes Paddle's bundled MKL fast on this
CPU (``host_cpu.tune_environment``). After it: Paddle's import installs its own handler, level and
format on the root logger (and warns about a missing ccache, a C++ build cache that means nothing
here); both are undone. Then numba's parallel kernels are put on the OpenMP runtime Paddle's MKL
runs on (:func:`share_openmp`). Every pdserve module takes Paddle from here.
"""

import ctypes
import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

from pdserve.engine.cpu import host_cpu

log = logging.getLogger(__name__)

HOST = host_cpu.detect()
host_cpu.check_floor(HOST)
_paddle_was_loaded = "paddle" in sys.modules
TUNING = host_cpu.tune_environment(
    HOST
)  # settings applied (before Paddle, and share_openmp), logged at start

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


def share_openmp(libs: Path, environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Run numba's parallel kernels on the OpenMP runtime of Paddle's MKL (``libs/libiomp5.so``),
    returning the setting applied (None: none; the user's ``NUMBA_THREADING_LAYER`` is left alone).

    Why: the engine alternates MKL's GEMMs (an OpenMP team whose threads spin for 200 ms after each
    call) with numba's kernels, whose default pool (TBB) is a second set of threads; on a host with
    as many cores as threads, each pool's threads then wait for cores the other's spin on. numba's
    ``omp`` layer calls the GNU OpenMP entry points, which libiomp5 also provides: loaded into the
    global symbol scope first, it serves them, so both share one team (measured on 2 Zen 3 vCPUs,
    SmolLM2's four prefill GEMMs alternating with MKL's: int8 products 1.5x, MKL's own 1.1x faster).
    Must run before numba's first parallel call in the process (its pool starts then)."""
    if environ.get("NUMBA_THREADING_LAYER"):
        return None
    lib = libs / "libiomp5.so"
    if not lib.is_file():
        return None
    import numba

    runtime = ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)  # loaded by Paddle already: made global
    try:
        importlib.import_module("numba.np.ufunc.omppool")  # numba's omp layer, built for GNU OpenMP
    except ImportError:
        return None
    if not hasattr(runtime, "GOMP_parallel"):  # the entry point numba's omp layer calls
        return None
    if getattr(importlib.import_module("numba.np.ufunc.parallel"), "_is_initialized", False):
        return None  # a parallel call ran already: numba's pool is chosen for this process
    # numba.config sets its options through globals(), which its types cannot show
    numba.config.THREADING_LAYER = "omp"  # type: ignore[attr-defined]
    return "NUMBA_THREADING_LAYER=omp on Paddle's libiomp5"


_openmp = share_openmp(Path(paddle.__file__).parent / "libs")
if _openmp:
    TUNING.append(_openmp)

__all__ = ["HOST", "TUNING", "functional", "incubate_functional", "paddle"]
