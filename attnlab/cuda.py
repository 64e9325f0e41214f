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
  one NVRTC run per variant; a rowmax variant's also instantiates the merge kernel of its dtype), caches
  it, and raises its dynamic shared-memory limit when the variant needs more than the default 48 KB.
* :func:`run` launches on torch's current stream. Every kernel takes one argument, ``struct AttnParams``
  (``kernels/attn_common.cuh``; :data:`PARAMS_DTYPE` is its numpy twin): tensor pointers (zero copy, any
  strides), strides, sizes, the mask rule. It is packed with one :mod:`struct` call and handed to CuPy as
  one host address, so a launch converts no Python scalars; the compiled kernel, the device limits, the
  validated configurations and CuPy's view of torch's stream are cached, and the launch names the stream
  instead of switching CuPy's current one (the device is switched only when another one is current).
  :func:`prepare` does the same once and returns a :class:`PreparedLaunch` to call repeatedly.
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

import contextlib
import ctypes
import functools
import glob
import os
import re
import struct
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

from attnlab.backend import Availability, Backend, cuda_device_reason, no_cuda_reason
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


@functools.lru_cache(maxsize=4096)
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
    return _async_ok(prob.dtype, prob.D, prob.k.data_ptr(), prob.k.stride(), prob.v.data_ptr(), prob.v.stride())


def _async_ok(dtype: torch.dtype, D: int, k_ptr: int, k_strides: tuple, v_ptr: int, v_strides: tuple) -> bool:
    if dtype != torch.float32 or D % 4 != 0:
        return False
    for ptr, st in ((k_ptr, k_strides), (v_ptr, v_strides)):
        if st[3] != 1 or ptr % 16 != 0 or st[0] % 4 != 0 or st[1] % 4 != 0 or st[2] % 4 != 0:
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


#: The merge kernel of rowmax's split keys (one per dtype; 4 rows = 4 warps per block).
MERGE_THREADS = 128


def merge_name_expression(dtype_code: int) -> str:
    return f"attn_rowmax_merge<{dtype_code}>"


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
            cp = _cupy()
            merge_name = merge_name_expression(variant.dtype) if variant.family == "rowmax" else None
            with cp.cuda.Device(device_index):
                mod = cp.RawModule(
                    code=kernel_source(variant.family), options=NVRTC_OPTIONS,
                    name_expressions=[variant.name_expression] + ([merge_name] if merge_name else []),
                )
                kern = mod.get_function(variant.name_expression)
                need = variant.shared_bytes()
                if need > DEFAULT_SMEM:
                    limits = device_limits(device_index)
                    validate_launch(LaunchConfig((1, 1, 1), (variant.threads, 1, 1), need), limits, variant.label)
                    kern.max_dynamic_shared_size_bytes = need  # cudaFuncAttributeMaxDynamicSharedMemorySize
                got = (kern, mod.get_function(merge_name) if merge_name else None)
            _kernel_cache[key] = got
    return got


def get_kernel(variant: Variant, device_index: int):
    """The compiled ``cupy.RawKernel`` of ``variant`` on a device, compiled once and cached."""
    return _compiled_module(variant, device_index)[0]


# ---- the kernels' one argument: struct AttnParams ---------------------------------------------------------

#: ``struct Strides4`` of kernels/attn_common.cuh: the four strides (in elements) of a [B, H, N, D] view.
STRIDES4_DTYPE = np.dtype([(n, np.int64) for n in "bhnd"], align=True)

#: ``struct AttnParams`` of kernels/attn_common.cuh, field for field and in its order. ``align=True`` lays
#: the fields out by C's rules (each at a multiple of its own alignment, the size a multiple of the largest),
#: as NVRTC does for this plain struct. A launch passes the struct by value: its bytes (packed by
#: ``_PARAMS_PACK`` into a :class:`_ParamBlock`) go to the driver by address. tests/test_cuda.py checks every
#: field's offset against NVRTC's own layout of the C declaration.
PARAMS_DTYPE = np.dtype(
    [(n, np.uint64) for n in ("q", "k", "v", "out", "lse", "q_len", "kv_len", "mask", "part_acc", "part_ml")]
    + [(n, STRIDES4_DTYPE) for n in ("qs", "ks", "vs", "os", "ms")]
    + [(n, np.int64) for n in ("lse_sb", "lse_sh", "lse_sn")]
    + [(n, np.int32) for n in ("B", "Hq", "group", "Nq", "Nk", "D")]
    + [("scale", np.float32)]
    + [(n, np.int32) for n in ("mask_kind", "left", "right", "bottom_right", "async_copy", "split_tiles", "splits")],
    align=True,
)

