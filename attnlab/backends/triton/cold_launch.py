"""First launches without Triton's C glue: a new kernel is compiled by Triton's compiler and launched through the
CUDA driver API from Python, while Triton's own launcher is built on a worker thread for the calls after it.

Why: Triton 3.6 builds two C extension modules with the system's C compiler before a process's first launch (its
driver utilities, once per process on an empty cache, and one launcher per kernel signature), inside the first
call a user waits for (docs/decisions.md, "First calls: no autotuning, one compile per kernel", has the times).
Neither is needed to run a compiled kernel: the cubin loads with ``cuModuleLoadData`` and launches with
``cuLaunchKernel``, which ``ctypes`` reaches in libcuda.

The rule:

* :func:`attnlab.backends.triton.runtime.jit_run` replaces ``fn[grid](*args, **kw)`` and :func:`compile_only`
  replaces ``fn.warmup(...)``. They bind and specialize the arguments with the JIT's own binder (so a kernel
  compiles exactly as the JIT would compile it, into Triton's cache), keep the compiled kernels by the JIT's
  cache key, and never touch ``triton.runtime.driver.active`` (whose construction runs the C compiler).
* A compiled kernel's first launches go through :class:`ColdKernel` (``ctypes``: the module loaded on the
  caller's thread, one ``cuLaunchKernel`` per launch). Its Triton launcher is built on a worker thread
  (:func:`attnlab.backends.triton.background.handles`); once it is, every launch goes through it, as before
  (it packs the arguments in C, where this module packs them in Python).
* Only where this is known to be right: triton 3.5 and 3.6 (a launcher per signature; the kernel's parameters are
  its non-constexpr arguments, then the global and profile scratch pointers), a kernel with no scratch buffer,
  one CTA per program, no cooperative launch, and arguments of plain types (pointers, integers, float32); no
  launch hook set (a profiler's hooks see Triton's own launches); ATTNLAB_COLD_LAUNCH not "0". Anything else
  takes the JIT's path. A kernel compiled for programmatic dependent launch (``launch_pdl``, the decode's) is
  launched with ``cuLaunchKernelEx`` and that one attribute, as Triton's launcher launches it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnlab.backends.triton.forward_kernel import triton

#: Whether first launches may skip Triton's C glue (ATTNLAB_COLD_LAUNCH=0: never).
ENABLED: bool = os.environ.get("ATTNLAB_COLD_LAUNCH", "1") != "0"
#: The triton releases whose launch convention this module follows (checked on a GPU with 3.6).
VERSIONS = ((3, 5), (3, 6))

#: The ctypes type of each scalar parameter type of a Triton signature ("*..." pointers are c_void_p).
SCALAR_TYPES: dict[str, type] = {
    "i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32, "i64": ctypes.c_int64,
    "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16, "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float, "fp64": ctypes.c_double,
}


def _version() -> tuple[int, int] | None:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


def usable() -> bool:
    """Whether first launches take the cold path in this process (see the module docstring)."""
    return ENABLED and triton is not None and _version() in VERSIONS and _libcuda() is not None


# -- the driver API ----------------------------------------------------------------------------------------

_CU_FUNC_MAX_THREADS, _CU_FUNC_SHARED_STATIC, _CU_FUNC_LOCAL_BYTES, _CU_FUNC_NUM_REGS = 0, 1, 3, 4
_CU_FUNC_MAX_DYNAMIC_SHARED = 8
_CU_DEV_SHARED_OPTIN = 97
_CU_FUNC_CACHE_PREFER_SHARED = 1
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_lib: Any = None
_lib_tried = False


def _libcuda():
    """libcuda through ctypes, or None where it cannot be loaded (no driver)."""
    global _lib, _lib_tried
    if not _lib_tried:
        _lib_tried = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        if hasattr(lib, "cuLaunchKernelEx"):  # CUDA 11.8 and newer drivers; PDL kernels need it (see _eligible)
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        _lib = lib
    return _lib


class LaunchAttribute(ctypes.Structure):
    """cuda.h's ``CUlaunchAttribute``: an attribute id, padding to 8 bytes, and a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's ``CUlaunchConfig``: grid and block sizes, dynamic shared memory, stream and attributes."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def pdl_config(grid: Sequence[int], block: int, shared: int, stream: int) -> tuple[LaunchConfig, LaunchAttribute]:
    """A ``cuLaunchKernelEx`` config whose one attribute allows programmatic stream serialization (the launch may
    begin before the previous kernel on the stream ends; the kernel's ``griddepcontrol.wait`` orders it), and that
    attribute (keep it alive until the launch has returned)."""
    attr = LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = LaunchConfig(*grid, block, 1, 1, shared, stream, ctypes.pointer(attr), 1)
    return config, attr


