"""What the kernels read, and nothing more (issue 13):

* a bias is read in the caller's dtype (float32, float16, bfloat16, float64) inside the kernels: neither the
  validated problem nor a call holds a float32 copy of it (at most 1 MiB beyond out and lse for any mask);
* a row tile whose rows are all padding (i0 >= q_len) writes its zeros and reads nothing of Q, K, V or the
  mask;
* lengths that reach the kernels unclamped (a future GPU path) keep every load inside the tensors.

CPU tests run the Triton kernels through the interpreter, whose loads are recorded here by address. GPU tests
(marker ``gpu``) check the same on the compiled Triton kernels and the three CUDA kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

import attnlab
from attnlab.backends.triton import backward as triton_bwd
from attnlab.backends.triton import bwd_launch
from attnlab.backends.triton import configs as tconfigs
from attnlab.backends.triton import forward as tlaunch
from attnlab.backends.triton.backend import TritonBackend
from attnlab.check import compare
from attnlab.problem import Problem, make_problem
from attnlab.reference import reference

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
MiB = 2**20


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor a (frozen) dataclass holds, one level of nesting deep (Problem -> MaskSpec)."""
    found = []
    for f in dataclasses.fields(obj):
        x = getattr(obj, f.name)
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif dataclasses.is_dataclass(x):
            found += _tensors(x)
        elif isinstance(x, dict):
            found += [t for t in x.values() if isinstance(t, torch.Tensor)]
    return found


def _allocated_bytes(fn) -> int:
    """Bytes the CPU allocator hands out while ``fn`` runs (all allocations counted, none netted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


# ---- 1. a bias in its own dtype -------------------------------------------------------------------------
@pytest.mark.parametrize("bias_dtype", [F32, F16, BF16, F64], ids=str)
def test_problem_holds_no_copy_of_the_bias(bias_dtype):
    """The spec's bias is the caller's tensor (its storage, its dtype), expanded; every other tensor of the
    problem is small. Validation allocates under 1 MiB for an 8 MiB bf16 bias (a float32 copy: 16 MiB)."""
    H, N = 8, 512
    q = torch.randn(2, H, N, 16, dtype=BF16)
    bias = torch.randn(1, H, N, N, dtype=bias_dtype)
    prob = make_problem(q, q, q, mask=bias, kv_len=[N, 100])
    assert prob.spec.bias.dtype == bias_dtype
    assert prob.spec.bias.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
    assert prob.spec.bias.stride() == (0, N * N, N, 1)
    for t in _tensors(prob):
        shared = t.untyped_storage().data_ptr() in (q.untyped_storage().data_ptr(), bias.untyped_storage().data_ptr())
        assert shared or t.untyped_storage().nbytes() <= MiB, (t.dtype, t.shape)
    assert _allocated_bytes(lambda: make_problem(q, q, q, mask=bias, kv_len=[N, 100])) <= MiB


@pytest.mark.parametrize("bias_dtype", [F16, BF16], ids=str)
def test_kernel_arguments_are_the_callers_bias(bias_dtype):
    """The Triton forward and backward get the caller's bias pointer and dtype, with its broadcast strides."""
    q = torch.randn(2, 4, 40, 16)
    bias = torch.randn(4, 1, 40, dtype=bias_dtype)  # [H, 1, Nk]: broadcast over B and rows
    prob = make_problem(q, q, q, mask=bias)
    _head, mid, tail, constants = tlaunch._arguments(prob, tconfigs.INTERPRETER_CONFIG, True, True)
    e = mid[2]
    assert e.dtype == bias_dtype and e.data_ptr() == bias.data_ptr() and constants["HAS_BIAS"]
    assert tuple(tail[:4]) == (0, 40, 0, 1)
    ptrs, (strides, bwd_constants) = bwd_launch.mask_pointers(prob), bwd_launch.mask_arguments(prob)
    assert ptrs[2].dtype == bias_dtype and ptrs[2].data_ptr() == bias.data_ptr() and bwd_constants["HAS_BIAS"]
    assert strides[:4] == [0, 40, 0, 1]  # (then the ALiBi slopes' strides)