_STRUCT_CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.float32): "f"}


def struct_format(dtype: np.dtype) -> str:
    """The :mod:`struct` format that packs the scalar fields of ``dtype`` (nested structs flattened, in
    order) into exactly its bytes: pad bytes where the dtype has padding, native byte order."""

    def walk(dt: np.dtype, base: int) -> tuple[str, int]:
        parts, pos = [], base
        for name in dt.names:
            sub, off = dt.fields[name][0], base + dt.fields[name][1]
            if off < pos:
                raise ValueError(f"field {name!r} of {dt} overlaps the one before it")
            parts.append("x" * (off - pos))
            if sub.names:
                fmt, pos = walk(sub, off)
                parts.append(fmt)
            else:
                parts.append(_STRUCT_CODES[sub])
                pos = off + sub.itemsize
        end = base + dt.itemsize
        return "".join(parts) + "x" * (end - pos), end

    return "=" + walk(dtype, 0)[0]


_PARAMS_PACK = struct.Struct(struct_format(PARAMS_DTYPE))
_NO_STRIDES4 = (0, 0, 0, 0)


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _clamp_bound(x: int | None) -> int:
    return NO_BOUND if x is None else max(-NO_BOUND, min(NO_BOUND, int(x)))


def _param_values(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, async_copy: bool, splits: int,
                  split_tiles: int, workspace: torch.Tensor | None, q_ptr: int, k_ptr: int, v_ptr: int,
                  q_st: tuple, k_st: tuple, v_st: tuple) -> tuple:
    """The fields of ``struct AttnParams`` in order, nested strides flattened (what ``_PARAMS_PACK`` packs)."""
    spec = prob.spec
    mask = spec.explicit  # a bool mask is read as bytes, a bias as float32
    kind = 0 if mask is None else 1 if spec.mask is not None else 2
    B, Hq, Nq, D = prob.q.shape
    Hkv, Nk = prob.k.shape[1], prob.k.shape[2]
    part_acc = part_ml = 0
    if workspace is not None:
        part_acc = workspace.data_ptr()
        part_ml = part_acc + 4 * splits * B * Hq * Nq * D
    return (
        q_ptr, k_ptr, v_ptr, out.data_ptr(), _addr(lse), _addr(spec.q_len), _addr(spec.kv_len), _addr(mask),
        part_acc, part_ml,
        *q_st, *k_st, *v_st, *out.stride(), *(_NO_STRIDES4 if mask is None else mask.stride()),
        *((0, 0, 0) if lse is None else lse.stride()),
        B, Hq, Hq // Hkv, Nq, Nk, D, prob.scale,
        kind, _clamp_bound(spec.left), _clamp_bound(spec.right), int(spec.align == "bottom_right"),
        int(async_copy), split_tiles, splits,
    )


def kernel_args(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, *, async_copy: bool = False,
                splits: int = 1, split_tiles: int = NO_BOUND, workspace: torch.Tensor | None = None) -> np.ndarray:
    """The one argument of every attention kernel as a size-1 array of :data:`PARAMS_DTYPE` (``struct
    AttnParams``; a writable view of the packed bytes).

    Pointers are the tensors' data pointers (zero copy, any strides; 0 for an absent tensor), strides are in
    elements. ``async_copy``, ``splits``, ``split_tiles`` and ``workspace`` (float32, ``splits * B*Hq*Nq *
    (D + 2)`` elements: the split states' acc, then their (m, l)) are rowmax's. The caller keeps ``prob``,
    ``out``, ``lse`` and ``workspace`` alive until the kernel has run.
    """
    q, k, v = prob.q, prob.k, prob.v
    values = _param_values(prob, out, lse, async_copy, splits, split_tiles, workspace, q.data_ptr(), k.data_ptr(),
                           v.data_ptr(), q.stride(), k.stride(), v.stride())
    return np.frombuffer(bytearray(_PARAMS_PACK.pack(*values)), dtype=PARAMS_DTYPE)


# ---- launching ---------------------------------------------------------------------------------------------


