"""Triton's once-per-process start-up, done in the background after ``import attnlab``.

Triton's first launch in a process hashes its own installation (the compiler's cache key: about 0.4 s on the
H200's host, libtriton's hundreds of MB) and imports the Gluon language (0.1 s), whether or not its kernel
is on disk already. :func:`start` does both in a daemon thread as soon as attnlab is imported, when torch is a
GPU build and triton is installed; :func:`wait` (before a GPU launch) joins it, so the work is never done
twice. It touches no GPU and compiles nothing (ATTNLAB_WARM_START=0: not started).
"""

from __future__ import annotations

import importlib.util
import os
import threading

_thread: threading.Thread | None = None


def _warm() -> None:
    try:
        import triton.experimental.gluon  # noqa: F401  (the JIT imports it on its first launch)
        from triton.runtime.cache import triton_key

        triton_key()  # cached for the process (functools.lru_cache)
    except Exception:  # a triton without these pieces: its first launch does what it needs
        pass


def start() -> None:
    """Start the warm-up thread once (nothing on a CPU-only torch, without triton, or when switched off)."""
    global _thread
    if _thread is not None or os.environ.get("ATTNLAB_WARM_START", "1") == "0":
        return
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return
    if importlib.util.find_spec("triton") is None:
        return
    _thread = threading.Thread(target=_warm, name="attnlab-warm-start", daemon=True)
    _thread.start()


def wait(timeout: float = 60.0) -> None:
    """Join the warm-up thread, if one was started (a GPU launch calls this first)."""
    if _thread is not None:
        _thread.join(timeout)