def _bias_inputs(dtype, bias_dtype, seed=0):
    """GQA, bottom-right causal, ragged lengths and a [1, Hq, Nq, Nk] bias (-inf entries, a fully masked row)
    in ``bias_dtype``; values up to about 8 so that rounding the bias in the wrong precision shows."""
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 37, 45, 16
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    bias = 4 * torch.randn(1, Hq, Nq, Nk, generator=g)
    bias = bias.masked_fill(torch.rand(bias.shape, generator=g) < 0.2, float("-inf"))
    bias[:, :, 3] = float("-inf")
    kw = dict(mask=bias.to(bias_dtype), causal=True, align="bottom_right", kv_len=[45, 30], q_len=[37, 20])
    return q, k, v, kw


@pytest.mark.parametrize(("dtype", "bias_dtype"), [(F32, F16), (F32, BF16), (F32, F64), (BF16, BF16), (F16, BF16),
                                                   (F16, F32)], ids=str)
def test_triton_forward_reads_the_bias_in_its_dtype(dtype, bias_dtype):
    """out and lse match the float64 reference (which adds the bias exactly) at the inputs' tolerance: for
    float32 inputs that is tight enough to catch a bias rounded to its own dtype after the log2(e) scaling."""
    q, k, v, kw = _bias_inputs(dtype, bias_dtype)
    out, lse = attnlab.attention(q, k, v, backend="triton", return_lse=True, **kw)
    ref, ref_lse = reference(q, k, v, **kw)
    assert compare(out, ref, dtype=dtype)
    empty = torch.isinf(ref_lse)
    assert empty.any() and (lse[empty] == float("-inf")).all() and (out[empty] == 0).all()
    lse_atol = 1e-4 if dtype == F32 else 5e-2
    assert (lse[~empty].double() - ref_lse[~empty]).abs().max() <= lse_atol


@pytest.mark.parametrize("bias_dtype", [F16, BF16], ids=str)
def test_triton_backward_reads_the_bias_in_its_dtype(bias_dtype):
    """float32 gradients with a half-precision bias match float64 autograd of the reference tightly."""
    q, k, v, kw = _bias_inputs(F32, bias_dtype, seed=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    prob = make_problem(q, k, v, **kw)
    out, lse = attnlab.attention(q, k, v, backend="triton", return_lse=True, **kw)
    ours = triton_bwd.backward(prob, out, lse, dout)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    reference(*leaves, **kw)[0].backward(dout.double())
    for name, g, x in zip(("dq", "dk", "dv"), ours, leaves):
        err = (g.double() - x.grad).abs().max().item()
        assert err <= 5e-6 * max(1.0, x.grad.abs().max().item()), (name, err)


def test_triton_call_allocates_only_out_and_lse(monkeypatch):
    """A whole call with a bf16 bias [1, H, N, N] allocates out and lse and at most 1 MiB more (the bias's
    float32 copy would be 2.25 MiB). Larger interpreter tiles keep it quick."""
    monkeypatch.setattr(tconfigs, "INTERPRETER_CONFIG", tconfigs.Config(64, 64, 1, 1, keys_major=True, rows_outer=True))
    H, N, D = 4, 384, 16
    q = torch.randn(1, H, N, D)
    bias = torch.randn(1, H, N, N, dtype=BF16)
    attnlab.attention(q, q, q, mask=bias, backend="triton")  # warm: the interpreter's one-time set-up
    out_lse = H * N * D * 4 + H * N * 4
    got = _allocated_bytes(lambda: attnlab.attention(q, q, q, mask=bias, backend="triton", return_lse=True))
    assert got <= out_lse + MiB, got


# ---- 2. padding row tiles read nothing; unclamped lengths stay in bounds --------------------------------
@contextlib.contextmanager
def _recorded_loads(monkeypatch):
    """Every address the interpreter loads, as (program id (x, y, z), numpy array of byte addresses)."""
    from triton.runtime.interpreter import InterpreterBuilder

    loads: list[tuple[tuple[int, int, int], np.ndarray]] = []
    create = InterpreterBuilder.create_masked_load

    def create_masked_load(self, ptrs, mask, other, *rest):
        addr = np.asarray(ptrs.data).astype(np.uint64)
        ok = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        loads.append((tuple(int(i) for i in self.grid_idx), addr[ok].copy()))
        return create(self, ptrs, mask, other, *rest)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", create_masked_load)
    yield loads


def _span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _inside(addr: np.ndarray, span: tuple[int, int]) -> np.ndarray:
    return (addr >= span[0]) & (addr < span[1])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)  # keys-major and query-major