class _ParamBlock:
    """Host bytes of one ``struct AttnParams`` and the CuPy kernel argument that passes them by value.

    CuPy launches by handing the driver one host address per kernel parameter, and the driver copies
    ``sizeof(parameter)`` bytes from it when the launch is enqueued. A ``cupy.cuda.function.CPointer`` is
    such an address, taken as it is; it is made once per block, so a launch converts nothing. (A size-1
    structured numpy array would also do, as CuPy documents, but CuPy reads its ``__array_interface__``
    on every launch, and numpy builds that dict field by field for a structured dtype: tens of
    microseconds per launch.) Without CPointer, a size-1 array of an unstructured void dtype is passed.
    """

    __slots__ = ("arg", "buffer", "view")

    def __init__(self) -> None:
        self.buffer = bytearray(PARAMS_DTYPE.itemsize)
        self.view = np.frombuffer(self.buffer, dtype=PARAMS_DTYPE)  # shares the bytes (inspection, tests)
        cpointer = getattr(_cupy().cuda.function, "CPointer", None)
        if cpointer is not None:
            self.arg = cpointer(self.view.ctypes.data)
        else:
            self.arg = self.view.view(np.dtype((np.void, PARAMS_DTYPE.itemsize)))

    def pack(self, values: tuple) -> None:
        _PARAMS_PACK.pack_into(self.buffer, 0, *values)


class _Compiled:
    """What a launch of one (family, dtype, D, fast_exp) on one device needs and what stays the same from
    call to call: the variant, its compiled kernel as a CuPy ``Function`` of that device (whose launch takes
    the stream as an argument, so no current-stream switch is needed), rowmax's merge kernel, the device's
    limits, and the launch configurations already validated against them."""

    def __init__(self, variant: Variant, dev: int):
        cp = self.cupy = _cupy()
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

    def launch(self, cfg: LaunchConfig, merge_grid: tuple[int, int, int] | None, arg, splits: int) -> None:
        """Enqueue the kernel (then the merge) on torch's current stream of the device; raise on failure."""
        cp, dev = self.cupy, self.device
        try:
            stream = _cupy_stream(dev)
            args = (arg,)
            if cp.cuda.runtime.getDevice() == dev:
                self.function(cfg.grid, cfg.block, args, shared_mem=cfg.shared_bytes, stream=stream)
                if merge_grid is not None:
                    self.merge(merge_grid, (MERGE_THREADS, 1, 1), args, stream=stream)
            else:  # the kernels belong to dev's context: make it current for the launch
                with cp.cuda.Device(dev):
                    self.function(cfg.grid, cfg.block, args, shared_mem=cfg.shared_bytes, stream=stream)
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


def _compiled(family: str, dtype: torch.dtype, D: int, fast: bool | None, dev: int) -> _Compiled:
    fast = _fast_exp if fast is None else bool(fast)
    key = (family, dtype, D, fast, dev)
    c = _compiled_cache.get(key)
    if c is None:
        c = _compiled_cache[key] = _Compiled(choose_variant(family, dtype, D, fast), dev)
    return c


_stream_cache: dict[tuple[int, int], object] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the cudaStream_t, without a Stream object


def _cupy_stream(dev: int):
    """CuPy's view of torch's current stream on ``dev`` (same cudaStream_t), cached by handle. CuPy 14 takes
    it through the CUDA stream protocol (``Stream.from_external``); older CuPy through ``ExternalStream``."""
    handle = _raw_stream(dev) if _raw_stream is not None else torch.cuda.current_stream(dev).cuda_stream
    st = _stream_cache.get((dev, handle))
    if st is None:
        cp = _cupy()
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


def _plan(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, fast: bool | None):
    """Everything one launch needs, from the cached compiled kernel and the tensors' pointers and strides
    (each read once): (compiled, config, merge grid, splits, async_copy, struct values, workspace)."""
    q, k, v = prob.q, prob.k, prob.v
    dev = q.device.index
    if dev is None:
        dev = torch.cuda.current_device()
    B, Hq, Nq, D = q.shape
    c = _compiled(family, q.dtype, D, fast, dev)
    q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    q_st, k_st, v_st = q.stride(), k.stride(), v.stride()
    splits, split_tiles, async_copy, workspace = 1, NO_BOUND, False, None
    if family == "rowmax":
        async_copy = _rowmax_async and _async_ok(q.dtype, D, k_ptr, k_st, v_ptr, v_st)
        splits, split_tiles = rowmax_split_plan(B, Hq, Nq, k.shape[2], c.variant.dmax, c.limits.sm_count,
                                                _rowmax_force_splits)
        if splits > 1:
            # One allocation: acc [splits][B*Hq*Nq][D], then (m, l) [splits][B*Hq*Nq][2] (see kernel_args).
            workspace = torch.empty(splits * B * Hq * Nq * (D + 2), dtype=torch.float32, device=q.device)
        else:
            split_tiles = NO_BOUND
    cfg, merge_grid = c.config(B, Hq, Nq, splits)
    values = _param_values(prob, out, lse, async_copy, splits, split_tiles, workspace, q_ptr, k_ptr, v_ptr,
                           q_st, k_st, v_st)
    return c, cfg, merge_grid, splits, async_copy, values, workspace