def _check(code: int, what: str) -> None:
    if code != 0:
        msg = ctypes.c_char_p()
        _lib.cuGetErrorString(code, ctypes.byref(msg))
        raise RuntimeError(f"attnlab cold launch: {what} failed: {(msg.value or b'?').decode()} (CUresult {code})")


def _attribute(fun: ctypes.c_void_p, attr: int) -> int:
    value = ctypes.c_int()
    _check(_lib.cuFuncGetAttribute(ctypes.byref(value), attr, fun), "cuFuncGetAttribute")
    return value.value


def parameter_types(signature: dict) -> list[type] | None:
    """The ctypes types of a compiled kernel's parameters, from its Triton signature (name -> type, constexprs
    included): one per non-constexpr argument in order, then the global and profile scratch pointers that
    triton 3.5 and 3.6 append. None when a type is not a pointer or a plain scalar (tuples, tensor
    descriptors, 16-bit floats)."""
    types: list[type] = []
    for ty in signature.values():
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            return None
        if ty.startswith("*"):
            types.append(ctypes.c_void_p)
        elif ty in SCALAR_TYPES:
            types.append(SCALAR_TYPES[ty])
        else:
            return None
    return [*types, ctypes.c_void_p, ctypes.c_void_p]


def runtime_values(signature: dict, values: Sequence) -> list:
    """The values of the non-constexpr parameters among ``values`` (every argument in signature order), tensors
    as their addresses."""
    return [v.data_ptr() if isinstance(v, torch.Tensor) else v
            for ty, v in zip(signature.values(), values, strict=True) if ty != "constexpr"]


def pack(types: Sequence[type], values: Sequence) -> tuple[Any, list]:
    """``cuLaunchKernel``'s parameter array for ``values`` (the non-constexpr arguments; the two scratch pointers
    are added as null): an array of addresses, and the ctypes objects it points at (keep them alive until
    the launch has returned)."""
    objs = [t(v) for t, v in zip(types, (*values, 0, 0), strict=True)]
    return (ctypes.c_void_p * len(objs))(*[ctypes.addressof(o) for o in objs]), objs


