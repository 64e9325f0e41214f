"""Gradients through attnlab.attention and the one-op contract (torch.compile sees a single node)."""

from __future__ import annotations

import pytest
import torch

import attnlab
import attnlab.problem
from attnlab.backends import registry

# Every differentiable backend that can run CPU tensors here (the kernel backends' GPU side: test_public_call_gpu).
GRAD_BACKENDS = [n for n, b in registry().items() if b.differentiable and b.availability().available
                 and b.unsupported(attnlab.problem.make_problem(*(torch.zeros(1, 1, 1, 8),) * 3)) is None]

CASES = {
    "causal_br_kvlen": dict(Hq=4, Hkv=2, Nq=9, Nk=13, kw=dict(causal=True, align="bottom_right", kv_len=[13, 4])),
    "window_qlen_mqa": dict(Hq=3, Hkv=1, Nq=11, Nk=11, kw=dict(window=(3, 1), q_len=[11, 6])),
    "bool_mask_empty_rows": dict(Hq=2, Hkv=2, Nq=7, Nk=10, kw=dict(mask="bool")),
    "bias": dict(Hq=2, Hkv=1, Nq=8, Nk=6, kw=dict(mask="bias")),
    "dense_bnhd": dict(Hq=2, Hkv=2, Nq=5, Nk=12, kw=dict(layout="bnhd")),
}


def _inputs(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, D = 2, 8
    c = CASES[case]
    kw = dict(c["kw"])
    bnhd = kw.get("layout") == "bnhd"
    qs = (B, c["Nq"], c["Hq"], D) if bnhd else (B, c["Hq"], c["Nq"], D)
    ks = (B, c["Nk"], c["Hkv"], D) if bnhd else (B, c["Hkv"], c["Nk"], D)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in (qs, ks, ks))
    if kw.get("mask") == "bool":
        m = torch.rand(B, c["Hq"], c["Nq"], c["Nk"], generator=g) > 0.4
        m[0, 1, 2] = False  # a row with no allowed key: zero gradient, not NaN
        kw["mask"] = m
    elif kw.get("mask") == "bias":
        kw["mask"] = torch.randn(1, c["Hq"], c["Nq"], c["Nk"], generator=g, dtype=torch.float64)
    return q, k, v, kw


def _grads(fn, tensors, weights):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = fn(*leaves)
    w_out, w_lse = weights
    loss = (out * w_out).sum() + torch.where(torch.isinf(lse), 0.0, lse * w_lse).sum()
    loss.backward()
    return [t.grad for t in leaves], out


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_float64_autograd_of_the_reference(backend, case):
    q, k, v, kw = _inputs(case)
    bias = kw.pop("mask", None)
    is_bias = bias is not None and bias.dtype.is_floating_point
    tensors = [q, k, v] + ([bias] if is_bias else [])
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(q.shape, generator=g, dtype=torch.float64)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if kw.get("layout") == "bnhd" else q.shape[:3]
    w_lse = torch.randn(lse_shape, generator=g, dtype=torch.float64)  # lse is [B, Hq, Nq] in either layout

    def ours(*t):
        m = t[3] if is_bias else bias
        return attnlab.attention(*(x.float() for x in t[:3]), mask=None if m is None else m.float() if is_bias else m,
                                 backend=backend, return_lse=True, **kw)

    def ref(*t):
        return attnlab.reference(*t[:3], mask=t[3] if is_bias else bias, **kw)

    mine, out = _grads(ours, tensors, (w_out.float(), w_lse.float()))
    want, _ = _grads(ref, tensors, (w_out, w_lse))
    assert out.grad_fn is not None
    for name, a, b in zip("qkvb", mine, want):
        assert a is not None, f"d{name} missing"
        assert torch.isfinite(a).all(), f"d{name} has NaN/Inf"
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_rows_with_no_allowed_key_get_zero_gradients():
    q, k, v, _ = _inputs("dense_bnhd")
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    out = attnlab.attention(q, k, v, kv_len=[0, 12], layout="bnhd", backend="torch")
    out.sum().backward()
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))
    assert torch.equal(k.grad[0], torch.zeros_like(k.grad[0])) and torch.isfinite(k.grad).all()


def _count_nodes(gm, _inputs):
    _count_nodes.calls.append(
        [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "attnlab" in str(n.target)]
    )
    return gm.forward


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_compile_fullgraph_sees_one_op(backend):
    q, k, v, _ = _inputs("causal_br_kvlen")
    q, k, v = (t.float() for t in (q, k, v))
    lens = torch.tensor([13, 4])

    def f(q, k, v):
        return attnlab.attention(q, k, v, causal=True, align="bottom_right", kv_len=lens, backend=backend)

    _count_nodes.calls = []
    torch._dynamo.reset()
    got = torch.compile(f, backend=_count_nodes, fullgraph=True)(q, k, v)
    assert len(_count_nodes.calls) == 1, "one graph: no graph break"
    assert _count_nodes.calls[0] == ["attnlab.attention"], _count_nodes.calls
    torch.testing.assert_close(got, f(q, k, v), atol=0, rtol=0)


def test_compiled_backward_matches_eager():
    q, k, v, _ = _inputs("window_qlen_mqa")
    q, k, v = (t.float() for t in (q, k, v))

    def f(q, k, v):
        return attnlab.attention(q, k, v, window=(3, 1), q_len=torch.tensor([11, 6]), backend="sdpa")

    torch._dynamo.reset()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*eager).square().sum().backward()
    comp = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(f, fullgraph=True, backend="aot_eager")(*comp).square().sum().backward()
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a.grad, b.grad)


def test_eager_double_backward_is_an_error_not_a_silent_zero():
    """The eager path (an autograd.Function) refuses a second backward, as the op does (no formula)."""
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    out = attnlab.attention(q, q, q, backend="torch")
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_fake_tensors_that_need_grad_go_through_the_op():
    """Fake tensors (shape propagation, memory estimators) reach the op's fake implementation, not a kernel."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        q = torch.randn(1, 2, 8, 8, requires_grad=True)
        out, lse = attnlab.attention(q, q, q, causal=True, backend="triton", return_lse=True)
    assert isinstance(out, FakeTensor) and out.shape == q.shape and lse.shape == (1, 2, 8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_eager_training_step_validates_once(backend, monkeypatch):
    """An eager call that needs a gradient validates its problem once: the forward and the backward take the
    Problem the call made (on a slow host each validation is tens of us of a host-bound step); the gradients are
    those of a step that validated three times."""
    from attnlab import api

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 21, 4, 16, generator=g) for _ in range(3))  # [B, N, H, D]
    sinks = torch.randn(4, generator=g)
    kw = dict(window=(5, 0), align="bottom_right", kv_len=[21, 9], sinks=sinks, backend=backend, layout="bnhd")

    def step():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attnlab.attention(*leaves, **kw)
        out.backward(torch.ones_like(out))
        return [x.grad for x in leaves]

    made = []
    real = api.make_problem
    monkeypatch.setattr(api, "make_problem", lambda *a, **k: made.append(1) or real(*a, **k))
    once = step()
    assert len(made) == 1
    monkeypatch.setattr(api, "_given_problem", lambda *a: None)  # no hand-off: every stage validates again
    monkeypatch.setattr(api._handoff, "backward", None, raising=False)
    thrice = step()
    assert len(made) == 4
    for a, b in zip(once, thrice):
        assert torch.equal(a, b)
