"""The runtime of every Triton kernel here: the first launch (:func:`jit_run`), launching a compiled kernel
without Triton's JIT dispatch (its C launch function called directly, the launcher object otherwise), the
arguments that vary from call to call, and the key that a launch plan is kept by. The forward
(:mod:`~attnlab.backends.triton.forward`) and the decode (:mod:`~attnlab.backends.triton.decode`) plans use it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch

from attnlab.backends.triton import background
from attnlab.backends.triton import cold_launch as _cold
from attnlab.backends.triton import configs as _cfg
from attnlab.backends.triton.forward_kernel import triton
from attnlab.problem import Packed, Problem

#: Whether repeated GPU launches of one Problem skip Triton's JIT dispatch (ATTNLAB_TRITON_FAST_LAUNCH=0:
#: never; every launch then goes through ``kernel[grid](...)``).
FAST_LAUNCH: bool = os.environ.get("ATTNLAB_TRITON_FAST_LAUNCH", "1") != "0"
#: Whether fast calls made from now on call the C launch function under Triton's launcher object directly
#: (:func:`launcher`; ATTNLAB_TRITON_DIRECT_LAUNCH=0: never, every launch goes through that object).
DIRECT_LAUNCH: bool = os.environ.get("ATTNLAB_TRITON_DIRECT_LAUNCH", "1") != "0"


#: The most launch plans kept per kind (the oldest is dropped).
MAX_PLANS = 512


def layout_key(*tensors: torch.Tensor | None) -> tuple:
    """What Triton's JIT specializes a call's output tensors on, besides the plan's signature: dtype, strides
    and 16-byte alignment of each (None, an absent lse, counts as absent)."""
    return tuple(None if t is None else (t.dtype, t.stride(), t.data_ptr() % 16 == 0) for t in tensors)


def batch_strides(t: torch.Tensor, packed: Packed | None) -> tuple[int, ...]:
    """``t``'s strides as a kernel reads them: a packed call's tensors ([1, H, total, D] views) with batch
    stride 0, since a sequence's place is its first row (the prefix sums), not its batch index."""
    return (0, *t.stride()[1:]) if packed is not None else t.stride()


def packed_slots(total: int, block: int, n_seq: int) -> int:
    """Programs along a packed grid's first axis: ``total // block + n_seq`` slots hold every tile of ``n_seq``
    sequences of ``total`` rows (or keys) in all, with at most one idle slot per sequence
    (:func:`~attnlab.backends.triton.tiles.packed_tile`, which reads n_seq back from this count); none without
    a sequence, whatever the tensors hold."""
    return total // block + n_seq if n_seq > 0 else 0


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def shared_optin(device_index: int) -> int:
    """The shared memory one block of CUDA device ``device_index`` may opt in to, in bytes."""
    return getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", 0)


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """CUDA device ``device_index``'s compute capability, asked once (each call checks it: host time)."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def sm_count(device_index: int) -> int:
    """The SMs of CUDA device ``device_index`` (what split counts and grid waves are measured in)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tile_grid(prob: Problem, n: int, total: int, block: int, heads: int,
              tiles_outer: bool = False) -> tuple[int, int, int]:
    """A grid of one program per (tile of ``block`` of the ``n`` rows or keys, head, batch entry); packed, per
    (slot over the ``total`` rows or keys, head): :func:`packed_slots`. ``tiles_outer`` (not packed): (head,
    batch entry, tile), so that the GPU, which starts programs in the grid's order (first axis fastest), starts
    one tile of every head before the next tile of any."""
    if prob.packed is not None:
        return (packed_slots(total, block, prob.B), heads, 1)
    if tiles_outer:
        return (heads, prob.B, triton.cdiv(n, block))
    return (triton.cdiv(n, block), heads, prob.B)


