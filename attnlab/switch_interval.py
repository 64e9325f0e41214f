"""A short GIL switch interval while attnlab's background threads run (the warm start, compiles ahead).

When a thread wants the GIL that another holds, it waits the switch interval (5 ms by default) before the
holder is asked to drop it. attnlab's background threads take the GIL back many times (each chunk of the
warm start's hash; each step of a compile's Python front end), and the caller's thread, running a notebook
cell or the next attention call, then loses up to 5 ms at each hand-over while the background work itself
crawls. While any of them runs, the interval is at most :data:`SHORT_S`; the last one to finish restores the
interval it found, unless someone else has changed it since (docs/decisions.md, "The warm start's GIL
hand-overs" and "The background compiles' switch interval").
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

SHORT_S = 0.0002  #: the interval while background work runs (seconds)

_lock = threading.Lock()
_users = 0
_before = 0.0  # the interval found by the first of the current users
_ours = 0.0  # the interval set, as the interpreter rounds it


@contextlib.contextmanager
def short() -> Iterator[None]:
    """Run the body with the switch interval at most :data:`SHORT_S` (nested and concurrent uses share it)."""
    global _users, _before, _ours
    with _lock:
        if _users == 0:
            _before = sys.getswitchinterval()
            if _before > SHORT_S:  # a shorter interval of the user's is left as it is
                sys.setswitchinterval(SHORT_S)
            _ours = sys.getswitchinterval()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _ours != _before and sys.getswitchinterval() == _ours:
                sys.setswitchinterval(_before)
