"""Import Paddle once, on pdserve's terms.

Paddle's import installs its own handler, level and format on the root logger (and warns about a
missing ccache, a C++ build cache that means nothing here). Every pdserve module takes Paddle from
here, so logging stays as the application configured it.
"""

import logging
import warnings

_root = logging.getLogger()
_saved = (list(_root.handlers), _root.level, _root.propagate)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*ccache.*")
    import paddle
    import paddle.incubate.nn.functional as incubate_functional
    import paddle.nn.functional as functional
_root.handlers[:], _root.level, _root.propagate = _saved[0], _saved[1], _saved[2]

__all__ = ["functional", "incubate_functional", "paddle"]
