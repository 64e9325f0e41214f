"""How the decode's kernels are launched on a GPU: one kernel on its grid with its constants, launched
directly once compiled (:class:`Kernel`), and the split-state buffers fast calls keep per stream
(:func:`held_workspace`). The plans that use them are in :mod:`attnlab.backends.triton.decode`."""

from __future__ import annotations

import threading

import torch

from attnlab.backends.triton import runtime as _rt
from attnlab.fast_calls import evict_oldest

#: Whether fast calls keep their split states in a buffer held per (device, stream) (:func:`held_workspace`)
#: rather than allocating them on every call.
HOLD_WORKSPACE = True
#: The held split-state buffers, float32, by (device index, raw stream handle): each only grows, to the
#: largest a fast call on that stream has needed; at most MAX_HELD streams (the oldest is dropped).
_HELD: dict[tuple[int, int], torch.Tensor] = {}
MAX_HELD = 16
#: Held while a fast call queues the two launches that write and read a held buffer: two threads on one
#: stream would otherwise interleave them (split A, split B, merge A reads B's states). Taken only if free:
#: a call that finds it taken (another thread's, or a launch hook's that itself calls attention: the lock
#: is not reentrant) allocates states of its own instead of waiting.
HELD_LOCK = threading.Lock()


def held_workspace(device: int, stream: int, numel: int) -> torch.Tensor:
    """The split-state buffer held for ``stream`` of GPU ``device``, of at least ``numel`` float32 (the
    caller holds ``HELD_LOCK``). Sound because a later call's split kernel on this stream starts only after
    the earlier call's merge has read the states: only the merge is a programmatic dependent launch (it may
    start before the split kernel it follows ends), the split kernel is an ordinary launch. Growing drops the
    old buffer into torch's allocator, which reuses it only for work queued after on the same stream."""
    ws = _HELD.get((device, stream))
    if ws is None or ws.numel() < numel:
        if ws is None:
            evict_oldest(_HELD, MAX_HELD)
        ws = _HELD[(device, stream)] = torch.empty(numel, dtype=torch.float32, device=torch.device("cuda", device))
    return ws


def release_workspaces() -> None:
    """Hand the held split-state buffers back to torch's allocator (the next fast call on each stream
    allocates one again). The benchmark calls this before it measures a call's peak memory, so that the
    split states count in it. Without the lock (a hook may call it during a fast call): a call that already
    has its buffer holds a reference to it until its launches are queued."""
    _HELD.clear()


#: Whether the current stream is capturing a CUDA graph (the private binding skips a Python layer).
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


class Kernel:
    """One kernel on one grid with fixed constants: the first launch of each specialization (``key``: what
    the JIT specializes the per-call arguments on) goes through Triton's JIT, later ones call the compiled
    kernel's launcher directly, as the fused forward's plans do (the launcher takes the constants too)."""

    def __init__(self, fn, grid: tuple[int, int, int], constants: dict, options: dict):
        self.fn, self.grid, self.constants, self.options = fn, grid, constants, options
        self.compiled: dict[tuple, object] = {}
        self._values: tuple | None = None

    def _constant_values(self) -> tuple:
        """The constants' values in the kernel's parameter order (the launcher takes them last), once."""
        if self._values is None:
            self._values = tuple(self.constants[p.name] for p in self.fn.params if p.is_constexpr)
        return self._values

    def direct(self, key: tuple, head: int, mid: tuple, tail: tuple):
        """``go(stream, *values)``: the compiled kernel of ``key`` launched with the parameters
        ``(*values[:head], *mid, *values[head:], *tail, *constants)``, where ``values`` are the addresses that
        change from call to call (ints) and the rest is fixed (:func:`attnlab.backends.triton.runtime.launcher`).
        None before the kernel exists."""
        kernel = self.compiled.get(key)
        if kernel is None or not _rt.FAST_LAUNCH:
            return None
        grid, constants, run = self.grid, self._constant_values(), _rt.launcher(kernel)

        def go(stream, *values):
            run(grid, stream, (*values[:head], *mid, *values[head:], *tail, *constants))

        return go

    def launch(self, args: tuple, key: tuple, device: int) -> None:
        kernel = self.compiled.get(key)
        if kernel is None or not _rt.FAST_LAUNCH:
            kernel = _rt.jit_run(self.fn, self.grid, args, {**self.constants, **self.options})
            if _rt.FAST_LAUNCH and _rt.fast_launch_supported(kernel):
                self.compiled[key] = kernel
            return
        _rt.run_compiled(kernel, self.grid, _rt.stream_of(device), (*args, *self._constant_values()))