class PreparedLaunch:
    """A validated launch of one kernel (and rowmax's merge, when it splits) on fixed tensors; calling it
    enqueues the kernel(s) on torch's current stream of the problem's device. Benchmarks call it repeatedly,
    so only the launch itself is on the timed path.

    Attributes: ``variant``, ``config`` (grid, block, shared memory), ``splits``, ``async_copy``, ``params``
    (the packed :data:`PARAMS_DTYPE` argument, size-1 array) and ``keep_alive`` (the tensors its pointers
    point into).
    """

    def __init__(self, family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None,
                 fast: bool | None = None):
        c, cfg, merge_grid, splits, async_copy, values, workspace = _plan(family, prob, out, lse, fast)
        self._compiled, self._merge_grid = c, merge_grid
        self._block = _ParamBlock()
        self._block.pack(values)
        self.variant, self.config, self.splits, self.async_copy = c.variant, cfg, splits, async_copy
        self.params = self._block.view
        self.keep_alive = (prob, out, lse, workspace)

    def __call__(self) -> None:
        self._compiled.launch(self.config, self._merge_grid, self._block.arg, self.splits)


def prepare(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None,
            fast: bool | None = None) -> PreparedLaunch:
    """Compile (once per variant and device), validate the launch, and return a :class:`PreparedLaunch` of
    ``family`` on ``prob`` into ``out`` / ``lse``. ``fast`` overrides the module's fast_exp setting."""
    return PreparedLaunch(family, prob, out, lse, fast)


_local = threading.local()  # each thread's parameter block for run()


def run(family: str, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Launch ``family`` on ``prob`` into ``out`` / ``lse`` on torch's current stream.

    The per-call path (every backend call): look up the compiled kernel, read the tensors' pointers and
    strides once, plan rowmax's split (one workspace tensor when it splits), pack the struct into this
    thread's parameter block (the driver copies it at the launch, so the block is free again right after),
    take the validated configuration from the cache, and enqueue.
    """
    c, cfg, merge_grid, splits, _async, values, workspace = _plan(family, prob, out, lse, None)
    block = getattr(_local, "block", None)
    if block is None:
        block = _local.block = _ParamBlock()
    block.pack(values)
    c.launch(cfg, merge_grid, block.arg, splits)
    del workspace  # freed after the launch: torch's allocator orders its reuse after these kernels (same stream)


# ---- backends ----------------------------------------------------------------------------------------


class _CudaBackend(Backend):
    family = ""
    kernel_backward = True  # differentiated by the Triton backward kernels (attnlab.triton_bwd)

    def availability(self) -> Availability:
        why = no_cuda_reason()
        try:
            import cupy  # noqa: F401
        except Exception as e:  # ImportError, or a broken CUDA install
            fix = ("CuPy is not installed: pip install 'attnlab[cuda12]' or 'attnlab[cuda13]' (CuPy for your CUDA "
                   "major version)" if isinstance(e, ModuleNotFoundError) else
                   f"CuPy does not import ({type(e).__name__}: {e})")
            return Availability(False, fix if why is None else f"{why}; and {fix}")
        return Availability(True) if why is None else Availability(False, why)

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

    def compile(self, source: str, name: str, options: Sequence[str], name_expressions: Sequence[str],
                ptx: list[str] | None = None):
        """Compile; returns (ok, log, {name expression: lowered (mangled) name}). When ``ptx`` is a list,
        the program's PTX is appended to it."""
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
                if ptx is not None:
                    size = ctypes.c_size_t()
                    self._check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
                    buf = ctypes.create_string_buffer(size.value)
                    self._check(self.lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
                    ptx.append(buf.value.decode())
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
    from attnlab.cli import OneLineParser

    ap = OneLineParser(prog="attnlab compile-check",
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
