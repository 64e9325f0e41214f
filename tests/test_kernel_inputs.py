"""What the kernels read, and nothing more (issue 13):

* a bias is read in the caller's dtype (float32, float16, bfloat16, float64) inside the kernels: neither the
  validated problem nor a call holds a float32 copy of it (at most 1 MiB beyond out and lse for any mask).

CPU tests run the Triton kernels through the interpreter. GPU tests
(marker ``gpu``) check the same on the compiled Triton kernels and the three CUDA kernels.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnlab
from attnlab.backends.triton import backward as triton_bwd
from attnlab.backends.triton import configs as tconfigs
from attnlab.backends.triton import launch as tlaunch
from attnlab.check import compare
from attnlab.problem import make_problem
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
    ptrs, strides, bwd_constants = triton_bwd._mask_arguments(prob)
    assert ptrs[2].dtype == bias_dtype and ptrs[2].data_ptr() == bias.data_ptr() and bwd_constants["HAS_BIAS"]
    assert strides == [0, 40, 0, 1]


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


# ---- GPU: the compiled Triton kernels and the three CUDA kernels ----------------------------------------
KERNEL_BACKENDS = ("triton", "cuda-naive", "cuda-tiled", "cuda-rowmax")


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