def test_padding_row_tiles_read_nothing(dtype, monkeypatch):
    """Programs whose rows all lie at or past q_len read only the lengths (no Q, K, V or mask) and still
    write out = 0 and lse = -inf. Batch entry 1 has q_len 5: its row tiles 1 and 2 are padding."""
    B, H, Nq, Nk, D = 2, 2, 40, 30, 16
    q, k, v = torch.randn(B, H, Nq, D).to(dtype), torch.randn(B, H, Nk, D).to(dtype), torch.randn(B, H, Nk, D).to(dtype)
    mask = torch.rand(1, H, Nq, Nk) < 0.8
    kw = dict(q_len=[40, 5], kv_len=[30, 25], mask=mask)
    with _recorded_loads(monkeypatch) as loads:
        out, lse = attnlab.attention(q, k, v, backend="triton", return_lse=True, **kw)
    cfg = tconfigs.INTERPRETER_CONFIG
    assert cfg.rows_outer  # grid (Hq, B, row tiles), the last row tile first
    tiles = -(-Nq // cfg.block_m)
    data = [_span(t) for t in (q, k, v, mask)]
    padding_programs = set()
    for (_h, b, z), addr in loads:
        i0 = (tiles - 1 - z) * cfg.block_m
        if i0 >= kw["q_len"][b]:
            padding_programs.add((_h, b, z))
            for span in data:
                assert not _inside(addr, span).any(), f"padding tile {i0} of batch {b} read its inputs"
    assert len(padding_programs) == 2 * H  # they ran (and loaded the lengths), and read nothing else
    assert (out[1, :, 5:] == 0).all() and (lse[1, :, 5:] == float("-inf")).all()
    ref, _ = reference(q, k, v, **kw)
    assert compare(out, ref, dtype=dtype)


def _unclamped(prob: Problem, kv_len: list[int], q_len: list[int]) -> Problem:
    """``prob`` with lengths that bypass validation (out of [0, N]): what a kernel may be handed by a path that
    passes GPU lengths without clamping them."""
    dev = prob.device
    spec = dataclasses.replace(prob.spec, kv_len=torch.tensor(kv_len, dtype=torch.int32, device=dev),
                               q_len=torch.tensor(q_len, dtype=torch.int32, device=dev))
    return Problem(q=prob.q, k=prob.k, v=prob.v, spec=spec, scale=prob.scale, layout=prob.layout)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_unclamped_lengths_are_clamped_by_the_kernels(dtype):
    """kv_len / q_len below 0 or past N, passed to the kernels as they are, give exactly what the clamped
    lengths give, forward and backward. Unclamped, batch entry 0 (kv_len Nk + 100) would read batch entry
    1's keys as its keys Nk.., and entry 1 (q_len Nq + 50) would put its bottom-right diagonal elsewhere."""
    B, H, Nq, Nk, D = 3, 2, 21, 26, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (Nq, Nk, Nk))
    bias = torch.randn(B, 1, Nq, Nk, generator=g, dtype=F32)
    kw = dict(causal=True, align="bottom_right", mask=bias)
    wild = _unclamped(make_problem(q, k, v, **kw), kv_len=[Nk + 100, 10, -7], q_len=[Nq, Nq + 50, -3])
    clamped = make_problem(q, k, v, kv_len=[Nk, 10, 0], q_len=[Nq, Nq, 0], **kw)
    results = []
    for prob in (wild, clamped):
        out, lse = torch.empty(B, H, Nq, D, dtype=dtype), torch.empty(B, H, Nq)
        TritonBackend().forward(prob, out, lse)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        results.append((out, lse, *triton_bwd.backward(prob, out, lse, dout)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name
    ref, _ = reference(q, k, v, kv_len=[Nk, 10, 0], q_len=[Nq, Nq, 0], **kw)
    assert compare(results[1][0], ref, dtype=dtype)


# ---- GPU: the compiled Triton kernels and the three CUDA kernels ----------------------------------------
KERNEL_BACKENDS = ("triton", "cuda-naive", "cuda-tiled", "cuda-rowmax", "cuda-mma")


def _backend(name: str):
    from attnlab.backends import registry

    be = registry()[name]
    if not be.availability().available:
        pytest.skip(f"{name}: {be.availability()}")
    return be


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(("dtype", "bias_dtype"), [(F32, F16), (F32, BF16), (F32, F64), (BF16, BF16), (F16, BF16),
                                                   (BF16, F32)], ids=str)
def test_gpu_bias_read_in_its_dtype(backend, dtype, bias_dtype):
    """As on CPU, on every kernel: the bias's dtype reaches the kernel (no copy) and is read right."""
    _backend(backend)
    if backend == "cuda-mma" and dtype == F32:
        pytest.skip("cuda-mma takes 16-bit inputs only (its refusal: test_cuda.py)")
    q, k, v, kw = _bias_inputs(dtype, bias_dtype)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    kw["mask"] = kw["mask"].cuda()
    out, lse = attnlab.attention(q, k, v, backend=backend, return_lse=True, **kw)
    ref, ref_lse = reference(q, k, v, **kw)
    assert compare(out, ref, dtype=dtype)
    empty = torch.isinf(ref_lse)
    assert (lse[empty] == float("-inf")).all() and (out[empty] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_gpu_bias_call_peak_memory(backend):
    """The issue's case: a bf16 bias [1, H16, N2048, N2048] (128 MiB) costs at most 1 MiB beyond out and lse
    (its float32 copy was 256 MiB). Measured on the second call (the first may autotune)."""
    _backend(backend)
    H, N, D = 16, 2048, 64
    q = torch.randn(1, H, N, D, device="cuda", dtype=BF16)
    bias = torch.randn(1, H, N, N, device="cuda", dtype=BF16)
    attnlab.attention(q, q, q, mask=bias, backend=backend, return_lse=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = attnlab.attention(q, q, q, mask=bias, backend=backend, return_lse=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size() - lse.numel() * 4
    assert extra <= MiB, f"{backend}: {extra / MiB:.1f} MiB beyond out and lse"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_gpu_unclamped_lengths_are_clamped_by_the_kernels(backend):
    """GPU lengths out of [0, N] handed to the kernels as they are (bypassing MaskSpec's clamp) give exactly
    what the clamped lengths give; for triton the backward too."""
    be = _backend(backend)
    B, H, Nq, Nk, D = 3, 2, 150, 190, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(BF16).cuda() for n in (Nq, Nk, Nk))
    bias = torch.randn(B, 1, Nq, Nk, generator=g).cuda()
    kw = dict(causal=True, align="bottom_right", mask=bias)
    wild = _unclamped(make_problem(q, k, v, **kw), kv_len=[Nk + 100, 10, -7], q_len=[Nq, Nq + 50, -3])
    clamped = make_problem(q, k, v, kv_len=[Nk, 10, 0], q_len=[Nq, Nq, 0], **kw)
    results = []
    for prob in (wild, clamped):
        out, lse = torch.empty(B, H, Nq, D, dtype=BF16, device="cuda"), torch.empty(B, H, Nq, device="cuda")
        be.forward(prob, out, lse)
        got = [out, lse]
        if backend == "triton":
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(BF16).cuda()
            got += triton_bwd.backward(prob, out, lse, dout)
        results.append(got)
    for a, b in zip(*results):
        assert torch.equal(a, b)
