"""Preparation at a lower OS priority: threads that tokenize prompts or compile grammars make
themselves nicer than the process, so decode steps (and the router's relaying) get the cores first.

Shared by the worker (its preparation threads, ``worker/engine_client.py``) and the router (its
long prompts tokenized for prefix routing, ``router/routing/prompt_ids.py``); imports nothing from pdserve.

On Linux niceness is per thread (``setpriority(PRIO_PROCESS, <native thread id>)``) and threads
inherit their creator's; lowering it needs no privilege, raising it back does, so such a pool's
threads stay nice for as long as they live.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

PREPARE_NICE = 10
"""How much nicer than the process's other threads preparation runs (``--prepare-nice``): the
kernel's fair scheduler then gives a busy thread at the process's niceness ~9x a preparation
thread's share of a core (weight 1024 against 110 at +10), and preparation all the time they leave
idle."""
PREPARE_NICE_HELP = (
    "tokenizing prompts and compiling grammars run on threads this much nicer (lower OS priority) "
    "than the process's others (0..19; 0: the same), so they take the cores only when decode steps "
    "and relaying leave them idle (default %(default)s)"
)


def lower_priority(nice: int) -> int:
    """Make the calling thread ``nice`` nicer (at most 19); the threads it starts later inherit it.
    Returns the niceness it has (unchanged where the system cannot do it)."""
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (AttributeError, OSError) as e:  # no setpriority (not POSIX), or refused
        log.warning("preparation threads keep the process's priority: %s", e)
        return 0


def preparation_pool(threads: int, nice: int, name: str = "prepare") -> ThreadPoolExecutor:
    """A thread pool whose threads run ``nice`` nicer than the process."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower_priority, initargs=(nice,))
