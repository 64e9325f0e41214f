"""The public call on a GPU: no device sync, CUDA-graph capture, torch.compile, clamped GPU lengths."""

from __future__ import annotations

import contextlib

import pytest
import torch

import attnlab
from attnlab.problem import make_problem
from attnlab.reference import masked_scores, softmax_rows

pytestmark = pytest.mark.gpu

KERNELS = ["triton", "cuda-naive", "cuda-tiled", "cuda-rowmax"]


def _inputs(dtype=torch.bfloat16, B=2, Hq=4, Hkv=2, N=200, D=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _available(name):
    a = attnlab.backends().get(name)
    if a is None or not a.available:
        pytest.skip(f"{name}: {a!r}")


@contextlib.contextmanager
def _sync_is_an_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("backend", KERNELS)
def test_a_call_with_gpu_lengths_never_synchronizes(backend):
    _available(backend)
    q, k, v = _inputs()
    lens = torch.tensor([200, 77], device="cuda", dtype=torch.int32)
    kw = dict(causal=True, kv_len=lens, q_len=lens, align="bottom_right", backend=backend, return_lse=True)
    attnlab.attention(q, k, v, **kw)  # first call: compile, autotune (those may synchronize)
    torch.cuda.synchronize()
    with _sync_is_an_error():
        out, lse = attnlab.attention(q, k, v, **kw)
    ref, ref_lse = attnlab.reference(q, k, v, **{n: x for n, x in kw.items() if n not in ("backend", "return_lse")})
    assert attnlab.check.compare(out, ref).passed
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=1e-3)  # -inf rows compare equal


@pytest.mark.parametrize("backend", KERNELS)
def test_gpu_lengths_out_of_range_are_clamped(backend):
    _available(backend)
    q, k, v = _inputs(dtype=torch.float32)
    wild = torch.tensor([-5, 10**6], device="cuda")
    got = attnlab.attention(q, k, v, kv_len=wild, backend=backend)
    want = attnlab.attention(q, k, v, kv_len=[0, 200], backend=backend)
    assert torch.equal(got, want)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graph_capture_and_replay(backend):
    _available(backend)
    q, k, v = _inputs()
    lens = torch.tensor([150, 200], device="cuda", dtype=torch.int32)
    kw = dict(causal=True, kv_len=lens, backend=backend)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            attnlab.attention(q, k, v, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnlab.attention(q, k, v, **kw)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([33, 180], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, attnlab.attention(q, k, v, **kw), atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "cuda-rowmax", "sdpa"])
def test_compile_fullgraph_on_gpu(backend):
    _available(backend)
    q, k, v = _inputs()
    lens = torch.tensor([200, 90], device="cuda")

    def f(q, k, v):
        return attnlab.attention(q, k, v, causal=True, kv_len=lens, backend=backend)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), atol=0, rtol=0)


def test_auto_with_grad_picks_a_backend_that_differentiates():
    q, k, v = (t.requires_grad_() for t in _inputs())
    out = attnlab.attention(q, k, v, causal=True)
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", [*KERNELS, "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_through_the_public_call(backend, dtype):
    _available(backend)
    q, k, v = _inputs(dtype=dtype, N=150)
    lens = torch.tensor([150, 61], device="cuda")
    kw = dict(causal=True, kv_len=lens, q_len=lens, align="bottom_right")
    dout = torch.randn(q.shape, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attnlab.attention(*leaves, backend=backend, **kw).backward(dout)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    attnlab.reference(*ref, **kw)[0].backward(dout.double())
    base = [t.clone().requires_grad_() for t in (q, k, v)]  # autograd of the textbook in the same dtype
    prob = make_problem(*base, **kw)
    softmax_rows(masked_scores(prob, 0, prob.Nq, dtype), prob.v, prob.group)[0].backward(dout)
    for name, a, r, b in zip("qkv", leaves, ref, base):
        assert torch.isfinite(a.grad).all(), f"d{name}"
        err = (a.grad.double() - r.grad).abs().max().item()
        base_err = (b.grad.double() - r.grad).abs().max().item()
        floor = 1e-5 if dtype == torch.float32 else 1e-2 * r.grad.abs().max().item()
        assert err <= 2 * base_err + floor, f"d{name}: {err:.3g} vs textbook {base_err:.3g}"


def test_maskspec_takes_cuda_without_an_index():
    """'cuda' is the current GPU: GPU lengths and masks built for device='cuda' are accepted as they are."""
    from attnlab.masks import MaskSpec

    lens = torch.tensor([5, 7], device="cuda")
    mask = torch.ones(1, 1, 7, 9, device="cuda")
    spec = MaskSpec.build(2, 3, 7, 9, device="cuda", kv_len=lens, q_len=torch.tensor([7, 1]), mask=mask)
    assert spec.kv_len.is_cuda and spec.q_len.is_cuda and spec.device == lens.device
