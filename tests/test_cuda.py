"""The CUDA C backends (attnlab/backends/cuda/, kernels/*.cu).

CPU tests: the compile check (NVRTC from pip, no GPU) and its parser, launch-config validation, variant
naming and selection, and that ``PARAMS_DTYPE`` matches NVRTC's layout of ``struct AttnParams``, the one
argument of every kernel.
GPU tests (``-m gpu``): every backend through ``attnlab.check.verify`` / ``summarize`` (as users call them)
on the case matrix, larger sizes, N = 8192, the fast_exp variant at its own tolerance, and rowmax's
split-key and element-load paths forced on the matrix; the tensor-core kernel (``cuda-mma``, 16-bit inputs and
D <= 128 only) on the same matrices in float16 and bfloat16, and its element-load path forced.
"""

from __future__ import annotations

import re
import shutil
import types

import numpy as np
import pytest
import torch

from attnlab import check
from attnlab.backends import cuda as C
from attnlab.backends.cuda import params as P
from attnlab.backends.cuda import variant as V
from attnlab.backends.cuda.sources import resolve_includes
from attnlab.cases import Case, default_cases, gpu_cases, n8192_cases
from attnlab.problem import make_problem

BACKENDS = ("cuda-naive", "cuda-tiled", "cuda-rowmax")
#: The tensor-core kernel takes what the others take except float32 and D > 128: its tests run the same matrices
#: on the problems it takes, and check that it refuses the rest.
MMA = "cuda-mma"
HALF = [torch.float16, torch.bfloat16]


def _has_nvrtc() -> bool:
    try:
        C.find_nvrtc()
    except FileNotFoundError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _has_nvrtc(), reason="libnvrtc (pip nvidia-cuda-nvrtc-cu12) not found")

# ---- variants ------------------------------------------------------------------------------------------


def test_variant_names_are_unique_and_readable():
    vs = C.variants()
    labels = [v.label for v in vs]
    assert len(labels) == len(set(labels))
    assert len(C.variants("naive")) == 6  # 3 dtypes x fast_exp
    assert C.Variant("rowmax", 1, 64, False).label == "rowmax_f16_d64"
    assert C.Variant("tiled", 2, 128, True).label == "tiled_bf16_d128_fastexp"
    assert C.Variant("naive", 0, 256, False).label == "naive_f32"
    assert C.Variant("rowmax", 2, 128, True).name_expression == "attn_rowmax<2, 128, true>"
    assert C.Variant("naive", 1, 256, False).name_expression == "attn_naive<1, false>"
    assert len(C.variants("mma")) == 12  # float16 and bfloat16 x D 64, 128 x (expf, ex2.approx, wide ex2.approx)
    assert len(C.variants("mma", "sm_80")) == 8 and len(C.variants("mma", "sm_90")) == 12
    assert C.Variant("mma", 2, 128, False).name_expression == "attn_mma<2, 128, false, false>"
    assert C.Variant("mma", 1, 64, True, True).name_expression == "attn_mma<1, 64, true, true>"
    assert C.Variant("mma", 1, 64, True, True).label == "mma_f16_d64_fastexp_wide"


def test_the_wide_mma_kernel_takes_only_what_it_computes():
    """The wide kernel has no scaling pass: it runs only on sm_90, with ex2.approx, without an explicit mask or
    bias, and with the scale in (0, 1] in base 2; it has FlashAttention-2's tiles and their shared memory."""
    assert C.mma_wide_ok("sm_90", True, False, 64 ** -0.5)
    assert C.mma_wide_ok("sm_90", True, False, 0.69)  # 0.69 * log2 e = 0.995
    assert not C.mma_wide_ok("sm_90", True, False, 0.7)  # 1.01 in base 2: the scaling pass
    assert not C.mma_wide_ok("sm_90", True, False, 0.0) and not C.mma_wide_ok("sm_90", True, False, -0.1)
    assert not C.mma_wide_ok("sm_90", True, True, 0.125)  # an explicit mask or bias
    assert not C.mma_wide_ok("sm_90", False, False, 0.125)  # expf
    assert not C.mma_wide_ok("sm_80", True, False, 0.125) and not C.mma_wide_ok("sm_100", True, False, 0.125)
    wide = C.choose_variant("mma", torch.bfloat16, 100, wide=True)
    assert wide.wide and wide.dmax == 128 and wide.shared_bytes() == 2 * (128 + 2 * 64) * 128
    assert C.choose_variant("mma", torch.bfloat16, 64, wide=True).shared_bytes() == 2 * (128 + 2 * 128) * 64
    assert not C.choose_variant("mma", torch.bfloat16, 64, fast=False, wide=True).wide


def test_the_mma_kernel_refuses_float32_and_large_head_dims_with_the_reason():
    with pytest.raises(TypeError, match=r"float16 or bfloat16.*float32 runs on cuda-rowmax"):
        C.choose_variant("mma", torch.float32, 64)
    with pytest.raises(ValueError, match="D = 129 exceeds the largest bucket 128"):
        C.choose_variant("mma", torch.bfloat16, 129)
    assert C.choose_variant("mma", torch.float16, 100).dmax == 128
    assert C.choose_variant("mma", torch.bfloat16, 40).dmax == 64
    from attnlab.backends import registry

    assert "float16/bfloat16" in registry()[MMA].takes and "D 1-128" in registry()[MMA].takes


@pytest.mark.parametrize(
    "family, D, dmax",
    [("tiled", 1, 32), ("tiled", 40, 64), ("tiled", 100, 128), ("tiled", 256, 256),
     ("rowmax", 16, 64), ("rowmax", 64, 64), ("rowmax", 65, 128), ("rowmax", 129, 256), ("naive", 7, 256)],
)
def test_choose_variant_picks_smallest_bucket(family, D, dmax):
    assert C.choose_variant(family, torch.float16, D).dmax == dmax


def test_choose_variant_errors():
    with pytest.raises(ValueError, match="257"):
        C.choose_variant("rowmax", torch.float32, 257)
    with pytest.raises(TypeError, match="float64"):
        C.choose_variant("tiled", torch.float64, 64)
    with pytest.raises(ValueError, match="family"):
        C.choose_variant("flash", torch.float32, 64)


def test_fast_exp_switch_selects_variant():
    assert not C.get_fast_exp()
    with C.fast_exp():
        assert C.get_fast_exp()
        assert C.choose_variant("rowmax", torch.float32, 64).fast_exp
    assert not C.choose_variant("rowmax", torch.float32, 64).fast_exp
    assert C.choose_variant("rowmax", torch.float32, 64, fast=True).label == "rowmax_f32_d64_fastexp"


