"""Compiling the kernels through CuPy (NVRTC at run time), caching them per device, and launching them
zero-copy on torch tensors, on torch's current stream.

* :func:`get_kernel` compiles a variant once per device (the kernel file with its includes resolved
  into one text, one NVRTC run per variant; a rowmax variant's also instantiates the merge kernel of its
  dtype), caches it, and raises its dynamic shared-memory limit when the variant needs more than the
  default 48 KB.
* :func:`run` launches on torch's current stream. Every kernel takes one argument, ``struct AttnParams``
  (:mod:`attnlab.backends.cuda.params`): tensor pointers (zero copy, any strides; the mma kernel's output goes
  through a staging copy where it cannot store column pairs), strides, sizes, the mask rule. It is packed with one
  :mod:`struct` call and handed to CuPy as one host address, so a launch converts no Python scalars; the compiled
  kernel, the device limits, the validated configurations and CuPy's view of torch's stream are cached, and the
  launch names the stream instead of switching CuPy's current one (the device is switched only when another one is
  current). :func:`prepare` does the same once and returns a :class:`PreparedLaunch` to call repeatedly, and
  :func:`fast_call` keeps a plan for the later calls of a signature (:mod:`attnlab.fast_calls`).
"""

from __future__ import annotations

import os
import threading

import torch

from attnlab.backends.cuda import variant as _settings
from attnlab.backends.cuda.params import ParamBlock, cupy_module, param_values
from attnlab.backends.cuda.sources import NVRTC_OPTIONS, kernel_source
from attnlab.backends.cuda.variant import (
    DEFAULT_SMEM,
    MERGE_THREADS,
    NO_BOUND,
    DeviceLimits,
    LaunchConfig,
    Variant,
    async_ok,
    choose_variant,
    launch_config,
    merge_name_expression,
    mma_async_ok,
    mma_wide_ok,
    pair_stores_ok,
    rowmax_split_plan,
    validate_launch,
)
from attnlab.problem import Problem

_debug_sync = os.environ.get("ATTNLAB_CUDA_SYNC", "") not in ("", "0")


def set_debug_sync(enabled: bool) -> bool:
    """Synchronize after every launch and raise on an asynchronous error (also ``ATTNLAB_CUDA_SYNC=1``)."""
    global _debug_sync
    old, _debug_sync = _debug_sync, bool(enabled)
    return old


_kernel_cache: dict[tuple, object] = {}
_cache_lock = threading.Lock()


#: cudaDeviceAttr values (driver_types.h): stable numbers, so no header or enum lookup is needed.
_ATTR_MAX_THREADS_PER_BLOCK = 1
_ATTR_MAX_GRID_DIM = (5, 6, 7)
_ATTR_MAX_SHARED_PER_BLOCK_OPTIN = 97
_ATTR_MULTIPROCESSOR_COUNT = 16


def device_limits(device_index: int, kernel=None) -> DeviceLimits:
    """The launch limits of a device (and of a compiled kernel, when given)."""
    rt = cupy_module().cuda.runtime
    attr = lambda a: int(rt.deviceGetAttribute(a, device_index))
    kmax = None if kernel is None else int(kernel.max_threads_per_block)
    return DeviceLimits(
        max_threads_per_block=attr(_ATTR_MAX_THREADS_PER_BLOCK),
        max_shared_optin=attr(_ATTR_MAX_SHARED_PER_BLOCK_OPTIN),
        max_grid=tuple(attr(a) for a in _ATTR_MAX_GRID_DIM),
        kernel_max_threads=kmax,
        sm_count=attr(_ATTR_MULTIPROCESSOR_COUNT),
    )


def _compiled_module(variant: Variant, device_index: int) -> tuple:
    """(kernel, merge kernel or None) of ``variant`` on a device as ``cupy.RawKernel``s, compiled once (one
    NVRTC run: a rowmax variant's module also instantiates the merge of its dtype) and cached."""
    key = (variant, device_index)
    got = _kernel_cache.get(key)
    if got is not None:
        return got
    with _cache_lock:
        got = _kernel_cache.get(key)
        if got is None:
            got = _kernel_cache[key] = build_module(variant, device_index)
    return got