class ColdKernel:
    """One compiled kernel, loaded into the current context through the driver API, launched by ``ctypes``."""

    def __init__(self, compiled, types: list[type]) -> None:
        self.compiled, self.types = compiled, types
        meta = compiled.metadata
        self.block = 32 * meta.num_warps
        self.shared = meta.shared
        self.pdl = bool(getattr(meta, "launch_pdl", False))
        self.function: ctypes.c_void_p | None = None
        self.n_regs: int | None = None
        self.ready = False  #: Triton's launcher is built: launches go through it
        self._lock = threading.Lock()

    def load(self, device: int) -> None:
        """Load the cubin into ``device``'s primary context (made current if no context is), as Triton's
        ``load_binary`` does, with its shared memory opt-in; raises Triton's OutOfResources if it does not fit."""
        with self._lock:
            if self.function is not None:
                return
            lib = _libcuda()
            ctx = ctypes.c_void_p()
            _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
                _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            optin = ctypes.c_int()
            _check(lib.cuDeviceGetAttribute(ctypes.byref(optin), _CU_DEV_SHARED_OPTIN, device), "cuDeviceGetAttribute")
            if self.shared > optin.value:
                from triton.runtime.errors import OutOfResources
                raise OutOfResources(self.shared, optin.value, "shared memory")
            module, fun = ctypes.c_void_p(), ctypes.c_void_p()
            cubin = ctypes.c_char_p(self.compiled.kernel)
            _check(lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
            _check(lib.cuModuleGetFunction(ctypes.byref(fun), module, self.compiled.name.encode()),
                   "cuModuleGetFunction")
            if self.block > _attribute(fun, _CU_FUNC_MAX_THREADS):
                from triton.runtime.errors import OutOfResources
                raise OutOfResources(self.block, _attribute(fun, _CU_FUNC_MAX_THREADS), "threads")
            if self.shared > 49152:
                _check(lib.cuFuncSetCacheConfig(fun, _CU_FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig")
                dynamic = optin.value - _attribute(fun, _CU_FUNC_SHARED_STATIC)
                _check(lib.cuFuncSetAttribute(fun, _CU_FUNC_MAX_DYNAMIC_SHARED, dynamic), "cuFuncSetAttribute")
            self.n_regs = _attribute(fun, _CU_FUNC_NUM_REGS)
            self.function = fun

    def launch(self, grid: Sequence[int], stream: int, values: Sequence) -> None:
        """Launch on ``grid`` and ``stream`` with ``values``, the non-constexpr arguments in order."""
        gx, gy, gz = grid
        if gx * gy * gz == 0:
            return
        params, _keep = pack(self.types, values)
        if self.pdl:
            config, _attr = pdl_config(grid, self.block, self.shared, stream)
            _check(_lib.cuLaunchKernelEx(ctypes.byref(config), self.function, params, None), "cuLaunchKernelEx")
            return
        _check(_lib.cuLaunchKernel(self.function, gx, gy, gz, self.block, 1, 1, self.shared, stream, params, None),
               "cuLaunchKernel")


def cold_kernel(compiled) -> ColdKernel | None:
    """The :class:`ColdKernel` a compiled kernel was launched through, if it was."""
    return getattr(compiled, "attnlab_cold", None)


# -- compiling as the JIT does -------------------------------------------------------------------------------


class _Binding:
    """The JIT's binder for one kernel on one device, and the kernels compiled through it by cache key."""

    def __init__(self, fn, target) -> None:
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.target = target
        self.backend = make_backend(self.target)
        self.binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        self.keys: dict = {}
        self.kernels: dict[str, Any] = {}


_bindings: dict[tuple, _Binding] = {}
_bindings_lock = threading.Lock()


def device_target(device: int):
    """The Triton target of GPU ``device``, from torch (Triton's own asks its driver module)."""
    from triton.backends.compiler import GPUTarget

    major, minor = torch.cuda.get_device_capability(device)
    return GPUTarget("cuda", major * 10 + minor, 32)


def _binding(fn, target) -> _Binding:
    key = (id(fn), target.backend, target.arch, target.warp_size)
    b = _bindings.get(key)
    if b is None:
        with _bindings_lock:
            b = _bindings.get(key)
            if b is None:
                b = _bindings[key] = _Binding(fn, target)
    return b


def compiled_count(fn) -> int:
    """How many variants of ``fn`` the cold path has compiled in this process."""
    return sum(len(b.kernels) for key, b in list(_bindings.items()) if key[0] == id(fn))


def compile_only(fn, args: Sequence, kw: dict, device: int, target=None):
    """Compile ``fn`` for ``args`` and ``kw`` as ``fn[grid](*args, **kw)`` would on GPU ``device`` (or for
    ``target``, a GPUTarget), with nothing launched and no handles made; returns (the compiled kernel, the bound
    arguments' values in signature order)."""
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.runtime.jit import compute_cache_key

    kw = dict(kw)
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    b = _binding(fn, target if target is not None else device_target(device))
    bound, specialization, options = b.binder(*args, **kw)
    key = compute_cache_key(b.keys, specialization, options)
    compiled = b.kernels.get(key)
    if compiled is None:
        options, signature, constexprs, attrs = fn._pack_args(b.backend, kw, bound, specialization, options)
        source = ASTSource
        if getattr(fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as source
        compiled = triton.compile(source(fn, signature, constexprs, attrs), target=b.target,
                                  options=options.__dict__)
        b.kernels[key] = compiled
    return compiled, tuple(bound.values())


def _eligible(compiled) -> list[type] | None:
    meta = compiled.metadata
    if (getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)
            or getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "tensordesc_meta", None)):
        return None
    if getattr(meta, "launch_pdl", False) and not hasattr(_libcuda(), "cuLaunchKernelEx"):
        return None
    return parameter_types(compiled.src.signature)


def prepare(compiled, device: int, start_handles: Callable[[Any, int, ColdKernel], object]) -> ColdKernel | None:
    """The compiled kernel's :class:`ColdKernel` (made and loaded the first time, when ``start_handles(compiled,
    device, cold)`` is called to build its Triton launcher on a worker thread), or None when this kernel must
    launch through Triton."""
    cold = cold_kernel(compiled)
    if cold is not None or compiled.module is not None:
        return cold
    types = _eligible(compiled)
    if types is None:
        return None
    cold = ColdKernel(compiled, types)
    cold.load(device)
    compiled.attnlab_cold = cold
    start_handles(compiled, device, cold)
    return cold