def test_each_family_has_its_exp_unless_the_switch_forces_one():
    """The float32 FMA kernels default to expf, the tensor-core kernel to ex2.approx; the switch forces either way
    and restores the defaults (None) on leaving."""
    bf16 = torch.bfloat16
    assert C.get_fast_exp() is None
    assert C.choose_variant("mma", bf16, 64).fast_exp and not C.choose_variant("rowmax", bf16, 64).fast_exp
    with C.fast_exp(False):
        assert not C.choose_variant("mma", bf16, 128).fast_exp
    with C.fast_exp(True):
        assert C.choose_variant("tiled", bf16, 64).fast_exp and C.choose_variant("mma", bf16, 64).fast_exp
    assert C.get_fast_exp() is None and [C.fast_exp_of(f) for f in C.FAMILIES] == [
        C.FAST_EXP_DEFAULT[f] for f in C.FAMILIES]


def test_every_variant_fits_sm80_shared_memory():
    for v in C.variants():
        assert v.shared_bytes() <= C.SMEM_OPTIN["sm_80"], v.label


# ---- launch configuration -------------------------------------------------------------------------------


def test_launch_config_shapes():
    v = C.choose_variant("rowmax", torch.float32, 64)
    cfg = C.launch_config(v, 2, 3, 130)
    assert cfg.grid == (6, 3, 1) and cfg.block == (256, 1, 1) and cfg.shared_bytes == v.shared_bytes()
    cfg = C.launch_config(C.choose_variant("naive", torch.float32, 64), 2, 3, 130)
    assert cfg.grid == (130, 6, 1)
    cfg = C.launch_config(C.choose_variant("tiled", torch.float32, 64), 2, 3, 130)
    assert cfg.grid == (6, 9, 1) and cfg.block == (128, 1, 1)


def test_validate_launch_accepts_the_real_configs():
    lim = C.DeviceLimits(max_shared_optin=C.SMEM_OPTIN["sm_80"])
    for v in C.variants():
        C.validate_launch(C.launch_config(v, 8, 16, 4096), lim, v.label)


def test_validate_launch_names_limit_and_value():
    lim = C.DeviceLimits(max_threads_per_block=1024, max_shared_optin=232448)
    with pytest.raises(C.LaunchConfigError, match=r"2048 threads per block.*1024"):
        C.validate_launch(C.LaunchConfig((1, 1, 1), (2048, 1, 1), 0), lim)
    with pytest.raises(C.LaunchConfigError, match=r"300000 bytes.*opt-in limit of 232448"):
        C.validate_launch(C.LaunchConfig((1, 1, 1), (256, 1, 1), 300000), lim, "rowmax_f32_d256")
    with pytest.raises(C.LaunchConfigError, match=r"grid dimension y = 70000.*65535"):
        C.validate_launch(C.LaunchConfig((1, 70000, 1), (256, 1, 1), 0), lim)
    small = C.DeviceLimits(kernel_max_threads=128)
    with pytest.raises(C.LaunchConfigError, match=r"256 threads.*compiled kernel's limit of 128"):
        C.validate_launch(C.LaunchConfig((1, 1, 1), (256, 1, 1), 0), small)
    assert issubclass(C.LaunchConfigError, ValueError)


# ---- the one kernel argument: struct AttnParams and its numpy dtype ---------------------------------------

#: size and alignment of the C types the struct uses (x86-64 / aarch64 hosts, the CUDA device ABI).
_C_SCALARS = {"pointer": (8, 8), "long long": (8, 8), "int": (4, 4), "float": (4, 4)}
_NP_SCALARS = {"pointer": np.uint64, "long long": np.int64, "int": np.int32, "float": np.float32}


def _c_struct(name: str) -> list[tuple[str, str]]:
    """(field, C type) of ``struct name`` in kernels/attn_params.cuh, in declaration order; every pointer
    type is "pointer"."""
    src = C.kernels_dir().joinpath("attn_params.cuh").read_text()
    m = re.search(rf"struct {name} \{{(.*?)\n\}};", src, re.S)
    assert m, name
    fields = []
    for line in m.group(1).splitlines():
        decl = line.split("//")[0].strip()
        if not decl:
            continue
        d = re.fullmatch(r"(?:const\s+)?(long long|\w+)\s*(\*?)\s*([\w\s,]+);", decl)
        assert d, decl
        ctype = "pointer" if d.group(2) else d.group(1)
        fields += [(n.strip(), ctype) for n in d.group(3).split(",")]
    return fields