def build_module(variant: Variant, device_index: int, code: str | None = None) -> tuple:
    """(kernel, merge kernel or None) of ``variant`` on a device as ``cupy.RawKernel``s, compiled by NVRTC from
    ``code`` (the kernel's text with its headers inlined; by default the family's own), its dynamic shared
    memory raised where it needs more than the default. Not cached: :func:`get_kernel` keeps the family's own;
    an A/B probe builds other texts of a variant with it."""
    cp = cupy_module()
    merge_name = merge_name_expression(variant.dtype) if variant.family == "rowmax" else None
    with cp.cuda.Device(device_index):
        mod = cp.RawModule(
            code=kernel_source(variant.family) if code is None else code, options=NVRTC_OPTIONS,
            name_expressions=[variant.name_expression] + ([merge_name] if merge_name else []),
        )
        kern = mod.get_function(variant.name_expression)
        need = variant.shared_bytes()
        if need > DEFAULT_SMEM:
            limits = device_limits(device_index)
            validate_launch(LaunchConfig((1, 1, 1), (variant.threads, 1, 1), need), limits, variant.label)
            kern.max_dynamic_shared_size_bytes = need  # cudaFuncAttributeMaxDynamicSharedMemorySize
        return kern, mod.get_function(merge_name) if merge_name else None


def get_kernel(variant: Variant, device_index: int):
    """The compiled ``cupy.RawKernel`` of ``variant`` on a device, compiled once and cached."""
    return _compiled_module(variant, device_index)[0]


