"""The CUDA C kernels of ``kernels/`` (backends ``cuda-naive``, ``cuda-tiled``, ``cuda-rowmax``, ``cuda-mma``),
compiled at run time with NVRTC through CuPy and launched zero-copy on torch tensors.

The pieces, in the order a call goes through them:

* :mod:`~attnlab.backends.cuda.variant`: which kernel runs a problem (:class:`Variant`,
  :func:`choose_variant`), its launch geometry checked against device limits (:func:`launch_config`,
  :func:`validate_launch`), the ``fast_exp`` switch and rowmax's launch-time choices (cp.async, split keys).
* :mod:`~attnlab.backends.cuda.params`: the one kernel argument ``struct AttnParams`` and its packing.
* :mod:`~attnlab.backends.cuda.sources`: the ``.cu`` files, with their includes resolved for NVRTC.
* :mod:`~attnlab.backends.cuda.launch`: compile once per device, cache, launch on torch's stream
  (:func:`run`, :func:`prepare`).
* :mod:`~attnlab.backends.cuda.backend`: the four backends.
* :mod:`~attnlab.backends.cuda.compile_check`: ``python -m attnlab compile-check`` (NVRTC, optionally nvcc),
  no GPU needed.

The names below are re-exported so that ``from attnlab.backends import cuda`` reads as one module.
"""

from attnlab.backends.cuda.backend import CudaMmaBackend, CudaNaiveBackend, CudaRowmaxBackend, CudaTiledBackend
from attnlab.backends.cuda.compile_check import (
    EDGE_SPILL_BYTES,
    REGISTER_CAP,
    Nvrtc,
    Resources,
    at_the_edge,
    compile_check,
    compile_check_command,
    compile_family,
    find_nvrtc,
    format_table,
    parse_ptxas_log,
    strict_problems,
)
from attnlab.backends.cuda.launch import PreparedLaunch, get_kernel, prepare, run, set_debug_sync
from attnlab.backends.cuda.params import PARAMS_DTYPE, kernel_args, struct_format
from attnlab.backends.cuda.sources import NVRTC_OPTIONS, kernel_source, kernels_dir
from attnlab.backends.cuda.variant import (
    DMAX_BUCKETS,
    DTYPE_CODES,
    FAMILIES,
    FAST_EXP_DEFAULT,
    GRID_LIMITS,
    MMA_WIDE_ARCHS,
    NO_BOUND,
    ROWS_PER_BLOCK,
    SMEM_OPTIN,
    THREADS,
    DeviceLimits,
    LaunchConfig,
    LaunchConfigError,
    Variant,
    can_async_copy,
    choose_variant,
    fast_exp,
    fast_exp_of,
    get_fast_exp,
    launch_config,
    mma_wide,
    mma_wide_ok,
    pair_stores_ok,
    rowmax_async_copy,
    rowmax_split_plan,
    rowmax_splits,
    set_fast_exp,
    validate_launch,
    variants,
)

__all__ = [
    "DMAX_BUCKETS",
    "DTYPE_CODES",
    "EDGE_SPILL_BYTES",
    "FAMILIES",
    "FAST_EXP_DEFAULT",
    "GRID_LIMITS",
    "MMA_WIDE_ARCHS",
    "NO_BOUND",
    "NVRTC_OPTIONS",
    "PARAMS_DTYPE",
    "REGISTER_CAP",
    "ROWS_PER_BLOCK",
    "SMEM_OPTIN",
    "THREADS",
    "CudaMmaBackend",
    "CudaNaiveBackend",
    "CudaRowmaxBackend",
    "CudaTiledBackend",
    "DeviceLimits",
    "LaunchConfig",
    "LaunchConfigError",
    "Nvrtc",
    "PreparedLaunch",
    "Resources",
    "Variant",
    "at_the_edge",
    "can_async_copy",
    "choose_variant",
    "compile_check",
    "compile_check_command",
    "compile_family",
    "fast_exp",
    "fast_exp_of",
    "find_nvrtc",
    "format_table",
    "get_fast_exp",
    "get_kernel",
    "kernel_args",
    "kernel_source",
    "kernels_dir",
    "launch_config",
    "mma_wide",
    "mma_wide_ok",
    "pair_stores_ok",
    "parse_ptxas_log",
    "prepare",
    "rowmax_async_copy",
    "rowmax_split_plan",
    "rowmax_splits",
    "run",
    "set_debug_sync",
    "set_fast_exp",
    "strict_problems",
    "struct_format",
    "validate_launch",
    "variants",
]
