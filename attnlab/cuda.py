"""Backends ``cuda-naive``, ``cuda-tiled``, ``cuda-rowmax``: the CUDA C kernels of ``kernels/``, compiled at
run time with NVRTC through CuPy and launched zero-copy on torch tensors.

The pieces, in the order a call goes through them:

* :class:`Variant` names one compiled kernel: family (naive / tiled / rowmax), dtype, the D bucket
  ``dmax`` (the register and shared-memory arrays are sized for it; D itself is a run-time argument) and
  ``fast_exp``. :func:`variants` lists every variant the loader can produce; :func:`choose_variant` picks
  the one for a problem.
* :func:`launch_config` computes grid, block and dynamic shared memory; :func:`validate_launch` checks them
  against the device's limits (pure Python, testable without a GPU) and raises :class:`LaunchConfigError`
  naming the limit and the value.
* :func:`get_kernel` compiles a variant once per device (the kernel file with ``attn_common.cuh`` inlined,
  one NVRTC name expression per variant), caches it, and raises its dynamic shared-memory limit when the
  variant needs more than the default 48 KB.
* :func:`run` launches on torch's current stream: pointers are passed as 64-bit integers (zero copy, any
  strides), scalars as ``numpy.int32`` / ``numpy.int64`` / ``numpy.float32``, and the launch is checked.
* :func:`compile_check_main` (``python -m attnlab compile-check``) compiles every variant for sm_80 and
  sm_90 with NVRTC from the pip package ``nvidia-cuda-nvrtc-cu12`` through ctypes, without a GPU, and
  prints registers, shared memory, stack and spills.

``fast_exp``: :func:`set_fast_exp` (or the :func:`fast_exp` context manager) switches every CUDA backend
between ``expf`` (default, IEEE) and ``__expf`` (hardware ex2.approx, a few ulp less accurate).

rowmax's two launch-time choices (see ``kernels/attn_rowmax.cu``): :func:`can_async_copy` decides whether
its K/V tiles travel by 16-byte ``cp.async`` copies or element by element, and :func:`rowmax_split_plan`
whether a small grid splits each query tile's keys over several blocks (then ``attn_rowmax_merge`` combines
their states). :func:`rowmax_async_copy` and :func:`rowmax_splits` force either choice (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from attnlab.backend import Availability, Backend, cuda_device_reason
from attnlab.problem import Problem

FAMILIES = ("naive", "tiled", "rowmax")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPE_NAMES = {0: "f32", 1: "f16", 2: "bf16"}

#: D buckets per family: a variant compiled for ``dmax`` serves every D <= dmax (naive needs none).
DMAX_BUCKETS = {"naive": (256,), "tiled": (32, 64, 128, 256), "rowmax": (64, 128, 256)}

#: Threads per block and rows per block of each family (must match the kernels).
THREADS = {"naive": 128, "tiled": 128, "rowmax": 256}
ROWS_PER_BLOCK = {"naive": 1, "tiled": 16, "rowmax": 64}

#: Window sides arrive at the kernels clamped to +-NO_BOUND (2^30, as in attn_common.cuh): farther than
#: any row is from any key, so an unbounded side needs no special case.
NO_BOUND = 1 << 30

#: Opt-in shared memory per block (bytes) of the architectures the compile check targets.
SMEM_OPTIN = {"sm_80": 166912, "sm_90": 232448}
DEFAULT_SMEM = 48 * 1024
CUDA_MAX_THREADS = 1024
GRID_LIMITS = (2**31 - 1, 65535, 65535)

_fast_exp = False
_rowmax_async = True  #: let rowmax use cp.async where the inputs allow it
_rowmax_force_splits: int | None = None  #: None: rowmax_split_plan decides
_debug_sync = os.environ.get("ATTNLAB_CUDA_SYNC", "") not in ("", "0")


def set_fast_exp(enabled: bool) -> bool:
    """Use ``__expf`` (True) or ``expf`` (False, default) in every CUDA kernel; returns the old setting."""
    global _fast_exp
    old, _fast_exp = _fast_exp, bool(enabled)
    return old


def get_fast_exp() -> bool:
    return _fast_exp


@contextlib.contextmanager
def fast_exp(enabled: bool = True) -> Iterator[None]:
    """``with attnlab.cuda.fast_exp(): ...`` runs the CUDA backends with ``__expf``, then restores."""
    old = set_fast_exp(enabled)
    try:
        yield
    finally:
        set_fast_exp(old)


@contextlib.contextmanager
def rowmax_async_copy(enabled: bool) -> Iterator[None]:
    """``with rowmax_async_copy(False): ...`` makes rowmax load its K/V tiles element by element even where
    cp.async would apply (to test or time that path), then restores."""
    global _rowmax_async
    old, _rowmax_async = _rowmax_async, bool(enabled)
    try:
        yield
    finally:
        _rowmax_async = old


@contextlib.contextmanager
def rowmax_splits(splits: int | None) -> Iterator[None]:
    """``with rowmax_splits(3): ...`` splits every rowmax query tile's keys over (at most) 3 blocks;
    ``None`` restores the automatic plan of :func:`rowmax_split_plan`."""
    global _rowmax_force_splits
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1 or None; got {splits}")
    old, _rowmax_force_splits = _rowmax_force_splits, splits
    try:
        yield
    finally:
        _rowmax_force_splits = old


def set_debug_sync(enabled: bool) -> bool:
    """Synchronize after every launch and raise on an asynchronous error (also ``ATTNLAB_CUDA_SYNC=1``)."""
    global _debug_sync
    old, _debug_sync = _debug_sync, bool(enabled)
    return old


# ---- variants ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: ``attn_<family><dtype, [dmax,] fast_exp>``."""

    family: str
    dtype: int  #: 0 float32, 1 float16, 2 bfloat16
    dmax: int
    fast_exp: bool

    @property
    def name_expression(self) -> str:
        """The C++ name NVRTC instantiates, e.g. ``attn_rowmax<1, 64, false>``."""
        fe = "true" if self.fast_exp else "false"
        if self.family == "naive":
            return f"attn_naive<{self.dtype}, {fe}>"
        return f"attn_{self.family}<{self.dtype}, {self.dmax}, {fe}>"

    @property
    def label(self) -> str:
        """A short readable name, e.g. ``rowmax_f16_d64`` or ``naive_f32_fastexp``."""
        parts = [self.family, DTYPE_NAMES[self.dtype]]
        if self.family != "naive":
            parts.append(f"d{self.dmax}")
        if self.fast_exp:
            parts.append("fastexp")
        return "_".join(parts)

    @property
    def threads(self) -> int:
        return THREADS[self.family]

    def shared_bytes(self) -> int:
        """Dynamic shared memory per block, from the kernel's own layout (see each .cu file)."""
        d = self.dmax
        if self.family == "naive":
            return 0  # static only: 4 + 4*256 floats
        if self.family == "tiled":
            return 4 * (16 + 32 + 32) * d
        bm, bn = 64, rowmax_bn(d)
        stages = 2 if d <= 128 else 1
        ld = d + 4
        return 4 * (bm * ld + 2 * stages * bn * ld + bn * (bm + 4))  # q_s, k_s and v_s stages, p_t


