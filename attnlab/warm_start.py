"""Triton's once-per-process start-up, done in a background thread after ``import attnlab``.

Whatever the kernel, Triton's first launch in a process hashes its own installation for the compiler's cache
key (libtriton's hundreds of MB: about 0.4 s) and imports its Gluon language, also when the compiled kernel
is on disk already. :func:`start` does both on a daemon thread as soon as attnlab is imported, when torch is a
GPU build and triton is installed; GPU launches call :func:`wait` first, so the work is never done twice. The
thread reads files and imports modules only: it touches no GPU and compiles nothing.
(ATTNLAB_WARM_START=0: not started.) :func:`report` says what it did, for the first-call benchmark.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time

from attnlab import switch_interval

_thread: threading.Thread | None = None
_report: dict[str, object] = {"started": False}


def _warm() -> None:
    # Hashing reads libtriton in 1 MiB chunks and takes the GIL back after each one: a short switch interval
    # while it runs (attnlab.switch_interval).
    t0 = time.perf_counter()
    with switch_interval.short():
        for step, work in (("triton_key", _cache_key), ("gluon", _gluon)):
            try:
                work()
                _report[step] = round(time.perf_counter() - t0, 3)  # seconds since the thread started
            except Exception as err:  # a triton without this piece: its first launch does what it needs
                _report[step] = f"{type(err).__name__}: {err}"


def triton_key_function():
    """Triton's cached hash of its installation (``triton.runtime.cache.triton_key``; in triton 3.4,
    ``triton.compiler.compiler.triton_key``)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key
    return triton_key


def _cache_key() -> None:
    triton_key_function()()  # functools.lru_cache: kept for the process


def _gluon() -> None:
    import triton.experimental.gluon  # noqa: F401  (the JIT imports it on its first launch)


def start() -> None:
    """Start the thread once (nothing on a CPU-only torch, without triton, or with ATTNLAB_WARM_START=0)."""
    global _thread
    if _thread is not None or os.environ.get("ATTNLAB_WARM_START", "1") == "0":
        return
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return
    if importlib.util.find_spec("triton") is None:
        return
    _report["started"] = True
    _thread = threading.Thread(target=_warm, name="attnlab-warm-start", daemon=True)
    _thread.start()


def wait(timeout: float = 60.0) -> None:
    """Join the thread, if one was started (GPU launches call this first)."""
    if _thread is not None and _thread.is_alive():
        t0 = time.perf_counter()
        _thread.join(timeout)
        _report["waited_s"] = round(_report.get("waited_s", 0.0) + time.perf_counter() - t0, 3)


def report() -> dict[str, object]:
    """What the thread did: whether it started, each step's finish time since its start (or its error), and
    how long launches waited for it."""
    return dict(_report)
