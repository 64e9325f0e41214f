"""A compiled Triton kernel launched through the CUDA driver itself (``cuLaunchKernel`` by ctypes).

Why: a repeated call's host time is mostly its launches. Triton's launcher, called with the compiled kernel's
arguments, builds launch metadata, calls the (empty) launch hooks, converts each argument again and asks the
driver about every pointer: 7-15 us a launch on the H200's host (scripts/launch_cost.py), where the driver's
launch itself takes a few. A :class:`DirectLaunch` packs the arguments that a plan fixes once, in the layout
the kernel takes them, and a call writes only the addresses that change before calling ``cuLaunchKernel``.

What it mirrors: Triton's CUDA launcher of triton 3.6 to 3.9 (read from their sources): the kernel's
parameters are those of its signature that are not constexpr, in order (pointers as 64-bit addresses, ``i32``
and ``i64`` ints, ``fp32`` floats as 32-bit floats), followed by the global and the profile scratch
pointers; the block is 32 * num_warps threads; the grid is the launch's. Anything else (another Triton, ROCm,
a kernel that needs scratch memory, clusters, PDL or a cooperative grid, a parameter type not listed) gets
no direct launcher (:func:`direct_launch` gives None) and keeps Triton's. So do calls while a Triton launch
hook is set (:func:`idle_hooks`: profilers such as proton see every launch) and calls from a thread whose
current CUDA context is not the kernel's (:meth:`DirectLaunch.__call__` returns False).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence

#: ATTNLAB_TRITON_DIRECT_LAUNCH=0: never launch through the driver directly (always Triton's launcher).
DIRECT_LAUNCH: bool = os.environ.get("ATTNLAB_TRITON_DIRECT_LAUNCH", "1") != "0"

#: Triton versions (major, minor) whose CUDA launcher passes the arguments as described above.
MIRRORED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))

#: struct codes of the parameter types a direct launch packs (each in its own 8-byte slot).
_CODES = {"i32": "i", "i64": "q", "u32": "I", "u64": "Q", "fp32": "f"}


def idle_hooks(runtime) -> bool:
    """Whether no Triton launch hook is set in ``runtime`` (``triton.knobs.runtime``): triton 3.6 to 3.9 keep
    them in a HookChain, empty when none is set; older ones hold None."""
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or (type(getattr(hook, "calls", None)) is list and not hook.calls)


class _Driver:
    """The two driver entry points a direct launch needs, from libcuda (loaded once, on first use)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.launch = lib.cuLaunchKernel
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p]
        self.current = lib.cuCtxGetCurrent
        self.current.restype = ctypes.c_int
        self.current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.error_string = lib.cuGetErrorString
        self.error_string.restype = ctypes.c_int
        self.error_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def context(self) -> int | None:
        ctx = ctypes.c_void_p()
        return ctx.value if self.current(ctypes.byref(ctx)) == 0 else None

    def message(self, code: int) -> str:
        text = ctypes.c_char_p()
        self.error_string(code, ctypes.byref(text))
        return text.value.decode() if text.value else f"CUDA driver error {code}"


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


class DirectLaunch:
    """One compiled kernel on one grid with every argument but the ``changing`` ones fixed.

    ``call(stream, *values)`` writes ``values`` (ints: addresses, or whatever the changing parameters take)
    into the changing parameters' slots and launches on ``stream``; True when launched, False when this
    thread's current CUDA context is not the one the kernel was loaded in (the caller then launches through
    Triton, which makes its context current)."""

    __slots__ = ("_args", "_block", "_buffer", "_context", "_current", "_function", "_grid", "_lock", "_pack",
                 "_seen", "_shared")

    def __init__(self, kernel, grid: Sequence[int], params: list[tuple[str, object]], changing: Sequence[int],
                 context: int) -> None:
        # slots of 8 bytes: the changing parameters first (one pack_into writes them all), then the fixed
        # ones, then the two scratch pointers (null)
        moving = set(changing)
        order = [*changing, *(i for i in range(len(params)) if i not in moving)]
        slot = {i: n for n, i in enumerate(order)}
        self._buffer = ctypes.create_string_buffer(8 * (len(params) + 2))
        base = ctypes.addressof(self._buffer)
        for i, (code, value) in enumerate(params):
            if i not in moving:
                struct.pack_into("<" + code, self._buffer, 8 * slot[i], value)
        pointers = [base + 8 * slot[i] for i in range(len(params))]
        pointers += [base + 8 * len(params), base + 8 * (len(params) + 1)]
        self._args = (ctypes.c_void_p * len(pointers))(*pointers)
        self._pack = struct.Struct("<" + "".join(params[i][0] + ("" if params[i][0] in "Qq" else "4x")
                                                 for i in changing)).pack_into
        self._function, self._context = kernel.function, context
        self._grid = tuple(int(g) for g in grid)
        self._block = 32 * kernel.metadata.num_warps
        self._shared = kernel.metadata.shared
        self._lock = threading.Lock()
        self._seen = ctypes.c_void_p()  # the calling thread's current context, read under the lock
        self._current = ctypes.pointer(self._seen)

    def __call__(self, stream: int, *values: int) -> bool:
        drv = _DRIVER
        gx, gy, gz = self._grid
        with self._lock:  # the slots are shared by every thread calling this plan
            if drv.current(self._current) != 0 or self._seen.value != self._context:
                return False
            self._pack(self._buffer, 0, *values)
            err = drv.launch(self._function, gx, gy, gz, self._block, 1, 1, self._shared, stream, self._args,
                             None)
        if err != 0:
            raise RuntimeError(f"cuLaunchKernel failed: {drv.message(err)}")
        return True


def direct_launch(kernel, grid: Sequence[int], args: Sequence, changing: Sequence[int]) -> DirectLaunch | None:
    """A :class:`DirectLaunch` of ``kernel`` (what Triton's JIT returned, launched once) on ``grid`` with
    ``args`` (every parameter's value in signature order, constexprs included, as Triton's launcher takes
    them; the values at the ``changing`` positions are placeholders, each a pointer or int parameter), or None
    when this kernel or this Triton is not one that a direct launch mirrors (module docstring)."""
    try:
        import torch
        import triton

        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
        if not DIRECT_LAUNCH or version not in MIRRORED_TRITON or torch.version.hip is not None:
            return None
        meta = kernel.metadata
        if (getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)
                or getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False)
                or getattr(meta, "launch_cooperative_grid", False) or kernel.function is None):
            return None
        if len(grid) != 3 or min(grid) < 1:
            return None
        types = list(kernel.src.signature.values())
        if len(types) != len(args):
            return None
        params, index, kept = [], {}, 0
        for i, (ty, value) in enumerate(zip(types, args)):
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                if i not in changing:  # an address fixed at planning would outlive its tensor
                    return None
                code, value = "Q", 0
            elif ty in _CODES:
                code = _CODES[ty]
            else:
                return None
            index[i] = kept
            kept += 1
            params.append((code, value))
        if any(i not in index or params[index[i]][0] == "f" for i in changing):
            return None
        context = _driver().context()
        if not context:
            return None
        return DirectLaunch(kernel, grid, params, [index[i] for i in changing], context)
    except Exception:  # a Triton or driver this does not know: Triton's launcher stays
        return None
