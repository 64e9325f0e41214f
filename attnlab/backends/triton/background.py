"""Compiling a kernel in a background thread, so that a first call does not wait for compiles one after another.

Triton's compiler (its MLIR and LLVM passes, ptxas, and the C compiler that builds a kernel's launcher)
releases the GIL, so a kernel compiled on a worker thread overlaps the caller's own compile. :func:`ahead`
compiles ``kernel`` for the arguments given (``JITFunction.warmup``: nothing is launched) and builds its
launcher, so that the real launch later finds both in Triton's caches. The backward's three kernels
(:func:`attnlab.backends.triton.backward.compile_ahead`), the decode's merge kernel and the Hopper forward use
it. Where first launches take the cold path (:mod:`~attnlab.backends.triton.cold_launch`), it compiles into that
path's cache, and :func:`handles` builds a cold-launched kernel's Triton launcher here, after its first launch.

Background work runs with a short GIL switch interval (:mod:`attnlab.switch_interval`), so that the caller's
thread and the compile's Python front end hand the GIL over in fractions of a millisecond, not 5 ms.

Compiling is safe on several threads (Triton's own asynchronous compile mode does it). Making a compiled
kernel's handles (its launcher, a C extension module always named ``__triton_launcher``, built and loaded, and
its GPU module loaded) is left to one thread at a time: from the first background compile on, every thread
makes them under one lock (:func:`serialize_kernel_loads`). Why: docs/decisions.md, "Launchers loaded one
thread at a time".
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from attnlab import switch_interval, warm_start
from attnlab.backends.triton import cold_launch

_pool: ThreadPoolExecutor | None = None
WORKERS = 3  # the backward's three kernels at once
#: Held while a compiled kernel makes its launcher and loads its module (:func:`serialize_kernel_loads`).
LOADS = threading.RLock()


def serialize_kernel_loads() -> bool:
    """Make every Triton kernel in this process load its handles (launcher and module,
    ``CompiledKernel._init_handles``) under :data:`LOADS`, whichever thread asks: the caller's first launch and
    a worker's compile ahead then never load at once. Done once; a Triton without that method is left as it is
    (False). A kernel pays the lock once, at its first launch."""
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        return False
    init = getattr(CompiledKernel, "_init_handles", None)
    if init is None:
        return False
    if getattr(init, "attnlab_serialized", False):
        return True

    def init_handles(self) -> None:
        with LOADS:
            init(self)

    init_handles.attnlab_serialized = True
    init_handles.__wrapped__ = init
    CompiledKernel._init_handles = init_handles
    return True


def _compile(kernel, grid: tuple, args: tuple, kw: dict, device: torch.device, cold: bool) -> None:
    if cold:  # into the cold path's cache; the first launch loads it and starts its launcher
        cold_launch.compile_only(kernel, args, kw, device.index)
        return
    with torch.cuda.device(device):
        compiled = kernel.warmup(*args, grid=grid, **kw)
        init = getattr(compiled, "_init_handles", None)  # the launcher and the module load (triton 3.4-3.9)
        if init is not None:
            init()


def ahead(kernel, grid: tuple, args: tuple, kw: dict, device: torch.device, jit: bool = False) -> Future:
    """Start compiling ``kernel[grid](*args, **kw)`` on a worker thread; the future's error, if any, is the
    real launch's too (it compiles again there and raises it). With ``jit`` (a kernel the cold path does not
    launch, such as the Hopper forward's), into the JIT's cache even where first launches take the cold path.
    The JIT's per-device state is made here, on the caller's thread, so that workers never race to make it."""
    warm_start.wait()
    serialize_kernel_loads()
    cold = cold_launch.usable() and not jit
    if not cold:
        kernel.device_caches[device.index]
    return _submit(_compile, kernel, grid, args, kw, device, cold)


#: Work submitted and not yet done (a future leaves the set when it completes).
_inflight: set[Future] = set()


def _shortened(work, *args) -> None:
    with switch_interval.short():  # the compile's Python front end takes the GIL back step by step
        work(*args)


def _submit(work, *args) -> Future:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="attnlab-compile")
    future = _pool.submit(_shortened, work, *args)
    _inflight.add(future)
    future.add_done_callback(_inflight.discard)
    return future


def _make_handles(compiled, device: int, cold) -> None:
    with torch.cuda.device(device):
        compiled._init_handles()
    cold.ready = True


#: Launchers being built for cold-launched kernels (:func:`handles`), until :func:`settle` has seen them done.
_pending: list[Future] = []


def handles(compiled, device: int, cold) -> Future:
    """Build Triton's launcher of a kernel whose first launches took the cold path, and load its module, on a
    worker thread; ``cold.ready`` turns True when its launches may go through Triton's launcher."""
    serialize_kernel_loads()
    future = _submit(_make_handles, compiled, device, cold)
    _pending.append(future)
    return future


def settle() -> None:
    """Wait until every launcher started by :func:`handles` so far is built (a benchmark that times launches
    after a first call, or a test that compares the two launch routes, calls it)."""
    while _pending:
        wait([_pending.pop()])


def drain() -> None:
    """Wait until no background work is left: compiles ahead, launcher builds, and the work they start (a
    benchmark that times a warm process calls it)."""
    while _inflight:
        wait(list(_inflight))
    settle()


def wait(futures) -> None:
    """Wait for background compiles (their errors are left to the real launches)."""
    for f in futures:
        with contextlib.suppress(Exception):
            f.result()