def pointers(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The tensors' device addresses. Triton's launcher (3.4 to 3.9) takes an int for a pointer parameter as
    the address itself; given a tensor it calls ``data_ptr()`` and asks the driver whether the address is a
    device pointer, about a microsecond per tensor on a slow host. A fast call's tensors were validated as
    CUDA tensors on the plan's device by their signature, so that question has been answered."""
    return tuple(t.data_ptr() for t in tensors)


def run_compiled(kernel, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """Launch ``kernel`` (what the JIT returned) on ``grid`` and ``stream`` with every parameter's value
    ``args`` in signature order, constants too, as the JIT launches it (triton 3.4 to 3.9); pointers may be
    tensors or their addresses as ints. Launch metadata is built and the hooks are called only when a hook
    is set (:func:`idle_hooks`). A kernel whose first launch took the cold path launches through it until its
    Triton launcher is built (:mod:`~attnlab.backends.triton.cold_launch`)."""
    hooks = triton.knobs.runtime
    cold = getattr(kernel, "attnlab_cold", None)
    if cold is not None and not cold.ready and idle_hooks(hooks):
        cold.launch(grid, stream, _cold.runtime_values(kernel.src.signature, args))
    elif idle_hooks(hooks):
        kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
    else:
        kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, kernel.launch_metadata(grid, stream, *args),
                   hooks.launch_enter_hook, hooks.launch_exit_hook, *args)


def launcher(kernel) -> Callable[[tuple[int, int, int], int, tuple], None]:
    """``go(grid, stream, args)``: :func:`run_compiled` for ``kernel``, faster when it can be.

    While no launch hook is set, ``go`` calls the C function behind Triton's launcher object itself, with the
    arguments that object's ``__call__`` would pass it (:func:`_c_launch`): that Python layer (two closures,
    two scratch allocations of size 0, the arguments repacked) costs about as much as the C launch it wraps on
    a slow host. Kernels with a scratch buffer, and launcher interfaces this module does not know, go through
    :func:`run_compiled`, as every launch does once a hook is set. A kernel launched through the cold path
    stays on it until its Triton launcher is built, then moves to the C launch function."""
    cold = getattr(kernel, "attnlab_cold", None)
    if cold is None or cold.ready:
        return _warm_launcher(kernel)
    runtime, signature = triton.knobs.runtime, kernel.src.signature
    warm: list = []

    def go(grid: tuple[int, int, int], stream: int, args: tuple) -> None:
        if not cold.ready and idle_hooks(runtime):
            cold.launch(grid, stream, _cold.runtime_values(signature, args))
            return
        if not warm:
            warm.append(_warm_launcher(kernel))
        warm[0](grid, stream, args)

    return go


def _warm_launcher(kernel) -> Callable[[tuple[int, int, int], int, tuple], None]:
    c_launch = _c_launch(kernel) if DIRECT_LAUNCH else None
    runtime = triton.knobs.runtime

    def go(grid: tuple[int, int, int], stream: int, args: tuple) -> None:
        if c_launch is not None and idle_hooks(runtime):
            c_launch(*grid, stream, args)
        else:
            run_compiled(kernel, grid, stream, args)

    return go


def _triton_minor() -> tuple[int, int] | None:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


def _c_launch(kernel) -> Callable[..., None] | None:
    """``c(gx, gy, gz, stream, args)`` calling the C launch function of ``kernel``'s launcher object
    (``kernel.run.launch``) with no hooks, no launch metadata and no scratch, as that object's ``__call__``
    calls it, or None where that call is not known to be right:

    * triton 3.5 and 3.6 compile a launcher per signature: ``launch(gx, gy, gz, stream, function,
      cooperative, pdl, global_scratch, profile_scratch, kernel_metadata, launch_metadata, enter_hook,
      exit_hook, *args)``;
    * triton 3.7 to 3.9 share one launcher: ``launch(gx, gy, gz, stream, function, cooperative, pdl,
      kernel_metadata, launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch,
      arg_annotations, kernel_signature, args)``.

    A kernel that needs a global or profile scratch buffer (its launcher allocates one per launch), or runs
    under Triton's sanitizer, gets None."""
    run = getattr(kernel, "run", None)
    c = getattr(run, "launch", None)
    version = _triton_minor()
    try:
        if c is None or version is None or run.global_scratch_size or run.profile_scratch_size:
            return None
        if getattr(run, "gsan_enabled", False):
            return None
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        function, meta = kernel.function, kernel.packed_metadata
    except AttributeError:
        return None
    if (3, 7) <= version <= (3, 9) and hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature"):
        annotations, signature = run.arg_annotations, run.kernel_signature

        def shared(gx, gy, gz, stream, args):
            c(gx, gy, gz, stream, function, coop, pdl, meta, None, None, None, None, None, annotations, signature,
              args)

        return shared
    if (3, 5) <= version <= (3, 6) and not hasattr(run, "arg_annotations"):

        def per_signature(gx, gy, gz, stream, args):
            c(gx, gy, gz, stream, function, coop, pdl, None, None, meta, None, None, None, *args)

        return per_signature
    return None


def idle_hooks(runtime) -> bool:
    """Whether no Triton launch hook is set in ``runtime`` (``triton.knobs.runtime``). Then a launch hands the
    compiled launcher None for both hooks and no metadata, and a fast call int addresses: given tensors, the
    hooks and launch metadata, it asks the driver about every pointer, builds the metadata and calls both
    hooks, several us more per call (docs/decisions.md, "Host time of small calls"). Triton 3.6 to 3.9 keep
    the hooks in a HookChain, empty when none is set; older ones hold None."""
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or (type(getattr(hook, "calls", None)) is list and not hook.calls)


def _raw_stream_getter() -> Callable[[int], int]:
    try:
        from torch._C import _cuda_getCurrentRawStream
        return _cuda_getCurrentRawStream
    except ImportError:  # a CPU-only torch: never called
        return lambda index: torch.cuda.current_stream(index).cuda_stream


#: ``current_stream(device)``: the raw handle of the current CUDA stream of ``device``, as Triton's JIT launches
#: on it (its driver asks torch the same way; asking Triton's driver object would build its C module).
current_stream: Callable[[int], int] = _raw_stream_getter()


def stream_of(device: int) -> int:
    """The raw handle of the current CUDA stream of ``device``, as Triton's JIT launches on it."""
    return current_stream(device)


def fast_launch_supported(kernel) -> bool:
    """Whether ``kernel`` (what the JIT returned) has the launcher interface of triton 3.4 to 3.9 (asked of its
    class where reading the attribute would load the kernel's handles)."""
    knobs = getattr(triton, "knobs", None)
    return (kernel is not None and knobs is not None and hasattr(knobs, "runtime")
            and (isinstance(getattr(type(kernel), "run", None), property) or hasattr(kernel, "run"))
            and all(hasattr(kernel, a) for a in ("function", "packed_metadata", "launch_metadata")))


def compile_only(fn, args: Sequence, kw: dict, device: int):
    """``fn`` compiled for ``fn[grid](*args, **kw)`` on GPU ``device``, nothing launched (the JIT's ``warmup``, or
    the cold path's compile where first launches take it)."""
    if _cold.usable():
        return _cold.compile_only(fn, args, kw, device)[0]
    return fn.warmup(*args, grid=(1, 1, 1), **kw)


def compiled_count(fn) -> int:
    """How many compiled variants of ``fn`` (a @triton.jit kernel) this process holds: the JIT's and the cold
    path's."""
    return sum(len(c[0]) for c in fn.device_caches.values()) + _cold.compiled_count(fn)


def registers(kernel, device: int) -> int:
    """The registers per thread of a compiled kernel (its module loaded on ``device`` if it was not)."""
    cold = _cold.prepare(kernel, device, background.handles) if _cold.usable() else None
    if cold is not None:
        return int(cold.n_regs)
    kernel._init_handles()  # loads the binary: its register count is known from then on
    return int(kernel.n_regs)


def later_parameters(fn, n_args: int) -> tuple[tuple[str, object], ...]:
    """(name, default) of each parameter of ``fn`` after its first ``n_args`` (what keywords or defaults give)."""
    return tuple((p.name, p.default) for p in fn.params[n_args:])


def bound_values(args: Sequence, kw: dict, later: tuple) -> tuple:
    """Every parameter's value in signature order, as Triton's binder gives them (what :func:`run_compiled` and
    :func:`launcher` take): the positional ``args``, then each later parameter ``(name, default)`` of ``later``
    (:func:`later_parameters`) from ``kw`` or its default."""
    return (*args, *(kw[n] if n in kw else d for n, d in later))


def jit_run(fn, grid: tuple, args: Sequence, kw: dict):
    """``fn[grid](*args, **kw)`` on a GPU: through Triton's JIT, or, where first launches take the cold path
    (:mod:`~attnlab.backends.triton.cold_launch`), compiled as the JIT compiles it and launched through the
    driver API until its Triton launcher is built; returns the compiled kernel, as the JIT does."""
    from triton.runtime.jit import JITFunction

    if not _cold.usable() or not isinstance(fn, JITFunction) or not idle_hooks(triton.knobs.runtime):
        return fn[grid](*args, **kw)  # (an interpreted function too)
    device = torch.cuda.current_device()
    compiled, values = _cold.compile_only(fn, args, kw, device)
    grid3 = (*grid, 1, 1)[:3]
    stream = current_stream(device)
    cold = _cold.prepare(compiled, device, background.handles)
    if cold is not None and not cold.ready:
        cold.launch(grid3, stream, _cold.runtime_values(compiled.src.signature, values))
    else:
        run_compiled(compiled, grid3, stream, values)
    return compiled


def _aligned(t: torch.Tensor | None) -> bool | None:
    return None if t is None else t.data_ptr() % 16 == 0


def call_signature(prob: Problem) -> tuple:
    """Everything a launch's compiled kernel and its fixed arguments depend on, besides out and lse."""
    spec, q, k, v = prob.spec, prob.q, prob.k, prob.v
    e = spec.explicit
    return (
        q.device.index, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), prob.scale,
        spec.left, spec.right, spec.align, spec.mask is not None, spec.bias is not None,
        None if e is None else (e.dtype, e.stride()),
        _aligned(q), _aligned(k), _aligned(v), _aligned(e), _aligned(spec.kv_len), _aligned(spec.q_len),
        _cfg.TF32, _cfg.AUTOTUNE, _cfg.SHIPPED_ONLY,
        prob.mods.softcap, None if prob.mods.alibi is None else (prob.mods.alibi.stride(), _aligned(prob.mods.alibi)),
        None if prob.mods.sinks is None else (prob.mods.kernel_sinks.dtype, _aligned(prob.mods.kernel_sinks)),
    )
