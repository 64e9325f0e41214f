"""The kernels' one argument, ``struct AttnParams`` (``kernels/attn_params.cuh``): its numpy twin
:data:`PARAMS_DTYPE`, the :mod:`struct` format that packs it in one call, and the host block CuPy passes by
address."""

from __future__ import annotations

import struct

import numpy as np
import torch

from attnlab.backends.cuda.variant import DTYPE_CODES, NO_BOUND
from attnlab.problem import Problem

#: ``struct Strides4`` of kernels/attn_params.cuh: the four strides (in elements) of a [B, H, N, D] view.
STRIDES4_DTYPE = np.dtype([(n, np.int64) for n in "bhnd"], align=True)

#: ``struct AttnParams`` of kernels/attn_params.cuh, field for field and in its order. ``align=True`` lays
#: the fields out by C's rules (each at a multiple of its own alignment, the size a multiple of the largest),
#: as NVRTC does for this plain struct. A launch passes the struct by value: its bytes (packed by
#: ``_PARAMS_PACK`` into a :class:`ParamBlock`) go to the driver by address. tests/test_cuda.py checks every
#: field's offset against NVRTC's own layout of the C declaration.
PARAMS_DTYPE = np.dtype(
    [(n, np.uint64) for n in ("q", "k", "v", "out", "lse", "q_len", "kv_len", "mask", "part_acc", "part_ml")]
    + [(n, STRIDES4_DTYPE) for n in ("qs", "ks", "vs", "os", "ms")]
    + [(n, np.int64) for n in ("lse_sb", "lse_sh", "lse_sn")]
    + [(n, np.int32) for n in ("B", "Hq", "group", "Nq", "Nk", "D")]
    + [("scale", np.float32)]
    + [(n, np.int32) for n in ("mask_kind", "left", "right", "bottom_right", "async_copy", "split_tiles", "splits",
                               "bias_dtype")],
    align=True,
)

#: ``AttnParams.bias_dtype`` of each bias dtype (masks.BIAS_DTYPES): the inputs' dtype codes and float64; the
#: kernels read the bias as it is and convert each element to float32.
BIAS_DTYPE_CODES = {**DTYPE_CODES, torch.float64: 3}

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


def param_values(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, async_copy: bool, splits: int,
                  split_tiles: int, workspace: torch.Tensor | None, q_ptr: int, k_ptr: int, v_ptr: int,
                  q_st: tuple, k_st: tuple, v_st: tuple) -> tuple:
    """The fields of ``struct AttnParams`` in order, nested strides flattened (what ``_PARAMS_PACK`` packs)."""
    spec = prob.spec
    mask = spec.explicit  # a bool mask is read as bytes, a bias in its own dtype
    kind = 0 if mask is None else 1 if spec.mask is not None else 2
    bias_dtype = BIAS_DTYPE_CODES[spec.bias.dtype] if spec.bias is not None else 0
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
        int(async_copy), split_tiles, splits, bias_dtype,
    )


def kernel_args(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, *, async_copy: bool = False,
                splits: int = 1, split_tiles: int = NO_BOUND, workspace: torch.Tensor | None = None) -> np.ndarray:
    """The one argument of every attention kernel as a size-1 array of :data:`PARAMS_DTYPE` (``struct
    AttnParams``; a writable view of the packed bytes).

    Pointers are the tensors' data pointers (zero copy, any strides; 0 for an absent tensor), strides are in
    elements. ``async_copy``, ``splits``, ``split_tiles`` and ``workspace`` (float32, ``splits * B*Hq*Nq *
    (D + 2)`` elements: the split states' acc, then their (m, l)) are rowmax's. The caller keeps ``prob``,
    ``out``, ``lse`` and ``workspace`` alive until the kernel has run. The mma kernel stores column pairs:
    its ``out`` must satisfy :func:`attnlab.backends.cuda.variant.pair_stores_ok` (the launches stage it
    otherwise).
    """
    q, k, v = prob.q, prob.k, prob.v
    values = param_values(prob, out, lse, async_copy, splits, split_tiles, workspace, q.data_ptr(), k.data_ptr(),
                           v.data_ptr(), q.stride(), k.stride(), v.stride())
    return np.frombuffer(bytearray(_PARAMS_PACK.pack(*values)), dtype=PARAMS_DTYPE)


class ParamBlock:
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
        cpointer = getattr(cupy_module().cuda.function, "CPointer", None)
        if cpointer is not None:
            self.arg = cpointer(self.view.ctypes.data)
        else:
            self.arg = self.view.view(np.dtype((np.void, PARAMS_DTYPE.itemsize)))

    def pack(self, values: tuple) -> None:
        _PARAMS_PACK.pack_into(self.buffer, 0, *values)


def cupy_module():
    import cupy  # lazily: attnlab imports without CuPy

    return cupy