def _c_layout(name: str, base: int = 0) -> tuple[list[tuple[str, int, str]], int, int]:
    """C's layout rules applied to ``struct name``: ([(flattened field, offset, scalar type)], size, align)."""
    out, pos, align = [], base, 1
    for field, ctype in _c_struct(name):
        if ctype in _C_SCALARS:
            size, al = _C_SCALARS[ctype]
            pos = -(-pos // al) * al
            out.append((field, pos, ctype))
        else:  # a nested struct
            sub, size, al = _c_layout(ctype, 0)
            pos = -(-pos // al) * al
            out += [(f"{field}.{f}", pos + off, t) for f, off, t in sub]
        align = max(align, al)
        pos += size
    return out, -(-(pos - base) // align) * align, align


def _np_layout(dt: np.dtype, prefix: str = "", base: int = 0) -> list[tuple[str, int, np.dtype]]:
    out = []
    for name in dt.names:
        sub, off = dt.fields[name][0], base + dt.fields[name][1]
        if sub.names:
            out += _np_layout(sub, f"{prefix}{name}.", off)
        else:
            out.append((f"{prefix}{name}", off, sub))
    return out


def test_params_dtype_follows_the_c_struct_and_c_layout_rules():
    """PARAMS_DTYPE has the C struct's fields, in order, with C's offsets (each field at a multiple of its
    alignment, no other gaps) and C's size (a multiple of the largest alignment)."""
    c_fields, c_size, c_align = _c_layout("AttnParams")
    np_fields = _np_layout(C.PARAMS_DTYPE)
    assert [f for f, _, _ in np_fields] == [f for f, _, _ in c_fields]
    for (f, c_off, ctype), (_, np_off, npt) in zip(c_fields, np_fields):
        assert np_off == c_off, f
        assert npt == np.dtype(_NP_SCALARS[ctype]), f
    assert C.PARAMS_DTYPE.itemsize == c_size == 328 and c_align == 8
    assert C.PARAMS_DTYPE.isalignedstruct
    # the struct format packs exactly those bytes (explicit pad bytes, native order)
    assert P._PARAMS_PACK.size == C.PARAMS_DTYPE.itemsize


def _compiled_offsets(fields: list[str]) -> tuple[dict[str, int], int, int]:
    """Where NVRTC puts each field of AttnParams: one probe kernel per field reads it, and the PTX names the
    byte offset of that read in the kernel's parameter (``ld.param... [probe_i_param_0+OFFSET]``), and the
    parameter's size and alignment (``.param .align A .b8 probe_0_param_0[SIZE]``)."""
    probes = [f'extern "C" __global__ void probe_{i}(const __grid_constant__ AttnParams args, '
              f"unsigned long long* out) {{ *out = (unsigned long long)args.{f}; }}" for i, f in enumerate(fields)]
    src = resolve_includes("attn_params.cuh") + "\n" + "\n".join(probes) + "\n"
    ptx: list[str] = []
    ok, log, _ = C.Nvrtc().compile(src, "params_probe.cu", [*C.NVRTC_OPTIONS, "--gpu-architecture=sm_80"], [],
                                   ptx=ptx)
    assert ok, log
    offsets = {}
    for i, f in enumerate(fields):
        loads = re.findall(rf"ld\.param\.\w+\s+%\w+, \[probe_{i}_param_0(?:\+(\d+))?\];", ptx[0])
        assert len(loads) == 1, (f, loads)
        offsets[f] = int(loads[0] or 0)
    m = re.search(r"\.param \.align (\d+) \.b8 probe_0_param_0\[(\d+)\]", ptx[0])
    assert m, ptx[0][:2000]
    return offsets, int(m.group(2)), int(m.group(1))


@needs_nvrtc
def test_params_dtype_offsets_match_the_compiled_struct():
    """NVRTC's own layout of the C struct (read from the PTX of probe kernels) is the numpy dtype's."""
    fields = _np_layout(C.PARAMS_DTYPE)
    offsets, size, align = _compiled_offsets([f for f, _, _ in fields])
    assert {f: off for f, off, _ in fields} == offsets
    assert (size, align) == (C.PARAMS_DTYPE.itemsize, C.PARAMS_DTYPE.alignment) == (328, 8)


def test_struct_format_pads_like_the_dtype():
    import struct

    inner = np.dtype([("x", np.int32)], align=True)
    dt = np.dtype([("a", np.int32), ("b", np.int64), ("c", inner), ("d", np.float32)], align=True)
    assert C.struct_format(dt) == "=ixxxxqif"  # 4 pad bytes before the 8-byte field
    rec = np.frombuffer(struct.pack(C.struct_format(dt), 7, -3, 5, 2.5), dtype=dt)[0]
    assert (rec["a"], rec["b"], rec["c"]["x"], rec["d"]) == (7, -3, 5, 2.5)
    tail = np.dtype([("a", np.int64), ("b", np.int32)], align=True)
    assert C.struct_format(tail) == "=qixxxx" and struct.calcsize(C.struct_format(tail)) == tail.itemsize == 16


#: What each kernel takes: exactly one AttnParams by value (__grid_constant__: read in place, never copied).
_PARAM_DECL = re.compile(r"^const __grid_constant__ AttnParams args$")


@pytest.mark.parametrize("family, kernel", [("naive", "attn_naive"), ("tiled", "attn_tiled"),
                                            ("rowmax", "attn_rowmax"), ("rowmax", "attn_rowmax_merge"),
                                            ("mma", "attn_mma")])
def test_every_kernel_takes_one_attn_params(family, kernel):
    src = C.kernels_dir().joinpath(f"attn_{family}.cu").read_text()
    m = re.search(rf"\b{kernel}\((.*?)\)\s*\{{", src, re.S)
    assert m, kernel
    assert _PARAM_DECL.match(m.group(1).strip()), m.group(1)


_BIAS_DTYPES = {"bias": torch.float32, "bias_f16": torch.float16, "bias_bf16": torch.bfloat16,
                "bias_f64": torch.float64}


@pytest.mark.parametrize("mask_kind", ["none", "bool", *_BIAS_DTYPES])
def test_kernel_args_fields(mask_kind):
    B, H, N, D = 2, 4, 9, 8
    q = torch.randn(B, N, H, D)
    k = torch.randn(B, N, 2, D)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(N, N) < 0.5
    elif mask_kind in _BIAS_DTYPES:
        mask = torch.randn(B, 1, N, N, dtype=_BIAS_DTYPES[mask_kind])
    prob = make_problem(q, k, k, causal=True, kv_len=[9, 3], mask=mask, layout="bnhd")
    out = torch.empty(B, H, N, D)
    lse = torch.empty(B, H, N)
    args = C.kernel_args(prob, out, lse)
    assert args.dtype == C.PARAMS_DTYPE and args.shape == (1,)
    a = args[0]
    assert int(a["q"]) == q.data_ptr() and int(a["k"]) == int(a["v"]) == k.data_ptr()
    assert int(a["out"]) == out.data_ptr() and int(a["lse"]) == lse.data_ptr()
    assert int(a["kv_len"]) == prob.spec.kv_len.data_ptr() and int(a["q_len"]) == 0
    # The bnhd view reaches the kernel with its real strides (no copy): q's H stride is D.
    assert tuple(int(x) for x in a["qs"]) == (q.stride(0), D, H * D, 1)
    assert tuple(int(x) for x in a["os"]) == out.stride()
    assert (int(a["lse_sb"]), int(a["lse_sh"]), int(a["lse_sn"])) == lse.stride()
    assert (int(a["B"]), int(a["Hq"]), int(a["group"]), int(a["Nq"]), int(a["Nk"]), int(a["D"])) == (B, H, 2, N, N, D)
    assert float(a["scale"]) == np.float32(D**-0.5)
    assert int(a["mask_kind"]) == {"none": 0, "bool": 1}.get(mask_kind, 2)
    # a bias is passed in the caller's dtype, never a float32 copy: its own pointer and its dtype code
    assert int(a["bias_dtype"]) == {"bias_f16": 1, "bias_bf16": 2, "bias_f64": 3}.get(mask_kind, 0)
    if mask_kind in _BIAS_DTYPES:
        assert int(a["mask"]) == mask.data_ptr()
        assert tuple(int(x) for x in a["ms"]) == (N * N, 0, N, 1)
    assert int(a["right"]) == 0 and int(a["left"]) == C.NO_BOUND  # causal: right 0, left unbounded
    assert int(a["bottom_right"]) == 0 and int(a["splits"]) == 1 and int(a["split_tiles"]) == C.NO_BOUND
    if mask_kind == "none":
        assert int(a["mask"]) == 0 and tuple(int(x) for x in a["ms"]) == (0, 0, 0, 0)
    if mask_kind == "bool":  # broadcast over B and H: stride 0
        assert int(a["mask"]) == prob.spec.mask.data_ptr()
        assert tuple(int(x) for x in a["ms"]) == (0, 0, N, 1)


def test_param_block_hands_cupy_the_packed_bytes(monkeypatch):
    """run()'s launch argument: the struct's bytes in a block whose address CuPy passes as it is.

    With CuPy installed its own ``CPointer`` is used; without it (the CPU CI) a stand-in with the same
    constructor, so that the packing and the address are checked everywhere.
    """
    try:
        import cupy  # noqa: F401
    except ImportError:
        class CPointer:
            def __init__(self, ptr: int):
                self.ptr = ptr

        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(function=types.SimpleNamespace(CPointer=CPointer)))
        monkeypatch.setattr(P, "cupy_module", lambda: fake)
    q = torch.randn(2, 3, 40, 24)
    prob = make_problem(q, q, q, window=(5, 2))
    out = torch.empty_like(q)
    values = P.param_values(prob, out, None, False, 1, C.NO_BOUND, None, q.data_ptr(), q.data_ptr(),
                             q.data_ptr(), q.stride(), q.stride(), q.stride())
    block = P.ParamBlock()
    block.pack(values)
    assert bytes(block.buffer) == C.kernel_args(prob, out, None).tobytes()
    assert int(block.view[0]["left"]) == 5 and int(block.view[0]["right"]) == 2
    if hasattr(block.arg, "ptr"):  # cupy.cuda.function.CPointer: the address of those bytes
        assert block.arg.ptr == block.view.ctypes.data


def test_kernel_args_rowmax_workspace():
    """The split workspace is one tensor: acc of every split first, then their (m, l) pairs."""
    q = torch.randn(1, 2, 70, 16)
    prob = make_problem(q, q, q)
    out = torch.empty_like(q)
    ws = torch.empty(3 * 2 * 70 * (16 + 2))
    a = C.kernel_args(prob, out, None, async_copy=True, splits=3, split_tiles=2, workspace=ws)[0]
    assert int(a["part_acc"]) == ws.data_ptr()
    assert int(a["part_ml"]) == ws.data_ptr() + 4 * 3 * 2 * 70 * 16
    assert (int(a["async_copy"]), int(a["splits"]), int(a["split_tiles"]), int(a["lse"])) == (1, 3, 2, 0)


# ---- rowmax's launch-time choices -------------------------------------------------------------------------


def test_rowmax_split_plan():
    # Seed case: 128 blocks on 132 SMs, 16 key tiles: 4 splits of 4 tiles.
    assert C.rowmax_split_plan(1, 8, 1024, 1024, 64, 132) == (4, 4)
    # Large grids are not split.
    assert C.rowmax_split_plan(8, 16, 2048, 2048, 64, 132) == (1, 32)
    assert C.rowmax_split_plan(1, 9, 2048, 2048, 64, 132)[0] == 1  # 288 blocks: two per SM already
    assert C.rowmax_split_plan(1, 8, 2048, 2048, 64, 132) == (3, 11)  # 256 blocks: 3 splits, ~4 per SM
    # Few keys: every split keeps >= 4 tiles, so none.
    assert C.rowmax_split_plan(2, 4, 70, 201, 64, 132) == (1, 4)
    # A long key range with few query rows (decode-like): many splits, at most 16.
    splits, tiles = C.rowmax_split_plan(2, 2, 64, 8192, 128, 132)
    assert splits == 16 and tiles == 16
    # Forced: capped by the key tiles, and never a trailing split without tiles.
    assert C.rowmax_split_plan(1, 1, 64, 100, 64, 132, force=5) == (2, 1)
    assert C.rowmax_split_plan(1, 1, 64, 300, 64, 132, force=3) == (3, 2)
    assert C.rowmax_split_plan(1, 1, 64, 500, 64, 132, force=3) == (3, 3)
    for B, H, Nq, Nk, f in [(1, 1, 5, 1, 3), (3, 2, 65, 129, 2), (1, 3, 150, 67, 3), (2, 2, 131, 77, 2)]:
        splits, tiles = C.rowmax_split_plan(B, H, Nq, Nk, 64, 132, force=f)
        key_tiles = -(-Nk // 64)
        assert (splits - 1) * tiles < key_tiles <= splits * tiles


def test_rowmax_split_context_manager():
    with C.rowmax_splits(3):
        assert V.rowmax_forced_splits() == 3
        with C.rowmax_async_copy(False):
            assert not V.rowmax_async_on()
        assert V.rowmax_async_on()
    assert V.rowmax_forced_splits() is None
    with pytest.raises(ValueError, match="splits"):
        with C.rowmax_splits(0):
            pass


def test_can_async_copy():
    def prob(dtype=torch.float32, D=64, view=None):
        q = torch.randn(1, 2, 8, D, dtype=dtype)
        kv = torch.randn(1, 2, 8, D, dtype=dtype)
        if view == "strided_d":
            kv = torch.randn(D, 1, 2, 8, dtype=dtype).permute(1, 2, 3, 0)
        if view == "offset":  # rows start 4 bytes past a 16-byte boundary
            kv = torch.randn(1 * 2 * 8 * D + 1, dtype=dtype)[1:].view(1, 2, 8, D)
        if view == "bnhd":
            kv = torch.randn(1, 8, 2, D, dtype=dtype).transpose(1, 2)
        return make_problem(q, kv, kv)

    assert C.can_async_copy(prob())
    assert C.can_async_copy(prob(view="bnhd"))
    assert not C.can_async_copy(prob(D=40 + 2))
    assert not C.can_async_copy(prob(dtype=torch.float16))
    assert not C.can_async_copy(prob(view="strided_d"))
    assert not C.can_async_copy(prob(view="offset"))


def test_rowmax_shared_memory_layout():
    # q_s [64][D+4], K and V [stages][BN][D+4], p_t [BN][68], float32.
    assert C.Variant("rowmax", 0, 64, False).shared_bytes() == 4 * (64 * 68 + 2 * 2 * 64 * 68 + 64 * 68)
    assert C.Variant("rowmax", 0, 128, False).shared_bytes() == 4 * (64 * 132 + 2 * 2 * 32 * 132 + 32 * 68)
    assert C.Variant("rowmax", 0, 256, False).shared_bytes() == 4 * (64 * 260 + 2 * 1 * 32 * 260 + 32 * 68)
    # Two blocks per SM on sm_90 for D <= 128 (228 KB per SM, 1 KB reserved per block).
    for d in (64, 128):
        assert 2 * (C.Variant("rowmax", 0, d, False).shared_bytes() + 1024) <= 228 * 1024


def test_launch_config_rowmax_splits():
    v = C.choose_variant("rowmax", torch.float32, 64)
    assert C.launch_config(v, 1, 8, 1024, splits=4).grid == (8, 16, 4)
    assert C.launch_config(C.choose_variant("tiled", torch.float32, 64), 1, 8, 1024, splits=4).grid[2] == 1


def test_backends_refuse_cpu_tensors():
    prob = make_problem(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    for be in (C.CudaNaiveBackend(), C.CudaTiledBackend(), C.CudaRowmaxBackend()):
        assert "CUDA" in be.unsupported(prob)


# ---- the compile check -----------------------------------------------------------------------------------

PTXAS_SAMPLE = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z10attn_tiledILi0ELi64ELb0EEvPKvS1_' for 'sm_90'
ptxas info    : Function properties for _Z10attn_tiledILi0ELi64ELb0EEvPKvS1_
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 1040 bytes smem, 560 bytes cmem[0]
"""


def test_parse_ptxas_log():
    info = C.parse_ptxas_log(PTXAS_SAMPLE)
    assert info == {"_Z10attn_tiledILi0ELi64ELb0EEvPKvS1_": {
        "registers": 64, "smem": 1040, "stack": 16, "spill_stores": 8, "spill_loads": 12}}


def test_strict_flags_spills_only_where_it_should():
    def res(family, dmax, spill):
        return C.Resources(C.Variant(family, 0, dmax, False), "sm_90", 64, 0, 0, spill, spill)

    bad = C.strict_problems([res("rowmax", 64, 4), res("tiled", 128, 0), res("rowmax", 256, 8), res("naive", 256, 4)])
    assert len(bad) == 1 and "rowmax_f32_d64" in bad[0]
    # mma is held to 0 spills, at the register limit too.
    mma = C.Variant("mma", 1, 64, False)
    assert C.strict_problems([C.Resources(mma, "sm_90", 64, 0, 0, 0, 0)]) == []
    assert len(C.strict_problems([C.Resources(mma, "sm_90", 255, 0, 0, 4, 4)])) == 1

    def at_cap(spill_st, spill_ld):
        return C.Resources(C.Variant("rowmax", 0, 64, False), "sm_80", C.REGISTER_CAP, 0, 0, spill_st, spill_ld)

    assert C.strict_problems([at_cap(4, 36)]) == []  # the compiler's choice at the register cap: a warning
    assert len(C.strict_problems([at_cap(40, 40)])) == 1  # more than EDGE_SPILL_BYTES fails even at the cap


@needs_nvrtc
def test_compile_check_compiles_and_reports():
    results, errors = C.compile_check(archs=("sm_90",), families=("rowmax",), jobs=1)
    assert errors == []
    assert len(results) == len(C.variants("rowmax"))
    for r in results:
        assert 0 < r.registers <= 255
        assert r.spills == 0 or r.variant.dmax > 128 or C.at_the_edge(r)
    table = C.format_table(results)
    assert "rowmax_f16_d64" in table and "spill_st" in table


@needs_nvrtc
def test_compile_check_command_strict(capsys):
    from attnlab.cli import main

    rc = main(["compile-check", "--strict", "--arch", "sm_80", "--family", "naive", "--jobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "naive_bf16_fastexp" in out and "strict:" in out


@needs_nvrtc
def test_mangled_names_are_nvrtcs_lowered_names():
    """compile_check.mangled_name (how nvcc's ptxas lines are matched to variants) is what NVRTC lowers to."""
    from attnlab.backends.cuda.compile_check import mangled_name

    for family, nes in [("naive", [C.Variant("naive", 1, 256, True).name_expression]),
                        ("rowmax", [C.Variant("rowmax", 2, 128, False).name_expression, "attn_rowmax_merge<1>"])]:
        ok, log, lowered = C.Nvrtc().compile(C.kernel_source(family), "m.cu",
                                             [*C.NVRTC_OPTIONS, "--gpu-architecture=sm_80"], nes)
        assert ok, log
        assert {ne: mangled_name(ne) for ne in nes} == lowered


def test_kernel_source_inlines_each_header_once():
    for family in C.FAMILIES:
        src = C.kernel_source(family)
        assert "#include" not in src
        assert src.count("struct AttnParams {") == 1 and src.count("struct RowRule {") == 1


_NVCC = shutil.which("nvcc")


@pytest.mark.skipif(_NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("family", ["naive", "tiled", "rowmax", "mma"])
def test_each_cu_compiles_alone_with_nvcc(family):
    """``nvcc -c kernels/attn_<family>.cu`` for sm_80 and sm_90: the file's own #includes and explicit
    instantiations give every variant NVRTC compiles, and nvcc's spills are NVRTC's, except the one a
    different compiler version explains (compile_check's docstring: nvcc 13's NVVM spills rowmax D = 64 on
    sm_90, NVRTC 12.9 does not); register counts differ by a few between versions, within the launch bounds."""
    from attnlab.backends.cuda.compile_check import disagreements, nvcc_compile_family

    for arch in ("sm_80", "sm_90"):
        by_nvcc, err = nvcc_compile_family(_NVCC, family, arch, C.variants(family, arch))
        assert err == "", err
        assert len(by_nvcc) == len(C.variants(family, arch))
        if not _has_nvrtc():
            continue
        by_nvrtc, err = C.compile_family(C.Nvrtc(), family, arch, C.variants(family, arch))
        assert err == "", err
        nvrtc_spills = {(r.variant, r.arch): (r.spill_stores, r.spill_loads) for r in by_nvrtc}
        differ = [r.variant.label for r in by_nvcc if (r.spill_stores, r.spill_loads) != nvrtc_spills[r.variant, arch]]
        # rowmax D = 64 sits at exactly 128 registers under __launch_bounds__(256, 2): nvcc 13 spills 4/36 bytes
        # there on sm_90, and NVRTC 12.9 once did on sm_80 (rowmax_f32_d64_fastexp, in one of several CI runs of
        # the same commit: its output is not deterministic at that edge). Every other variant must agree.
        explained = [lb for lb in differ if lb.startswith("rowmax_") and "_d64" in lb]
        assert differ == explained, disagreements(by_nvrtc, by_nvcc)
        for r in by_nvcc:  # registers: the same launch bounds hold (their counts differ by a few across versions)
            cap = {"naive": 255, "tiled": 128, "rowmax": 128 if r.variant.dmax <= 128 else 255, "mma": 255}[family]
            assert 0 < r.registers <= cap, (r.variant.label, arch, r.registers)


# ---- GPU: correctness against the float64 reference -----------------------------------------------------


def _gpu_cases() -> list[Case]:
    return gpu_cases()


def _verify(backends, cases, dtypes=None, device="cuda"):
    """The checker exactly as users call it: (table, failing rows, summary)."""
    df = check.verify(backends=list(backends), cases=cases, device=device, dtypes=dtypes, seed=1234)
    return df, df[~df["passed"].astype(bool)], check.summarize(df)


def test_gpu_case_list_is_valid_and_checker_runs_it_on_cpu():
    """The extra GPU cases are plain Cases, and the GPU tests' verify call works (textbook backend, CPU)."""
    cases = _gpu_cases()
    assert all(isinstance(c, Case) for c in cases) and len({c.name for c in cases}) == len(cases)
    small = [c for c in cases if c.name.startswith("d16_")] + [c for c in default_cases() if c.name == "causal"]
    df, bad, summary = _verify(["torch"], small, device="cpu")
    assert len(df) == 3 * len(small) and bad.empty, summary


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_passes_checker_on_matrix(backend):
    df, bad, summary = _verify([backend], _gpu_cases())
    print(summary)
    assert len(df) > 150
    assert bad.empty, summary


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_passes_checker_default_sizes(backend):
    _df, bad, summary = _verify([backend], default_cases())
    print(summary)
    assert bad.empty, summary


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_long_sequence_8192(backend):
    cases = n8192_cases()
    _df, bad, summary = _verify([backend], cases)
    print(summary)
    assert bad.empty, summary


#: fast_exp (__expf = ex2.approx(x * log2 e)): a few ulp per exp plus the rounding of x * log2 e, which
#: grows with |x|; scores here are O(10), so float32 outputs stay within 1e-4. verify() applies the dtype's
#: default tolerance (1e-5 for float32), so a float32 row also counts as passing at fast_exp's tolerance when
#: it ran, has no NaN, and max_abs <= 1e-4 (which implies |out - ref| <= 1e-4 + 1e-4 |ref| everywhere) with
#: the lse within verify's float32 bound. Half types keep their own tolerances: their rounding dominates.
FAST_EXP_ATOL = {torch.float32: 1e-4}


def _passed_at_fast_exp_tolerance(df):
    loose = (df["error"] == "") & (df["nan"] == 0) & (df["max_abs"] <= FAST_EXP_ATOL[torch.float32]) & (
        df["lse_max_abs"] <= FAST_EXP_ATOL[torch.float32])
    return df["passed"].astype(bool) | loose


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_exp_variant_at_its_tolerance(backend):
    names = ("causal", "bias_full", "gqa_causal_br", "q_len_causal_br", "dense_d128", "window")
    cases = [c for c in default_cases(scale=3) if c.name in names]
    with C.fast_exp():
        df32, _bad, s32 = _verify([backend], cases, dtypes=[torch.float32])
        _df, bad16, s16 = _verify([backend], cases, dtypes=[torch.float16, torch.bfloat16])
    print(s32, s16, sep="\n")
    assert _passed_at_fast_exp_tolerance(df32).all(), s32
    assert bad16.empty, s16


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 3])
def test_rowmax_split_keys_and_merge_on_matrix(splits):
    """The split-key path of cuda-rowmax (partial (m, l, acc) states merged by a second kernel), which the
    automatic choice takes only for small grids, forced on the whole matrix."""
    with C.rowmax_splits(splits):
        df, bad, summary = _verify(["cuda-rowmax"], _gpu_cases() + default_cases())
    print(summary)
    assert len(df) > 150 and bad.empty, summary


@pytest.mark.gpu
def test_rowmax_element_load_path_on_aligned_float32():
    """The element-by-element tile loads (the fallback of cp.async), forced on float32 inputs that would
    otherwise take the cp.async path."""
    cases = [c for c in _gpu_cases() if c.view == "contiguous"] + default_cases()
    with C.rowmax_async_copy(False):
        _df, bad, summary = _verify(["cuda-rowmax"], cases, dtypes=[torch.float32])
    print(summary)
    assert bad.empty, summary


def _mma_cases(cases: list[Case]) -> list[Case]:
    """The cases the tensor-core kernel takes: D <= 128, and at least one 16-bit dtype."""
    return [c for c in cases if c.D <= 128 and (c.dtypes is None or set(c.dtypes) & set(HALF))]


def _verify_mma(cases: list[Case]):
    df, bad, summary = _verify([MMA], _mma_cases(cases), dtypes=HALF)
    assert (df["status"] != "skipped").all(), summary  # every row it was given is one it takes: none skipped
    return df, bad, summary


@pytest.mark.gpu
def test_mma_passes_checker_on_matrix():
    df, bad, summary = _verify_mma(_gpu_cases())
    print(summary)
    assert len(df) >= 100  # the matrix's cases with D <= 128, in two dtypes
    assert bad.empty, summary


@pytest.mark.gpu
def test_mma_takes_the_wide_kernel_only_where_it_applies():
    """On sm_90 a plain call runs the wide kernel, one with a bias, expf or a scale above 1 in base 2 does not;
    elsewhere none does. ``mma_wide(False)`` turns it off. The backend names the kernel it launches (the bench
    notes it)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 2, 200, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    sm90 = torch.cuda.get_device_capability() == (9, 0)

    def wide(fast=None, **kw) -> bool:
        prob = make_problem(q, q, q, **kw)
        launched = C.prepare("mma", prob, torch.empty_like(q), None, fast).variant
        if fast is None:
            assert C.CudaMmaBackend().kernel_label(prob) == launched.label
        return launched.wide

    assert wide() == sm90 and wide(causal=True, window=(50, 0)) == sm90
    assert not wide(mask=torch.zeros(200, 200, device="cuda")) and not wide(fast=False) and not wide(scale=0.8)
    with C.mma_wide(False):
        assert not wide()
    assert wide() == sm90


@pytest.mark.gpu
def test_mma_without_the_wide_kernel_passes_checker_on_matrix():
    """On sm_90 the matrix's cases without an explicit term run the wide kernel; here the kernel's own tiles
    take them (on other GPUs this repeats test_mma_passes_checker_on_matrix)."""
    with C.mma_wide(False):
        df, bad, summary = _verify_mma(_gpu_cases())
    print(summary)
    assert len(df) >= 100 and bad.empty, summary


@pytest.mark.gpu
def test_mma_passes_checker_default_sizes_and_8192():
    df, bad, summary = _verify_mma(default_cases() + n8192_cases())
    print(summary)
    assert len(df) > 20 and bad.empty, summary


@pytest.mark.gpu
def test_mma_element_load_path_on_the_matrix():
    """The element-by-element tile loads, forced on inputs that would take cp.async (and taken anyway by the
    matrix's strided views and odd head dims)."""
    with C.rowmax_async_copy(False):
        df, bad, summary = _verify_mma(_gpu_cases() + default_cases())
    print(summary)
    assert len(df) > 100 and bad.empty, summary


@pytest.mark.gpu
def test_mma_expf_variant():
    """The tensor-core kernel in base e with IEEE expf (its default, ex2.approx, runs in the tests above)."""
    names = ("causal", "bias_full", "gqa_causal_br", "q_len_causal_br", "dense_d128", "window")
    cases = [c for c in default_cases(scale=3) if c.name in names]
    with C.fast_exp(False):
        _df, bad, summary = _verify_mma(cases)
    print(summary)
    assert bad.empty, summary


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.3, 2.0, -0.3, -2.0, 0.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fast", [None, False])
def test_scale_of_either_sign_on_wholly_allowed_tiles(scale, causal, fast):
    """The mma kernel takes the max over the raw scores in wholly allowed tiles, which holds only for scale > 0,
    and forms the exponent as one FFMA, which needs the scaled scores not to overflow (scale at most 1 in its
    unit); other scales take its scaling pass. A negative scale on the fast path would take each row's smallest
    score as its max: the online softmax stays right until exp overflows, which -2.0 (scores' spread past 128 in
    base 2) brings about. Every CUDA family, in its default exp and in expf, N long enough for several wholly allowed
    tiles, judged against the float64 reference with the textbook call as the baseline; at |scale| = 2 by the
    baseline criterion alone, as the float32 textbook itself misses the 1e-5 absolute tolerance there."""
    import attnlab

    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 3, 300, 64, device="cuda", generator=gen) for _ in range(3))
    for be in (*BACKENDS, MMA):
        dt = torch.bfloat16 if be == MMA else torch.float32
        qd, kd, vd = q.to(dt), k.to(dt), v.to(dt)
        ref = attnlab.reference(qd, kd, vd, causal=causal, scale=scale)[0]
        with C.fast_exp(fast):
            out = attnlab.attention(qd, kd, vd, causal=causal, scale=scale, backend=be)
        base = attnlab.attention(qd, kd, vd, causal=causal, scale=scale, backend="torch")
        rep = check.compare(out, ref, base=base)
        # |scale| > 1: the float32 textbook itself misses the absolute tolerance; the baseline criterion judges
        ok = rep.baseline_passed if abs(scale) > 1 else rep.passed
        assert ok, f"{be} scale={scale} causal={causal} fast_exp={fast}: {rep}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [*BACKENDS, MMA])
def test_repeated_calls_launch_without_planning_and_match_the_whole_way(backend, monkeypatch):
    """The second call of a signature takes the backend's fast call (no plan: ``_plan`` is not reached) and gives
    the whole way's answer bit for bit, in both layouts, with and without lse; a changed setting (expf) sends it
    the whole way again. A call with lengths has none, nor does a split rowmax call or an mma call with odd D."""
    import attnlab
    from attnlab import fast_calls
    from attnlab.backends.cuda import launch

    dt = torch.bfloat16 if backend == MMA else torch.float32
    gen = torch.Generator(device="cuda").manual_seed(11)
    fresh = lambda shape: torch.randn(shape, device="cuda", dtype=dt, generator=gen)
    plan = launch._plan

    def no_plan(*a, **kw):
        raise AssertionError("planned again: the fast call was not taken")

    with C.rowmax_splits(1):  # (a split plan holds a workspace: no fast call)
        for layout, shape in (("bhnd", (2, 4, 130, 64)), ("bnhd", (2, 130, 4, 64))):
            for lse in (False, True):
                fast_calls.clear()
                kw = dict(causal=True, layout=layout, backend=backend, return_lse=lse)
                attnlab.attention(fresh(shape), fresh(shape), fresh(shape), **kw)  # the whole way: remembered
                q, k, v = fresh(shape), fresh(shape), fresh(shape)
                monkeypatch.setattr(launch, "_plan", no_plan)
                got = attnlab.attention(q, k, v, **kw)
                monkeypatch.setattr(launch, "_plan", plan)
                fast_calls.clear()
                whole = attnlab.attention(q, k, v, **kw)
                for a, b in zip(got if lse else (got,), whole if lse else (whole,), strict=True):
                    assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        other_exp = not C.fast_exp_of(backend[len("cuda-"):])
        with C.fast_exp(other_exp):
            changed = attnlab.attention(q, k, v, **kw)  # the fast call declines; the whole way runs the other exp
        fast_calls.clear()
        with C.fast_exp(other_exp):
            assert torch.equal(changed[0], attnlab.attention(q, k, v, **kw)[0])
        fast_calls.clear()  # lengths as an int keep a signature; the backend declines to hand back a fast call
        attnlab.attention(q, k, v, causal=True, layout="bnhd", backend=backend, kv_len=100)
        assert not fast_calls._CALLS
    fast_calls.clear()
    if backend == "cuda-rowmax":  # a split plan's workspace: no fast call
        with C.rowmax_splits(2):
            attnlab.attention(q, k, v, causal=True, layout="bnhd", backend=backend)
        assert not fast_calls._CALLS
    if backend == MMA:  # an odd D's staged output: no fast call
        odd = fresh((2, 4, 130, 33))
        attnlab.attention(odd, odd, odd, causal=True, backend=backend)
        assert not fast_calls._CALLS


def test_mma_stores_pairs_only_where_the_output_takes_them():
    """The mma kernel writes two columns per 32-bit store: D even, unit stride on D, 4-byte aligned rows."""
    assert C.pair_stores_ok(64, 1024, (4096, 64, 64, 1))
    assert not C.pair_stores_ok(33, 1024, (4224, 132, 33, 1))  # D odd
    assert not C.pair_stores_ok(64, 1026, (4096, 64, 64, 1))  # base 2 bytes off
    assert not C.pair_stores_ok(64, 1024, (4096, 64, 1, 64))  # D not the unit-stride axis
    assert not C.pair_stores_ok(64, 1024, (4096, 64, 65, 1))  # an odd row stride


@pytest.mark.gpu
@pytest.mark.parametrize("D", [33, 64])
def test_mma_output_staged_only_when_it_cannot_store_pairs(D):
    """An odd D goes through a staging buffer (D + 1 wide) that the launch copies into the output; an even D
    writes the output itself, unless its rows are an odd number of elements apart. Either way the result passes
    against the float64 reference, with lse, and a staged output holds what a plain one does."""
    import attnlab

    gen = torch.Generator(device="cuda").manual_seed(D)
    q, k, v = (torch.randn(2, 3, 150, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    prob = make_problem(q, k, v, causal=True)
    launch = C.prepare("mma", prob, torch.empty_like(q), None)
    assert (launch.keep_alive[-1] is None) == (D % 2 == 0)
    # An even D into rows an odd number of elements apart: staged too, and the same values as a plain output.
    plain, strided = torch.empty_like(q), torch.empty(*q.shape[:-1], D + 1, device="cuda", dtype=q.dtype)[..., :D]
    C.prepare("mma", prob, plain, None)()
    staged = C.prepare("mma", prob, strided, None)
    assert staged.keep_alive[-1] is not None
    staged()
    assert torch.equal(strided, plain)
    out, lse = attnlab.attention(q, k, v, causal=True, backend=MMA, return_lse=True)
    ref, ref_lse = attnlab.reference(q, k, v, causal=True)
    base = attnlab.attention(q, k, v, causal=True, backend="torch")
    assert check.compare(out, ref, base=base).passed
    assert torch.allclose(lse, ref_lse.to(lse.dtype), atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [36, 64, 128])
def test_mma_stores_whole_chunks_or_pairs(D):
    """The kernel copies a finished row out in 16-byte chunks where a chunk is whole inside D and aligned, else
    in 32-bit pairs. Rows 4 but not 16 bytes aligned (a view at column 2 of rows D + 6 wide), and a D that ends
    inside a chunk (36), are written in place, value for value what a plain output gets, and nothing outside
    the view is touched: not the columns beside it, not the rows past Nq."""
    import attnlab

    gen = torch.Generator(device="cuda").manual_seed(D + 1)
    q, k, v = (torch.randn(2, 3, 150, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    prob = make_problem(q, k, v, causal=True)
    plain = torch.empty_like(q)
    C.prepare("mma", prob, plain, None)()
    wide = torch.full((2, 3, 150 + 2, D + 6), 7.0, device="cuda", dtype=q.dtype)
    view = wide[:, :, :150, 2:2 + D]
    launch = C.prepare("mma", prob, view, None)
    assert launch.keep_alive[-1] is None  # pairs fit: no staging buffer, the kernel writes the view itself
    launch()
    assert torch.equal(view, plain)
    assert bool((wide[..., :2] == 7).all()) and bool((wide[..., 2 + D:] == 7).all())
    assert bool((wide[:, :, 150:] == 7).all())
    ref, _ = attnlab.reference(q, k, v, causal=True)
    assert check.compare(plain, ref, base=attnlab.attention(q, k, v, causal=True, backend="torch")).passed


@pytest.mark.gpu
def test_mma_refuses_what_it_does_not_take_on_the_gpu():
    import attnlab
    from attnlab.backends import registry

    q = torch.randn(1, 2, 64, 64, device="cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        attnlab.attention(q, q, q, backend=MMA)
    big = torch.randn(1, 2, 64, 256, device="cuda", dtype=torch.bfloat16)
    assert "D up to 128" in registry()[MMA].unsupported(make_problem(big, big, big))


@pytest.mark.gpu
def test_empty_rows_are_zero_and_lse_minus_inf():
    import attnlab

    q = torch.randn(2, 2, 40, 64, device="cuda")
    k = torch.randn(2, 2, 50, 64, device="cuda")
    for be in (*BACKENDS, MMA):
        if be == MMA:
            q, k = q.bfloat16(), k.bfloat16()
        out, lse = attnlab.attention(q, k, k, kv_len=[0, 50], q_len=[40, 10], backend=be, return_lse=True)
        assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
        assert torch.all(out[1, :, 10:] == 0) and torch.all(lse[1, :, 10:] == float("-inf"))
        assert not torch.isnan(out).any()


@pytest.mark.gpu
def test_launch_is_on_torch_current_stream():
    import attnlab

    q = torch.randn(1, 4, 300, 64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q2 = q * 2  # produced on s: the kernel must be ordered after it
        out = attnlab.attention(q2, q2, q2, causal=True, backend="cuda-rowmax")
    torch.cuda.synchronize()
    ref = attnlab.attention(q * 2, q * 2, q * 2, causal=True, backend="reference")
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_a_probes_kernel_launches_in_place_of_the_variants_own(monkeypatch):
    """_Compiled.launch with ``function`` (PreparedLaunch.launch_kernel's path) enqueues that kernel where the
    variant's own would go: same grid, block, shared memory, parameters and stream, under the device's context
    when another is current, and a failure names the variant. CPU: CuPy and the stream are stand-ins."""
    from attnlab.backends.cuda import launch as L

    calls, entered = [], []

    class Device:
        def __init__(self, dev):
            self.dev = dev

        def __enter__(self):
            entered.append(self.dev)

        def __exit__(self, *exc):
            return False

    current = {"dev": 0}
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: current["dev"]), Device=Device))
    c = object.__new__(L._Compiled)
    c.cupy, c.device, c.variant = cupy, 1, types.SimpleNamespace(label="mma_test")
    c.function = lambda *a, **k: calls.append(("own", a, k))
    c.merge = lambda *a, **k: calls.append(("merge", a, k))
    monkeypatch.setattr(L, "_cupy_stream", lambda dev: f"stream{dev}")
    cfg = V.LaunchConfig((4, 2, 1), (128, 1, 1), 4096)

    def probe(*a, **k):
        calls.append(("probe", a, k))

    for dev in (1, 0):  # the kernel's device current, then another one
        current["dev"] = dev
        c.launch(cfg, None, "ARG", 1, function=probe)
    want = ("probe", ((4, 2, 1), (128, 1, 1), ("ARG",)), {"shared_mem": 4096, "stream": "stream1"})
    assert calls == [want, want] and entered == [1]

    def broken(*a, **k):
        raise ValueError("bad")

    with pytest.raises(RuntimeError, match="launch of mma_test failed"):
        c.launch(cfg, None, "ARG", 1, function=broken)


def test_build_module_compiles_the_text_it_is_given(monkeypatch):
    """launch.build_module, which the public path caches and an A/B probe calls with patched text: NVRTC gets the
    family's own text by default or the given one, with the house options and the variant's name expression,
    on the device's context; a kernel needing more than the default shared memory gets its limit raised,
    after a check against the device. CPU: CuPy is a stand-in."""
    from attnlab.backends.cuda import launch as L
    from attnlab.backends.cuda.sources import NVRTC_OPTIONS, kernel_source

    built, devices = [], []

    class Kernel:
        max_dynamic_shared_size_bytes = 0

    class Module:
        def __init__(self, code, options, name_expressions):
            built.append((code, options, tuple(name_expressions)))

        def get_function(self, name):
            return Kernel()

    class Device:
        def __init__(self, dev):
            devices.append(dev)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.SimpleNamespace(RawModule=Module, cuda=types.SimpleNamespace(Device=Device))
    monkeypatch.setattr(L, "cupy_module", lambda: fake)
    monkeypatch.setattr(L, "device_limits", lambda dev: V.DeviceLimits())
    wide = V.choose_variant("mma", torch.bfloat16, 128, True, True)
    assert wide.shared_bytes() > L.DEFAULT_SMEM
    kern, merge = L.build_module(wide, 3, "PATCHED TEXT")
    assert built == [("PATCHED TEXT", NVRTC_OPTIONS, (wide.name_expression,))] and devices == [3]
    assert merge is None and kern.max_dynamic_shared_size_bytes == wide.shared_bytes()
    L.build_module(wide, 3)
    assert built[-1][0] == kernel_source("mma")
