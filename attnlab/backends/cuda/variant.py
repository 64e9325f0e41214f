"""What can be compiled and how it is launched, in pure Python (no GPU, no CuPy): the kernel variants, the
launch geometry checked against device limits, and rowmax's two launch-time choices.

* :class:`Variant` names one compiled kernel: family (naive / tiled / rowmax / mma), dtype, the D bucket
  ``dmax`` (the register and shared-memory arrays are sized for it; D itself is a run-time argument) and
  ``fast_exp``. :func:`variants` lists every variant the loader can produce; :func:`choose_variant` picks
  the one for a problem.
* :func:`launch_config` computes grid, block and dynamic shared memory; :func:`validate_launch` checks them
  against the device's limits and raises :class:`LaunchConfigError` naming the limit and the value.
* ``fast_exp``: :func:`set_fast_exp` (or the :func:`fast_exp` context manager) switches every CUDA backend
  between ``expf`` (IEEE) and ``__expf`` (hardware ex2.approx, a few ulp less accurate); by default the float32
  FMA kernels run ``expf`` and the tensor-core kernel ex2.approx (:data:`FAST_EXP_DEFAULT`).
* rowmax (see ``kernels/attn_rowmax.cu``): :func:`can_async_copy` decides whether its K/V tiles travel by
  16-byte ``cp.async`` copies or element by element, and :func:`rowmax_split_plan` whether a small grid
  splits each query tile's keys over several blocks (then ``attn_rowmax_merge`` combines their states).
  :func:`rowmax_async_copy` and :func:`rowmax_splits` force either choice (tests, benchmarks).
* mma (see ``kernels/attn_mma.cu``): the tensor-core kernel, float16 and bfloat16 only, head dims up to 128;
  :func:`mma_async_ok` decides whether its Q, K and V tiles travel by ``cp.async`` (the same switch,
  :func:`rowmax_async_copy`, turns that off for a while), and :func:`pair_stores_ok` whether it stores
  straight into the output or into a staging buffer that the host copies from.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from attnlab.problem import Problem

FAMILIES = ("naive", "tiled", "rowmax", "mma")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPE_NAMES = {0: "f32", 1: "f16", 2: "bf16"}

#: D buckets per family: a variant compiled for ``dmax`` serves every D <= dmax (naive needs none).
DMAX_BUCKETS = {"naive": (256,), "tiled": (32, 64, 128, 256), "rowmax": (64, 128, 256), "mma": (64, 128)}
#: dtype codes each family is compiled for: the tensor cores' MMA takes 16-bit inputs only.
FAMILY_DTYPES = {"naive": (0, 1, 2), "tiled": (0, 1, 2), "rowmax": (0, 1, 2), "mma": (1, 2)}

#: Threads per block and rows per block of each family (must match the kernels).
THREADS = {"naive": 128, "tiled": 128, "rowmax": 256, "mma": 128}
ROWS_PER_BLOCK = {"naive": 1, "tiled": 16, "rowmax": 64, "mma": 128}

#: Window sides arrive at the kernels clamped to +-NO_BOUND (2^30, as in attn_params.cuh): farther than
#: any row is from any key, so an unbounded side needs no special case.
NO_BOUND = 1 << 30

#: Opt-in shared memory per block (bytes) of the architectures the compile check targets.
SMEM_OPTIN = {"sm_80": 166912, "sm_90": 232448}
DEFAULT_SMEM = 48 * 1024
CUDA_MAX_THREADS = 1024
GRID_LIMITS = (2**31 - 1, 65535, 65535)

_fast_exp: bool | None = None  #: None: each family's own default (FAST_EXP_DEFAULT)
_rowmax_async = True  #: let rowmax (and mma) use cp.async where the inputs allow it
_rowmax_force_splits: int | None = None  #: None: rowmax_split_plan decides
_mma_wide = True  #: let mma take its wide kernel where mma_wide_ok allows


#: The exp each family runs unless :func:`set_fast_exp` says otherwise. The float32 FMA kernels use IEEE
#: ``expf`` (the precision chapter's subject). The tensor-core kernel rounds p to 16 bits right after its exp, a
#: rounding far coarser than ex2.approx's few float32 ulp, so it runs in base 2 on ex2.approx, as FlashAttention and
#: the Triton kernel do.
FAST_EXP_DEFAULT = {"naive": False, "tiled": False, "rowmax": False, "mma": True}


def set_fast_exp(enabled: bool | None) -> bool | None:
    """Use ``__expf`` / ex2.approx (True) or ``expf`` (False) in every CUDA kernel, or each family's default
    (None, the initial setting: :data:`FAST_EXP_DEFAULT`); returns the old setting."""
    global _fast_exp
    old, _fast_exp = _fast_exp, None if enabled is None else bool(enabled)
    return old


def get_fast_exp() -> bool | None:
    """The setting of :func:`set_fast_exp`: True, False, or None (each family's default)."""
    return _fast_exp


def fast_exp_of(family: str) -> bool:
    """Whether ``family`` runs the fast exp under the current setting."""
    return FAST_EXP_DEFAULT[family] if _fast_exp is None else _fast_exp


@contextlib.contextmanager
def fast_exp(enabled: bool | None = True) -> Iterator[None]:
    """``with attnlab.cuda.fast_exp(): ...`` runs the CUDA backends with ``__expf`` (``fast_exp(False)``: with
    ``expf``; ``None``: each family's default), then restores."""
    old = set_fast_exp(enabled)
    try:
        yield
    finally:
        set_fast_exp(old)


def rowmax_async_on() -> bool:
    """Whether rowmax may use cp.async (:func:`rowmax_async_copy` turns it off for a while)."""
    return _rowmax_async


def mma_wide_on() -> bool:
    """Whether mma may take its wide kernel (:func:`mma_wide` turns it off for a while)."""
    return _mma_wide


def rowmax_forced_splits() -> int | None:
    """The split count :func:`rowmax_splits` forces, or None (the automatic plan)."""
    return _rowmax_force_splits


@contextlib.contextmanager
def rowmax_async_copy(enabled: bool) -> Iterator[None]:
    """``with rowmax_async_copy(False): ...`` makes rowmax load its K/V tiles (and mma its Q, K and V tiles)
    element by element even where cp.async would apply (to test or time that path), then restores."""
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


# ---- variants ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: ``attn_<family><dtype, [dmax,] fast_exp>``."""

    family: str
    dtype: int  #: 0 float32, 1 float16, 2 bfloat16
    dmax: int
    fast_exp: bool
    wide: bool = False  #: mma only: FlashAttention-2's key tiles, no scaling pass (:func:`mma_wide_ok`)

    @property
    def name_expression(self) -> str:
        """The C++ name NVRTC instantiates, e.g. ``attn_rowmax<1, 64, false>``."""
        fe = "true" if self.fast_exp else "false"
        if self.family == "naive":
            return f"attn_naive<{self.dtype}, {fe}>"
        if self.family == "mma":
            return f"attn_mma<{self.dtype}, {self.dmax}, {fe}, {'true' if self.wide else 'false'}>"
        return f"attn_{self.family}<{self.dtype}, {self.dmax}, {fe}>"

    @property
    def label(self) -> str:
        """A short readable name, e.g. ``rowmax_f16_d64`` or ``naive_f32_fastexp``."""
        parts = [self.family, DTYPE_NAMES[self.dtype]]
        if self.family != "naive":
            parts.append(f"d{self.dmax}")
        if self.fast_exp:
            parts.append("fastexp")
        if self.wide:
            parts.append("wide")
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
        if self.family == "mma":
            bn = mma_bn(d, self.wide)
            return 2 * (ROWS_PER_BLOCK["mma"] + 2 * bn) * d  # 16-bit q_s [128][d], k_s and v_s [bn][d]
        bm, bn = 64, rowmax_bn(d)
        stages = 2 if d <= 128 else 1
        ld = d + 4
        return 4 * (bm * ld + 2 * stages * bn * ld + bn * (bm + 4))  # q_s, k_s and v_s stages, p_t


#: The merge kernel of rowmax's split keys (one per dtype; 4 rows = 4 warps per block).
MERGE_THREADS = 128


def merge_name_expression(dtype_code: int) -> str:
    return f"attn_rowmax_merge<{dtype_code}>"


def mma_bn(dmax: int, wide: bool = False) -> int:
    """Keys per K/V tile of the mma kernel (MmaTiles::BN)."""
    if wide:
        return 128 if dmax <= 64 else 64
    return 64 if dmax <= 64 else 32


#: Where the wide mma kernel runs: the archs whose compile keeps it free of spills (compile-check; sm_80 spills
#: at these tiles) and on which it was measured faster (docs/decisions.md, "The wide tensor-core kernel").
MMA_WIDE_ARCHS = ("sm_90",)
_LOG2E = 1.4426950408889634


def mma_wide_ok(arch: str, fast: bool, explicit: bool, scale: float) -> bool:
    """Whether the wide mma kernel computes a call: on :data:`MMA_WIDE_ARCHS`, with ex2.approx (expf spills at its
    tiles), without an explicit mask or bias, and with the scale in (0, 1] in base 2 (the kernel has no scaling
    pass, which those need: see ``kernels/attn_mma.cu``)."""
    if not (_mma_wide and arch in MMA_WIDE_ARCHS and fast and not explicit and 0.0 < scale < 1.0):
        return False  # (log2 e > 1: a scale of 1 or more is above 1 in base 2)
    scale_u = float(np.float32(scale) * np.float32(_LOG2E))  # as the kernel computes it, in float32
    return 0.0 < scale_u <= 1.0


@contextlib.contextmanager
def mma_wide(enabled: bool) -> Iterator[None]:
    """``with mma_wide(False): ...`` keeps the mma kernel at its own tiles where the wide kernel would run (to
    test or time that kernel on sm_90), then restores."""
    global _mma_wide
    old, _mma_wide = _mma_wide, bool(enabled)
    try:
        yield
    finally:
        _mma_wide = old


def rowmax_bn(dmax: int) -> int:
    """Keys per K/V tile of the rowmax kernel (RowmaxTiles::BN)."""
    return 64 if dmax <= 64 else 32


def variants(family: str | None = None, arch: str | None = None) -> list[Variant]:
    """Every variant the loader can produce (all dtypes, D buckets and both exp modes, and the wide mma kernel
    with ex2.approx), for ``arch`` when given (the wide kernel only on :data:`MMA_WIDE_ARCHS`)."""
    fams = FAMILIES if family is None else (family,)
    wide_too = arch is None or arch in MMA_WIDE_ARCHS
    return [
        Variant(f, dt, dm, fe, wide)
        for f in fams
        for dt in FAMILY_DTYPES[f]
        for dm in DMAX_BUCKETS[f]
        for fe in (False, True)
        for wide in ((False, True) if f == "mma" and fe and wide_too else (False,))
    ]


def choose_variant(family: str, dtype: torch.dtype, D: int, fast: bool | None = None, wide: bool = False) -> Variant:
    """The variant that runs a problem: the smallest D bucket >= D (``wide``: the wide mma kernel, where
    :func:`mma_wide_ok` says it applies)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; one of {FAMILIES}")
    if dtype not in DTYPE_CODES:
        raise TypeError(f"the CUDA kernels take float32, float16 or bfloat16; got {dtype}")
    if DTYPE_CODES[dtype] not in FAMILY_DTYPES[family]:
        raise TypeError(f"the {family} kernel takes float16 or bfloat16 (the tensor cores' 16-bit inputs); got "
                        f"{dtype} (float32 runs on cuda-rowmax or triton)")
    for dm in DMAX_BUCKETS[family]:
        if D <= dm:
            fe = fast_exp_of(family) if fast is None else bool(fast)
            return Variant(family, DTYPE_CODES[dtype], dm, fe, wide and family == "mma" and fe)
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


def mma_async_ok(dtype: torch.dtype, D: int, tensors: tuple[tuple[int, tuple], ...]) -> bool:
    """Whether the mma kernel may copy Q, K and V rows with 16-byte cp.async: a 16-bit dtype and
    :func:`rows_of_16_bytes` for each (pointer, strides) of ``tensors``."""
    return dtype in (torch.float16, torch.bfloat16) and rows_of_16_bytes(2, D, tensors)


def pair_stores_ok(D: int, ptr: int, strides: tuple) -> bool:
    """Whether the mma kernel may store a 16-bit [B, H, N, D] output at (pointer, strides) directly: it stores
    two neighbouring columns as one 32-bit word, so D even, unit stride on D, and the pointer and the b/h/n
    strides aligned to 4 bytes. Else the host gives it a staging buffer D + D % 2 wide and copies the result."""
    return D % 2 == 0 and strides[3] == 1 and ptr % 4 == 0 and all(st % 2 == 0 for st in strides[:3])


def rows_of_16_bytes(elem_bytes: int, D: int, tensors: tuple[tuple[int, tuple], ...]) -> bool:
    """Whether every row of every (pointer, [B, H, N, D] strides) in ``tensors`` is whole 16-byte chunks that start
    16-byte aligned: D a multiple of 16 bytes, unit stride on D, the pointer and the b/h/n strides aligned."""
    per = 16 // elem_bytes  # elements per 16 bytes
    return D % per == 0 and all(st[3] == 1 and ptr % 16 == 0 and st[0] % per == 0 and st[1] % per == 0
                                and st[2] % per == 0 for ptr, st in tensors)


def can_async_copy(prob: Problem) -> bool:
    """Whether rowmax may copy K/V rows with 16-byte cp.async: float32, D a multiple of 4, unit stride on
    D, and every K/V row start 16-byte aligned (pointers and the b/h/n strides multiples of 4 elements)."""
    return async_ok(prob.dtype, prob.D, prob.k.data_ptr(), prob.k.stride(), prob.v.data_ptr(), prob.v.stride())


def async_ok(dtype: torch.dtype, D: int, k_ptr: int, k_strides: tuple, v_ptr: int, v_strides: tuple) -> bool:
    return dtype == torch.float32 and rows_of_16_bytes(4, D, ((k_ptr, k_strides), (v_ptr, v_strides)))