class _Compiled:
    """What a launch of one (family, dtype, D, fast_exp) on one device needs and what stays the same from
    call to call: the variant, its compiled kernel as a CuPy ``Function`` of that device (whose launch takes
    the stream as an argument, so no current-stream switch is needed), rowmax's merge kernel, the device's
    limits, and the launch configurations already validated against them."""

    def __init__(self, variant: Variant, dev: int):
        cp = self.cupy = cupy_module()
        self.variant = variant
        self.device = dev
        self.kernel, merge = _compiled_module(variant, dev)
        self.limits = _limits(variant, dev, self.kernel)
        with cp.cuda.Device(dev):
            self.function = self.kernel.kernel
            self.merge = merge.kernel if merge is not None else None
        self._configs: dict[tuple, tuple[LaunchConfig, tuple | None]] = {}

    def config(self, B: int, Hq: int, Nq: int, splits: int) -> tuple[LaunchConfig, tuple[int, int, int] | None]:
        """(kernel configuration, merge grid or None), validated against the device's limits (once per shape)."""
        key = (B, Hq, Nq, splits)
        got = self._configs.get(key)
        if got is None:
            cfg = launch_config(self.variant, B, Hq, Nq, splits)
            validate_launch(cfg, self.limits, self.variant.label)
            merge_grid = None
            if splits > 1:
                merge_grid = (-(-(B * Hq * Nq) // (MERGE_THREADS // 32)), 1, 1)
                validate_launch(LaunchConfig(merge_grid, (MERGE_THREADS, 1, 1), 0), self.limits, "attn_rowmax_merge")
            got = self._configs[key] = (cfg, merge_grid)
        return got

    def launch(self, cfg: LaunchConfig, merge_grid: tuple[int, int, int] | None, arg, splits: int,
               function=None) -> None:
        """Enqueue the kernel (``function``, another build of this variant, in its place: an A/B probe's), then
        the merge, on torch's current stream of the device; raise on failure."""
        cp, dev = self.cupy, self.device
        function = self.function if function is None else function
        try:
            stream = _cupy_stream(dev)
            args = (arg,)
            if cp.cuda.runtime.getDevice() == dev:
                function(cfg.grid, cfg.block, args, shared_mem=cfg.shared_bytes, stream=stream)
                if merge_grid is not None:
                    self.merge(merge_grid, (MERGE_THREADS, 1, 1), args, stream=stream)
            else:  # the kernels belong to dev's context: make it current for the launch
                with cp.cuda.Device(dev):
                    function(cfg.grid, cfg.block, args, shared_mem=cfg.shared_bytes, stream=stream)
                    if merge_grid is not None:
                        self.merge(merge_grid, (MERGE_THREADS, 1, 1), args, stream=stream)
        except Exception as e:
            raise RuntimeError(
                f"launch of {self.variant.label} failed (grid {cfg.grid}, block {cfg.block}, "
                f"{cfg.shared_bytes} bytes of dynamic shared memory, {splits} split(s)): {e}"
            ) from e
        if _debug_sync:
            torch.cuda.current_stream(dev).synchronize()  # raises on an asynchronous error of the kernel


_compiled_cache: dict[tuple, _Compiled] = {}


def _compiled(family: str, dtype: torch.dtype, D: int, fast: bool, dev: int, wide: bool = False) -> _Compiled:
    key = (family, dtype, D, fast, dev, wide)
    c = _compiled_cache.get(key)
    if c is None:
        c = _compiled_cache[key] = _Compiled(choose_variant(family, dtype, D, fast, wide), dev)
    return c


_arch_cache: dict[int, str] = {}


def _arch(dev: int) -> str:
    """The device's architecture as the compile check names it, e.g. ``sm_90``."""
    a = _arch_cache.get(dev)
    if a is None:
        major, minor = torch.cuda.get_device_capability(dev)
        a = _arch_cache[dev] = f"sm_{major}{minor}"
    return a


_stream_cache: dict[tuple[int, int], object] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the cudaStream_t, without a Stream object


def _cupy_stream(dev: int):
    """CuPy's view of torch's current stream on ``dev`` (same cudaStream_t), cached by handle. CuPy 14 takes
    it through the CUDA stream protocol (``Stream.from_external``); older CuPy through ``ExternalStream``."""
    handle = _raw_stream(dev) if _raw_stream is not None else torch.cuda.current_stream(dev).cuda_stream
    st = _stream_cache.get((dev, handle))
    if st is None:
        cp = cupy_module()
        torch_stream = torch.cuda.current_stream(dev)
        if int(torch_stream.cuda_stream) != handle:
            raise RuntimeError(f"torch's current stream on cuda:{dev} changed while it was looked up")
        if hasattr(cp.cuda.Stream, "from_external") and hasattr(torch_stream, "__cuda_stream__"):
            st = cp.cuda.Stream.from_external(torch_stream)
        else:
            st = cp.cuda.ExternalStream(handle, dev)
        _stream_cache[(dev, handle)] = st
    return st


_limits_cache: dict[tuple[Variant, int], DeviceLimits] = {}


def _limits(variant: Variant, device_index: int, kern) -> DeviceLimits:
    key = (variant, device_index)
    lim = _limits_cache.get(key)
    if lim is None:
        lim = _limits_cache[key] = device_limits(device_index, kern)
    return lim


def _kernel_choice(family: str, prob: Problem, dev: int, fast: bool | None) -> tuple[bool, bool]:
    """(fast exp, wide mma kernel) for a call of ``family`` on ``prob``."""
    fast = _settings.fast_exp_of(family) if fast is None else bool(fast)
    wide = family == "mma" and mma_wide_ok(_arch(dev), fast, prob.spec.explicit is not None, prob.scale)
    return fast, wide


def variant_for(family: str, prob: Problem, fast: bool | None = None) -> Variant:
    """The compiled variant a call of ``family`` on ``prob`` launches (benchmarks name it beside their rows)."""
    dev = prob.q.device.index
    fast, wide = _kernel_choice(family, prob, torch.cuda.current_device() if dev is None else dev, fast)
    return choose_variant(family, prob.q.dtype, prob.q.shape[-1], fast, wide)


def _plan(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, fast: bool | None):
    """Everything one launch needs, from the cached compiled kernel and the tensors' pointers and strides
    (each read once): (compiled, config, merge grid, splits, async_copy, struct values, workspace, staged).
    ``staged`` is the buffer the mma kernel writes instead of ``out`` when it cannot store pairs into ``out``
    (:func:`pair_stores_ok`); the launch then copies it into ``out``."""
    q, k, v = prob.q, prob.k, prob.v
    dev = q.device.index
    if dev is None:
        dev = torch.cuda.current_device()
    B, Hq, Nq, D = q.shape
    fast, wide = _kernel_choice(family, prob, dev, fast)
    c = _compiled(family, q.dtype, D, fast, dev, wide)
    q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    q_st, k_st, v_st = q.stride(), k.stride(), v.stride()
    splits, split_tiles, async_copy, workspace, staged = 1, NO_BOUND, False, None, None
    if family == "rowmax":
        async_copy = _settings.rowmax_async_on() and async_ok(q.dtype, D, k_ptr, k_st, v_ptr, v_st)
        splits, split_tiles = rowmax_split_plan(B, Hq, Nq, k.shape[2], c.variant.dmax, c.limits.sm_count,
                                                _settings.rowmax_forced_splits())
        if splits > 1:
            # One allocation: acc [splits][B*Hq*Nq][D], then (m, l) [splits][B*Hq*Nq][2] (see kernel_args).
            workspace = torch.empty(splits * B * Hq * Nq * (D + 2), dtype=torch.float32, device=q.device)
        else:
            split_tiles = NO_BOUND
    elif family == "mma":
        async_copy = _settings.rowmax_async_on() and mma_async_ok(q.dtype, D, ((q_ptr, q_st), (k_ptr, k_st),
                                                                             (v_ptr, v_st)))
        if not pair_stores_ok(D, out.data_ptr(), out.stride()):
            staged = torch.empty((B, Hq, Nq, D + D % 2), dtype=out.dtype, device=out.device)
    cfg, merge_grid = c.config(B, Hq, Nq, splits)
    values = param_values(prob, out if staged is None else staged, lse, async_copy, splits, split_tiles,
                          workspace, q_ptr, k_ptr, v_ptr, q_st, k_st, v_st)
    return c, cfg, merge_grid, splits, async_copy, values, workspace, staged


class PreparedLaunch:
    """A validated launch of one kernel (and rowmax's merge, when it splits) on fixed tensors; calling it
    enqueues the kernel(s) on torch's current stream of the problem's device, and the copy from the mma
    kernel's staging buffer into ``out`` where it needs one (:func:`pair_stores_ok`). Benchmarks call it
    repeatedly, so only the launch (and that copy, part of what a call costs) is on the timed path.

    Attributes: ``variant``, ``config`` (grid, block, shared memory), ``splits``, ``async_copy``, ``params``
    (the packed :data:`PARAMS_DTYPE` argument, size-1 array; its ``out`` is the staging buffer's address when
    there is one) and ``keep_alive`` (the tensors its pointers point into; the staging buffer or None last).
    """

    def __init__(self, family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None,
                 fast: bool | None = None):
        c, cfg, merge_grid, splits, async_copy, values, workspace, staged = _plan(family, prob, out, lse, fast)
        self._compiled, self._merge_grid = c, merge_grid
        self._block = ParamBlock()
        self._block.pack(values)
        self.variant, self.config, self.splits, self.async_copy = c.variant, cfg, splits, async_copy
        self.params = self._block.view
        self.keep_alive = (prob, out, lse, workspace, staged)
        self._copy = None if staged is None else (out, staged[..., : out.shape[-1]])

    def __call__(self) -> None:
        self._compiled.launch(self.config, self._merge_grid, self._block.arg, self.splits)
        if self._copy is not None:
            self._copy[0].copy_(self._copy[1])

    def launch_kernel(self, kernel) -> None:
        """Enqueue ``kernel``, a raw CuPy kernel of this launch's variant (built from other text, say), with this
        launch's grid, block, shared memory and packed parameters on torch's current stream, and nothing else (no
        merge, no copy): how an A/B probe runs another build of a kernel on exactly the public call's launch."""
        self._compiled.launch(self.config, None, self._block.arg, self.splits, function=kernel)


def prepare(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None,
            fast: bool | None = None) -> PreparedLaunch:
    """Compile (once per variant and device), validate the launch, and return a :class:`PreparedLaunch` of
    ``family`` on ``prob`` into ``out`` / ``lse``. ``fast`` overrides the module's fast_exp setting."""
    return PreparedLaunch(family, prob, out, lse, fast)


_local = threading.local()  # each thread's parameter block for run() and the fast calls


def _thread_block() -> ParamBlock:
    """This thread's parameter block (the driver copies it at a launch, so it is free again right after)."""
    block = getattr(_local, "block", None)
    if block is None:
        block = _local.block = ParamBlock()
    return block


def _switches(family: str) -> tuple:
    """The module settings a launch plan depends on besides the call's signature."""
    return (_settings.fast_exp_of(family), _settings.rowmax_async_on(), _settings.rowmax_forced_splits(),
            _settings.mma_wide_on())


def fast_call(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None):
    """After a launch of ``family`` for ``prob`` into ``out`` and ``lse``: a function ``(q, k, v, kv_len, q_len,
    mask, block_table, alibi_slopes, sinks) -> (out, lse or None)`` for a later call of the signature
    (:mod:`attnlab.fast_calls`): it allocates out and lse as the whole way does, writes the call's pointers into
    the planned parameters and launches. None back (take the whole way) once a setting of :func:`_switches`
    changed. None here for an empty call and for one whose plan holds more than the tensors' pointers: lengths
    or a mask (validated and converted on the whole way), a packed call, rowmax's split workspace or a staged
    output."""
    spec = prob.spec
    if spec.kv_len is not None or spec.q_len is not None or spec.explicit is not None or prob.packed is not None:
        return None
    if out.numel() == 0 or prob.Nk == 0:  # the whole way launched nothing
        return None
    if getattr(_local, "declined", None) == (id(prob), id(out)):  # run() just launched it with more than pointers
        return None
    c, cfg, merge_grid, splits, _async, values, workspace, staged = _plan(family, prob, out, lse, None)
    if workspace is not None or staged is not None:
        return None
    # after q, k, v, out, lse: q_len, kv_len, mask, part_acc and part_ml (0 here), then strides and sizes
    fixed = values[5:]
    switches = _switches(family)
    shape = (prob.B, prob.Hq, prob.Nq, prob.Dv) if prob.layout == "bhnd" else (prob.B, prob.Nq, prob.Hq, prob.Dv)
    lse_shape, write_lse, dtype, device = (prob.B, prob.Hq, prob.Nq), lse is not None, prob.out_dtype, prob.device
    empty, f32 = torch.empty, torch.float32

    def call(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks):
        if _switches(family) != switches:
            return None
        o = empty(shape, dtype=dtype, device=device)
        m = empty(lse_shape, dtype=f32, device=device) if write_lse else None
        block = _thread_block()
        block.pack((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0 if m is None else m.data_ptr(),
                    *fixed))
        c.launch(cfg, merge_grid, block.arg, splits)
        return o, m

    return call


def run(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Launch ``family`` on ``prob`` into ``out`` / ``lse`` on torch's current stream.

    The per-call path (every backend call): look up the compiled kernel, read the tensors' pointers and
    strides once, plan rowmax's split (one workspace tensor when it splits) and mma's staging buffer (when
    the output cannot take its column pairs), pack the struct into this thread's parameter block (the driver
    copies it at the launch, so the block is free again right after), take the validated configuration from
    the cache, enqueue, and copy from the staging buffer. A launch that needed either buffer is noted for
    :func:`fast_call`, which the whole way asks next and which then declines without planning again.
    """
    c, cfg, merge_grid, splits, _async, values, workspace, staged = _plan(family, prob, out, lse, None)
    block = _thread_block()
    block.pack(values)
    c.launch(cfg, merge_grid, block.arg, splits)
    if staged is not None:
        out.copy_(staged[..., : out.shape[-1]])
    _local.declined = None if workspace is None and staged is None else (id(prob), id(out))
    del workspace, staged  # freed after use: torch's allocator orders their reuse after these kernels (same stream)