def rowmax_bn(dmax: int) -> int:
    """Keys per K/V tile of the rowmax kernel (RowmaxTiles::BN)."""
    return 64 if dmax <= 64 else 32


def variants(family: str | None = None) -> list[Variant]:
    """Every variant the loader can produce (all dtypes, D buckets and both exp modes)."""
    fams = FAMILIES if family is None else (family,)
    return [
        Variant(f, dt, dm, fe)
        for f in fams
        for dt in (0, 1, 2)
        for dm in DMAX_BUCKETS[f]
        for fe in (False, True)
    ]


def choose_variant(family: str, dtype: torch.dtype, D: int, fast: bool | None = None) -> Variant:
    """The variant that runs a problem: the smallest D bucket >= D."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; one of {FAMILIES}")
    if dtype not in DTYPE_CODES:
        raise TypeError(f"the CUDA kernels take float32, float16 or bfloat16; got {dtype}")
    for dm in DMAX_BUCKETS[family]:
        if D <= dm:
            return Variant(family, DTYPE_CODES[dtype], dm, _fast_exp if fast is None else bool(fast))
    raise ValueError(f"head dim D = {D} exceeds the largest bucket {DMAX_BUCKETS[family][-1]} of {family}")


# ---- launch configuration ----------------------------------------------------------------------------


class LaunchConfigError(ValueError):
    """A launch configuration exceeds a device limit; the message names the limit and the value."""


@dataclass(frozen=True)
class LaunchConfig:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int


@dataclass(frozen=True)
class DeviceLimits:
    """The limits a launch is checked against (read from the device, or given for a target arch)."""

    max_threads_per_block: int = CUDA_MAX_THREADS
    max_shared_optin: int = SMEM_OPTIN["sm_90"]
    max_grid: tuple[int, int, int] = GRID_LIMITS
    kernel_max_threads: int | None = None  #: the compiled kernel's own limit (launch bounds, registers)
    sm_count: int = 132  #: multiprocessors (rowmax's split plan fills them)


def launch_config(variant: Variant, prob_B: int, prob_Hq: int, prob_Nq: int, splits: int = 1) -> LaunchConfig:
    """Grid, block and dynamic shared memory of ``variant`` for a [B, Hq, Nq, .] query (``splits``: rowmax's
    key splits, grid z)."""
    rows = ROWS_PER_BLOCK[variant.family]
    tiles = -(-prob_Nq // rows)
    if variant.family == "naive":
        grid = (prob_Nq, prob_B * prob_Hq, 1)
    else:
        grid = (prob_B * prob_Hq, tiles, splits if variant.family == "rowmax" else 1)
    return LaunchConfig(grid=grid, block=(variant.threads, 1, 1), shared_bytes=variant.shared_bytes())


def validate_launch(cfg: LaunchConfig, limits: DeviceLimits, what: str = "kernel") -> None:
    """Raise :class:`LaunchConfigError` when ``cfg`` exceeds ``limits``; the message names both numbers."""
    threads = cfg.block[0] * cfg.block[1] * cfg.block[2]
    if threads < 1 or threads > limits.max_threads_per_block:
        raise LaunchConfigError(
            f"{what}: {threads} threads per block exceeds the device limit of "
            f"{limits.max_threads_per_block} threads per block"
        )
    if limits.kernel_max_threads is not None and threads > limits.kernel_max_threads:
        raise LaunchConfigError(
            f"{what}: {threads} threads per block exceeds this compiled kernel's limit of "
            f"{limits.kernel_max_threads} (cudaFuncAttributeMaxThreadsPerBlock: launch bounds / registers)"
        )
    if cfg.shared_bytes > limits.max_shared_optin:
        raise LaunchConfigError(
            f"{what}: {cfg.shared_bytes} bytes of dynamic shared memory per block exceeds the device's "
            f"opt-in limit of {limits.max_shared_optin} bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin)"
        )
    for axis, (n, lim) in enumerate(zip(cfg.grid, limits.max_grid)):
        if n < 1 or n > lim:
            raise LaunchConfigError(
                f"{what}: grid dimension {'xyz'[axis]} = {n} is outside the device limit [1, {lim}]"
            )


def rowmax_split_plan(B: int, Hq: int, Nq: int, Nk: int, dmax: int, sm_count: int,
                      force: int | None = None) -> tuple[int, int]:
    """(splits, split_tiles) for the rowmax kernel: each query tile's key range is cut into pieces of
    ``split_tiles`` key tiles, one block each (grid z = splits).

    Grids of at least two blocks per multiprocessor are not split (splits = 1). Smaller grids get enough
    splits for about four blocks per multiprocessor, but every split keeps at least four key tiles (the
    merge and the partial states cost about what one tile does) and there are at most 16. ``force`` asks
    for that many splits (capped by the key tiles).
    """
    key_tiles = max(1, -(-Nk // rowmax_bn(dmax)))
    blocks = B * Hq * -(-Nq // ROWS_PER_BLOCK["rowmax"])
    if force is not None:
        splits = max(1, min(int(force), key_tiles))
    elif blocks >= 2 * sm_count:
        splits = 1
    else:
        splits = max(1, min(-(-4 * sm_count // blocks), key_tiles // 4, 16))
    split_tiles = -(-key_tiles // splits)
    return -(-key_tiles // split_tiles), split_tiles  # no trailing split without tiles


def can_async_copy(prob: Problem) -> bool:
    """Whether rowmax may copy K/V rows with 16-byte cp.async: float32, D a multiple of 4, unit stride on
    D, and every K/V row start 16-byte aligned (pointers and the b/h/n strides multiples of 4 elements)."""
    if prob.dtype != torch.float32 or prob.D % 4 != 0:
        return False
    for t in (prob.k, prob.v):
        if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
            return False
        if any(s % 4 != 0 for s in t.stride()[:3]):
            return False
    return True


# ---- sources -----------------------------------------------------------------------------------------


def kernels_dir():
    """Where the .cu files are: the package ``attnlab.kernels`` of an installed wheel, else ``kernels/``
    beside ``attnlab/`` in a source checkout (``PYTHONPATH=.``)."""
    try:
        return resources.files("attnlab.kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "kernels"


def kernel_source(family: str) -> str:
    """The CUDA source of ``family`` with ``attn_common.cuh`` inlined (one text: NVRTC needs no include
    path, and CuPy's on-disk cache key, the source text, changes whenever the header does)."""
    pkg = kernels_dir()
    src = pkg.joinpath(f"attn_{family}.cu").read_text()
    common = pkg.joinpath("attn_common.cuh").read_text()
    return "// ---- attn_common.cuh (inlined) ----\n" + common + f"\n// ---- attn_{family}.cu ----\n" + src


NVRTC_OPTIONS = ("-std=c++17",)


# ---- compiling and launching through CuPy ------------------------------------------------------------

_kernel_cache: dict[tuple, object] = {}
_cache_lock = threading.Lock()


def _cupy():
    import cupy  # lazily: attnlab imports without CuPy

    return cupy


#: cudaDeviceAttr values (driver_types.h): stable numbers, so no header or enum lookup is needed.
_ATTR_MAX_THREADS_PER_BLOCK = 1
_ATTR_MAX_GRID_DIM = (5, 6, 7)
_ATTR_MAX_SHARED_PER_BLOCK_OPTIN = 97
_ATTR_MULTIPROCESSOR_COUNT = 16


def device_limits(device_index: int, kernel=None) -> DeviceLimits:
    """The launch limits of a device (and of a compiled kernel, when given)."""
    rt = _cupy().cuda.runtime
    attr = lambda a: int(rt.deviceGetAttribute(a, device_index))
    kmax = None if kernel is None else int(kernel.max_threads_per_block)
    return DeviceLimits(
        max_threads_per_block=attr(_ATTR_MAX_THREADS_PER_BLOCK),
        max_shared_optin=attr(_ATTR_MAX_SHARED_PER_BLOCK_OPTIN),
        max_grid=tuple(attr(a) for a in _ATTR_MAX_GRID_DIM),
        kernel_max_threads=kmax,
        sm_count=attr(_ATTR_MULTIPROCESSOR_COUNT),
    )


def get_kernel(variant: Variant, device_index: int):
    """The compiled ``cupy.RawKernel`` of ``variant`` on a device, compiled once and cached."""
    key = (variant, device_index)
    kern = _kernel_cache.get(key)
    if kern is not None:
        return kern
    with _cache_lock:
        kern = _kernel_cache.get(key)
        if kern is None:
            cp = _cupy()
            with cp.cuda.Device(device_index):
                mod = cp.RawModule(
                    code=kernel_source(variant.family), options=NVRTC_OPTIONS,
                    name_expressions=[variant.name_expression],
                )
                kern = mod.get_function(variant.name_expression)
                need = variant.shared_bytes()
                if need > DEFAULT_SMEM:
                    limits = device_limits(device_index)
                    validate_launch(LaunchConfig((1, 1, 1), (variant.threads, 1, 1), need), limits, variant.label)
                    kern.max_dynamic_shared_size_bytes = need  # cudaFuncAttributeMaxDynamicSharedMemorySize
            _kernel_cache[key] = kern
    return kern


#: The merge kernel of rowmax's split keys (one per dtype; 4 rows = 4 warps per block).
MERGE_THREADS = 128


def merge_name_expression(dtype_code: int) -> str:
    return f"attn_rowmax_merge<{dtype_code}>"


def get_merge_kernel(dtype_code: int, device_index: int):
    """The compiled ``attn_rowmax_merge<dtype>`` on a device, compiled once and cached."""
    key = ("merge", dtype_code, device_index)
    kern = _kernel_cache.get(key)
    if kern is None:
        with _cache_lock:
            kern = _kernel_cache.get(key)
            if kern is None:
                cp = _cupy()
                name = merge_name_expression(dtype_code)
                with cp.cuda.Device(device_index):
                    mod = cp.RawModule(code=kernel_source("rowmax"), options=NVRTC_OPTIONS, name_expressions=[name])
                    kern = mod.get_function(name)
                _kernel_cache[key] = kern
    return kern


def _ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's data pointer as a kernel argument (8 bytes, as a pointer is): zero copy, any strides."""
    return np.uint64(0 if t is None else t.data_ptr())


def _strides(t: torch.Tensor | None, n: int) -> list[np.int64]:
    if t is None:
        return [np.int64(0)] * n
    return [np.int64(s) for s in t.stride()]


def _clamp_bound(x: int | None) -> np.int32:
    return np.int32(NO_BOUND if x is None else max(-NO_BOUND, min(NO_BOUND, int(x))))


def kernel_args(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> tuple:
    """The argument tuple of every attention kernel, in the order of their signatures.

    Pointers go as ``numpy.uint64`` (a device pointer is 8 bytes), sizes as ``numpy.int32``, strides (in
    elements) as ``numpy.int64``, the scale as ``numpy.float32``. The lengths are the spec's (contiguous
    int32 already). The caller must keep ``prob``, ``out`` and ``lse`` alive until the kernel has run.
    """
    spec = prob.spec
    if spec.mask is not None:
        mask, kind = spec.mask.view(torch.uint8), 1
    elif spec.bias is not None:
        mask, kind = spec.bias, 2
    else:
        mask, kind = None, 0
    return (
        _ptr(prob.q), _ptr(prob.k), _ptr(prob.v), _ptr(out), _ptr(lse),
        _ptr(spec.q_len), _ptr(spec.kv_len), _ptr(mask), np.int32(kind),
        np.int32(prob.Hq), np.int32(prob.group), np.int32(prob.Nq), np.int32(prob.Nk), np.int32(prob.D),
        np.float32(prob.scale),
        _clamp_bound(spec.left), _clamp_bound(spec.right), np.int32(spec.align == "bottom_right"),
        *_strides(prob.q, 4), *_strides(prob.k, 4), *_strides(prob.v, 4), *_strides(out, 4),
        *_strides(lse, 3), *_strides(mask, 4),
    )


_limits_cache: dict[tuple[Variant, int], DeviceLimits] = {}
_stream_cache: dict[tuple[int, int], object] = {}


def _cupy_stream(torch_stream: torch.cuda.Stream, dev: int):
    """CuPy's view of a torch stream (same cudaStream_t), cached by handle. CuPy 14 takes it through the
    CUDA stream protocol (``Stream.from_external``); older CuPy through ``ExternalStream``."""
    key = (dev, int(torch_stream.cuda_stream))
    st = _stream_cache.get(key)
    if st is None:
        cp = _cupy()
        if hasattr(cp.cuda.Stream, "from_external") and hasattr(torch_stream, "__cuda_stream__"):
            st = cp.cuda.Stream.from_external(torch_stream)
        else:
            st = cp.cuda.ExternalStream(key[1], dev)
        _stream_cache[key] = st
    return st


def _limits(variant: Variant, device_index: int, kern) -> DeviceLimits:
    key = (variant, device_index)
    lim = _limits_cache.get(key)
    if lim is None:
        lim = _limits_cache[key] = device_limits(device_index, kern)
    return lim


def prepare(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None,
            fast: bool | None = None):
    """Compile (once), validate the launch, and return a function that launches ``family`` on ``prob``.

    Calling the returned function launches on torch's current stream of the problem's device, every time
    (benchmarks call it repeatedly, so only the launch itself is on the timed path). ``fast`` overrides
    the module's fast_exp setting.
    """
    cp = _cupy()
    variant = choose_variant(family, prob.dtype, prob.D, fast)
    dev = prob.device.index if prob.device.index is not None else torch.cuda.current_device()
    kern = get_kernel(variant, dev)
    limits = _limits(variant, dev, kern)
    args = kernel_args(prob, out, lse)
    keep_alive: tuple = (prob, out, lse)  # the pointers in args point into these
    splits, merge, async_copy = 1, None, False
    if family == "rowmax":
        async_copy = _rowmax_async and can_async_copy(prob)
        splits, split_tiles = rowmax_split_plan(prob.B, prob.Hq, prob.Nq, prob.Nk, variant.dmax, limits.sm_count,
                                                _rowmax_force_splits)
        part_acc = part_ml = None
        if splits > 1:
            # Workspace of the split states: acc [splits][B*Hq*Nq][D], (m, l) [splits][B*Hq*Nq][2].
            rows = prob.B * prob.Hq * prob.Nq
            part_acc = torch.empty(splits * rows * prob.D, dtype=torch.float32, device=prob.device)
            part_ml = torch.empty(splits * rows * 2, dtype=torch.float32, device=prob.device)
            merge_args = (
                _ptr(part_acc), _ptr(part_ml), _ptr(out), _ptr(lse), np.int32(splits), np.int32(prob.Hq),
                np.int32(prob.Nq), np.int32(prob.D), np.int64(rows), *_strides(out, 4), *_strides(lse, 3),
            )
            merge_grid = (-(-rows // (MERGE_THREADS // 32)), 1, 1)
            merge = (get_merge_kernel(variant.dtype, dev), merge_grid, merge_args)
        args = (*args, np.int32(async_copy), np.int32(split_tiles if splits > 1 else NO_BOUND),
                _ptr(part_acc), _ptr(part_ml))
        keep_alive = (*keep_alive, part_acc, part_ml)
    cfg = launch_config(variant, prob.B, prob.Hq, prob.Nq, splits)
    validate_launch(cfg, limits, variant.label)

    def launch() -> None:
        torch_stream = torch.cuda.current_stream(prob.device)
        with cp.cuda.Device(dev):
            stream = _cupy_stream(torch_stream, dev)
            try:
                with stream:
                    kern(cfg.grid, cfg.block, args, shared_mem=cfg.shared_bytes)
                    if merge is not None:
                        merge[0](merge[1], (MERGE_THREADS, 1, 1), merge[2])
            except Exception as e:
                raise RuntimeError(
                    f"launch of {variant.label} failed (grid {cfg.grid}, block {cfg.block}, "
                    f"{cfg.shared_bytes} bytes of dynamic shared memory): {e}"
                ) from e
            if _debug_sync:
                torch_stream.synchronize()  # raises on an asynchronous error of the kernel

    launch.variant = variant  # type: ignore[attr-defined]
    launch.config = cfg  # type: ignore[attr-defined]
    launch.splits = splits  # type: ignore[attr-defined]
    launch.async_copy = async_copy  # type: ignore[attr-defined]
    launch.keep_alive = keep_alive  # type: ignore[attr-defined]
    return launch


def run(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Launch ``family`` on ``prob`` into ``out`` / ``lse`` on torch's current stream."""
    prepare(family, prob, out, lse)()


# ---- backends ----------------------------------------------------------------------------------------


class _CudaBackend(Backend):
    family = ""

    def availability(self) -> Availability:
        try:
            import cupy  # noqa: F401
        except Exception as e:  # ImportError, or a broken CUDA install
            return Availability(False, f"cupy is not importable ({type(e).__name__}: {e})")
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA GPU (torch.cuda.is_available() is False)")
        return Availability(True)

    def unsupported(self, prob: Problem) -> str | None:
        why = cuda_device_reason(prob)
        if why is not None:
            return why
        if prob.dtype not in DTYPE_CODES:
            return f"dtype {prob.dtype} (the CUDA kernels take float32, float16, bfloat16)"
        if prob.B * prob.Hq > GRID_LIMITS[1] and self.family == "naive":
            return f"B*Hq = {prob.B * prob.Hq} exceeds the grid limit {GRID_LIMITS[1]} of the naive kernel"
        return None

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        run(self.family, prob, out, lse)


class CudaNaiveBackend(_CudaBackend):
    name = "cuda-naive"
    family = "naive"
    description = "three-pass CUDA kernel: max, sum of exp, weighted sum (one block per (bh, query))"


class CudaTiledBackend(_CudaBackend):
    name = "cuda-tiled"
    family = "tiled"
    description = "tiled CUDA kernel: Q tile in shared memory, K/V tiles streamed, online softmax per element"


class CudaRowmaxBackend(_CudaBackend):
    name = "cuda-rowmax"
    family = "rowmax"
    description = "tiled CUDA kernel with block-wise rowmax (one exp per score) and register micro-tiles"


# ---- compile check without a GPU ---------------------------------------------------------------------


def find_nvrtc() -> str:
    """Path of libnvrtc from the pip package nvidia-cuda-nvrtc-cu12 (or $ATTNLAB_NVRTC)."""
    env = os.environ.get("ATTNLAB_NVRTC")
    if env:
        return env
    cands: list[str] = []
    for entry in sys.path:
        for sub in ("nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib64"):
            cands += sorted(glob.glob(os.path.join(entry, sub, "libnvrtc.so*")))
    cands = [c for c in cands if "builtins" not in c and ".alt." not in c]
    if not cands:
        raise FileNotFoundError(
            "libnvrtc not found: install the pip package nvidia-cuda-nvrtc-cu12 (or set ATTNLAB_NVRTC)"
        )
    return cands[0]


@dataclass
class Resources:
    """What ptxas reported for one compiled kernel."""

    variant: Variant
    arch: str
    registers: int = -1
    static_smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_RE_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """``-Xptxas -v`` output -> {mangled name: registers, smem, stack, spill_stores, spill_loads}."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            cur = out.setdefault(m.group(1), {"registers": -1, "smem": 0, "stack": 0, "spill_stores": 0,
                                              "spill_loads": 0})
            continue
        if cur is None:
            continue
        m = _RE_PROPS.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = (int(x) for x in m.groups())
            continue
        m = _RE_USED.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            cur["smem"] = int(m.group(2) or 0)
    return out


class Nvrtc:
    """The few NVRTC calls the compile check needs, through ctypes (no GPU, no CUDA driver)."""

    def __init__(self, path: str | None = None):
        self.path = path or find_nvrtc()
        # NVRTC opens libnvrtc-builtins by soname at compile time: load the one beside it first, so a
        # library found outside the loader's path (a pip wheel) works without LD_LIBRARY_PATH.
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(self.path), "libnvrtc-builtins.so*"))):
            if ".alt." not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                break
        self.lib = ctypes.CDLL(self.path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> tuple[int, int]:
        a, b = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b)), "nvrtcVersion")
        return a.value, b.value

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source: str, name: str, options: Sequence[str], name_expressions: Sequence[str]):
        """Compile; returns (ok, log, {name expression: lowered (mangled) name})."""
        prog = ctypes.c_void_p()
        self._check(
            self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            for ne in name_expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, ne.encode()), "nvrtcAddNameExpression")
            opts = [o.encode() for o in options]
            arr = (ctypes.c_char_p * len(opts))(*opts)
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            lowered = {}
            if rc == 0:
                for ne in name_expressions:
                    p = ctypes.c_char_p()
                    self._check(self.lib.nvrtcGetLoweredName(prog, ne.encode(), ctypes.byref(p)),
                                "nvrtcGetLoweredName")
                    lowered[ne] = p.value.decode()
            return rc == 0, log, lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_family(nvrtc: Nvrtc, family: str, arch: str, vs: Sequence[Variant]) -> tuple[list[Resources], str]:
    """Compile all of ``vs`` (one family) for ``arch`` in one NVRTC program; (resources, error log or '')."""
    opts = [*NVRTC_OPTIONS, f"--gpu-architecture={arch}", "-Xptxas", "-v"]
    extra = [merge_name_expression(dt) for dt in (0, 1, 2)] if family == "rowmax" else []
    ok, log, lowered = nvrtc.compile(kernel_source(family), f"attn_{family}.cu", opts,
                                     [v.name_expression for v in vs] + extra)
    if not ok:
        return [], log
    info = parse_ptxas_log(log)
    res = []
    for v in vs:
        r = info.get(lowered[v.name_expression])
        if r is None:
            return [], f"ptxas printed no resource line for {v.label} ({lowered[v.name_expression]})\n{log}"
        res.append(Resources(v, arch, r["registers"], r["smem"], r["stack"], r["spill_stores"], r["spill_loads"]))
    return res, ""


def compile_check(archs: Sequence[str] = ("sm_80", "sm_90"), families: Sequence[str] = FAMILIES,
                  jobs: int = 2) -> tuple[list[Resources], list[str]]:
    """Compile every variant for every arch; returns (resources, error messages)."""
    nvrtc = Nvrtc()
    work = [(f, a) for f in families for a in archs]
    results: list[Resources] = []
    errors: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futs = [pool.submit(compile_family, nvrtc, f, a, variants(f)) for f, a in work]
        for (f, a), fut in zip(work, futs):
            res, err = fut.result()
            if err:
                errors.append(f"compile error in attn_{f}.cu for {a}:\n{err}")
            results += res
    return results, errors


def strict_problems(results: Sequence[Resources]) -> list[str]:
    """What ``--strict`` fails on: spills in tiled/rowmax for D <= 128, shared memory over the arch limit."""
    bad = []
    for r in results:
        v = r.variant
        if v.family in ("tiled", "rowmax") and v.dmax <= 128 and r.spills > 0:
            bad.append(f"{v.label} {r.arch}: {r.spill_stores} bytes spill stores, {r.spill_loads} bytes spill loads")
        total = v.shared_bytes() + r.static_smem
        if total > SMEM_OPTIN.get(r.arch, SMEM_OPTIN["sm_90"]):
            bad.append(f"{v.label} {r.arch}: {total} bytes of shared memory exceeds the opt-in limit "
                       f"{SMEM_OPTIN[r.arch]}")
    return bad


def format_table(results: Sequence[Resources]) -> str:
    head = f"{'variant':<26} {'arch':<6} {'regs':>5} {'smem_static':>11} {'smem_dyn':>9} {'stack':>6} " \
           f"{'spill_st':>8} {'spill_ld':>8}"
    lines = [head, "-" * len(head)]
    for r in sorted(results, key=lambda r: (FAMILIES.index(r.variant.family), r.variant.label, r.arch)):
        lines.append(
            f"{r.variant.label:<26} {r.arch:<6} {r.registers:>5} {r.static_smem:>11} "
            f"{r.variant.shared_bytes():>9} {r.stack:>6} {r.spill_stores:>8} {r.spill_loads:>8}"
        )
    return "\n".join(lines)


def compile_check_main(argv: list[str]) -> int:
    """``python -m attnlab compile-check [--strict] [--arch sm_80 sm_90] [--family ...] [--jobs N]``."""
    ap = argparse.ArgumentParser(prog="attnlab compile-check",
                                 description="compile every CUDA kernel variant with NVRTC (no GPU needed)")
    ap.add_argument("--strict", action="store_true",
                    help="fail on a spill in tiled/rowmax for D <= 128 or shared memory over the arch limit")
    ap.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    ap.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 2))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        nv = Nvrtc()
    except (OSError, FileNotFoundError) as e:
        print(f"compile-check: {e}", file=sys.stderr)
        return 2
    major, minor = nv.version()
    print(f"NVRTC {major}.{minor} from {nv.path}")
    results, errors = compile_check(args.arch, args.family, args.jobs)
    print(format_table(results))
    print(f"{len(results)} kernels compiled in {time.perf_counter() - t0:.1f} s")
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        return 1
    if args.strict:
        bad = strict_problems(results)
        for b in bad:
            print(f"strict: {b}", file=sys.stderr)
        if bad:
            return 1
        print("strict: no spills in tiled/rowmax for D <= 128; shared memory within every arch's limit")
    return 0
