"""Score modifiers (softcap, ALiBi slopes, sinks): what the call accepts, the sink's rules, and the gradients of
q, k, v and the sinks against float64 autograd of the reference.

Values of every backend over the ``score_mods`` case list: tests/test_contract.py.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.backends import resolve
from attnlab.check import UNIT_ROUNDOFF
from attnlab.problem import make_problem

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def qkv(B=2, Hq=4, Hkv=2, Nq=9, Nk=11, D=16, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Nq, D, generator=g).to(dtype), torch.randn(B, Hkv, Nk, D, generator=g).to(dtype),
            torch.randn(B, Hkv, Nk, D, generator=g).to(dtype))


BAD = [
    ("softcap 0", {"softcap": 0.0}, ValueError, ["softcap", "> 0"]),
    ("softcap inf", {"softcap": float("inf")}, ValueError, ["finite"]),
    ("softcap bool", {"softcap": True}, TypeError, ["softcap"]),
    ("slopes float64", {"alibi_slopes": torch.ones(4, dtype=torch.float64)}, TypeError, ["float32"]),
    ("slopes shape", {"alibi_slopes": torch.ones(3)}, ValueError, ["[Hq] = [4]", "[B, Hq] = [2, 4]"]),
    ("slopes grad", {"alibi_slopes": torch.ones(4, requires_grad=True)}, ValueError, ["require grad"]),
    ("slopes list", {"alibi_slopes": [0.5] * 4}, TypeError, ["torch.Tensor"]),
    ("sinks shape", {"sinks": torch.zeros(2, 4)}, ValueError, ["sinks", "[Hq] = [4]"]),
    ("sinks int", {"sinks": torch.zeros(4, dtype=torch.int32)}, TypeError, ["floating"]),
]


@pytest.mark.parametrize("what, kw, exc, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_error(what, kw, exc, words):
    with pytest.raises(exc) as err:
        attnlab.attention(*qkv(), **kw)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_row_with_no_key_gives_zero_and_its_sink():
    """kv_len 0 for one batch entry, q_len shorter for the other: out 0 and lse = the head's sink there."""
    q, k, v = qkv()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for backend in ("triton", "reference", "torch"):
        out, lse = attnlab.attention(q, k, v, kv_len=[0, 11], q_len=[9, 4], sinks=sinks, backend=backend,
                                     return_lse=True)
        assert (out[0] == 0).all() and (out[1, :, 4:] == 0).all()
        assert torch.allclose(lse[0], sinks.view(4, 1).expand(4, 9)), backend
        assert torch.allclose(lse[1, :, 4:], sinks.view(4, 1).expand(4, 5)), backend
    out, lse = attnlab.attention(q[:, :, :0], k, v, sinks=sinks, return_lse=True)
    assert out.shape[2] == 0 and lse.shape == (2, 4, 0)


def test_a_sink_only_rescales_the_output():
    """With a sink the output is the sink-free output times exp(lse - lse_with_sink), and lse grows by the sink."""
    q, k, v = qkv(dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    o0, l0 = attnlab.reference(q, k, v, causal=True, align="bottom_right")
    o1, l1 = attnlab.reference(q, k, v, causal=True, align="bottom_right", sinks=sinks)
    assert torch.allclose(l1, torch.logaddexp(l0, sinks.view(1, 4, 1)))
    assert torch.allclose(o1, o0 * torch.exp(l0 - l1).unsqueeze(-1))


def test_modifiers_route_to_backends_that_take_them():
    q, k, v = qkv()
    prob = make_problem(q, k, v, softcap=5.0)
    assert resolve("auto", prob).name in ("reference", "torch")  # CPU: sdpa refuses the modifiers
    with pytest.raises(ValueError, match=r"soft cap"):
        resolve("sdpa", make_problem(q[:, :, :1], k, v, sinks=torch.zeros(4)))
    assert resolve("triton-decode", make_problem(q[:, :, :1], k, v, sinks=torch.zeros(4))).name == "triton-decode"


def _grads(fn, inputs, dout, dlse):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = fn(*leaves)
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:  # (without: lse gets no gradient, and the sinks' comes from the preprocess kernel's shares)
        loss = loss + (torch.nan_to_num(lse, neginf=0.0) * dlse.to(lse.dtype)).sum()
    loss.backward()
    return [x.grad for x in leaves]


CASES = [
    (dict(softcap=2.0, causal=True, align="top_left"), F32),
    (dict(softcap=1.5, window=(4, 1), align="bottom_right"), BF16),
    (dict(alibi="h", causal=True, align="bottom_right", kv_len=[11, 6]), F32),
    (dict(alibi="bh", q_len=[9, 3]), F16),
    (dict(sinks=True, window=(3, 0), align="top_left", kv_len=[11, 0]), F32),
    (dict(sinks=True, softcap=3.0, alibi="h", causal=True, align="bottom_right"), BF16),
]


@pytest.mark.parametrize("lse_grad", [True, False], ids=["dlse", "no-dlse"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kw, dtype", CASES, ids=[f"{'-'.join(c)}-{str(d)[6:]}" for c, d in CASES])
def test_gradients_match_float64_autograd(kw, dtype, backend, lse_grad):
    """dq, dk, dv and d sinks (with or without an upstream gradient on lse) against float64 autograd of the reference:
    float32 within 2e-5 relative to the largest gradient, half types within twice the textbook's error in that
    dtype plus a floor. The triton backend's gradients come from its kernels (through the interpreter)."""
    kw = dict(kw)
    g = torch.Generator().manual_seed(7)
    q, k, v = qkv(dtype=dtype)
    extra = []
    if kw.pop("sinks", False):
        extra.append(2 * torch.randn(4, generator=g))
    alibi = kw.pop("alibi", None)
    if alibi is not None:
        kw["alibi_slopes"] = torch.rand((4,) if alibi == "h" else (2, 4), generator=g) + 0.1
    dout, dlse = torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 4, 9, generator=g)
    dlse = dlse if lse_grad else None

    def call(be, dt):
        def fn(q, k, v, *sinks):
            s = {"sinks": sinks[0]} if sinks else {}
            if be == "reference64":
                return attnlab.reference(q, k, v, **kw, **s)
            return attnlab.attention(q, k, v, backend=be, return_lse=True, **kw, **s)
        return _grads(fn, [x.to(dt) for x in (q, k, v, *[e.to(dt) for e in extra])], dout, dlse)

    ref = call("reference64", torch.float64)
    ours = call(backend, dtype)
    base = call("torch", dtype) if dtype != F32 else None
    for i, (a, r) in enumerate(zip(ours, ref)):
        assert a is not None and not torch.isnan(a).any()
        err = (a.double() - r).abs().max().item()
        scale = max(1.0, r.abs().max().item())
        if dtype == F32:
            assert err <= 2e-5 * scale, (i, err)
        else:
            b_err = (base[i].double() - r).abs().max().item()
            assert err <= 2 * b_err + UNIT_ROUNDOFF[dtype] * scale, (i, err, b_err)


@pytest.mark.parametrize("kw", [{"kv_len": [53, 44]}, {"causal": True, "align": "bottom_right", "kv_len": [53, 30]},
                                {"window": (20, 7), "align": "top_left", "q_len": [45, 17]}],
                         ids=["full_kv_len", "causal_br_kv_len", "window_q_len"])
def test_alibi_gradients_over_many_tiles(kw):
    """ALiBi's gradients where the kernels' tiles lie on both sides of the diagonal and across it, with lengths
    that put tile corners on it: float32 within 2e-5 relative to the largest gradient."""
    g = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(2, 3, 45, 16, generator=g), torch.randn(2, 3, 53, 16, generator=g), torch.randn(
        2, 3, 53, 16, generator=g)
    slopes = torch.rand(3, generator=g) + 0.05
    dout, dlse = torch.randn(2, 3, 45, 16, generator=g), torch.randn(2, 3, 45, generator=g)

    def fn(be):
        return lambda q, k, v: (attnlab.reference(q, k, v, alibi_slopes=slopes, **kw) if be == "reference64" else
                                attnlab.attention(q, k, v, backend=be, return_lse=True, alibi_slopes=slopes, **kw))

    ref = _grads(fn("reference64"), [x.double() for x in (q, k, v)], dout, dlse)
    ours = _grads(fn("triton"), [q, k, v], dout, dlse)
    for i, (a, r) in enumerate(zip(ours, ref)):
        assert (a.double() - r).abs().max().item() <= 2e-5 * max(1.0, r.abs().max().item()), i


def test_compile_sees_one_op_and_differentiates_sinks():
    q, k, v = qkv()
    sinks = torch.zeros(4, requires_grad=True)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = torch.compile(lambda q, k, v, s: attnlab.attention(q, k, v, causal=True, align="bottom_right", sinks=s,
                                                             softcap=4.0, backend="triton"),
                       backend=backend, fullgraph=True)
    out = fn(q, k, v, sinks)
    out.sum().backward()
    assert [o for o in ops if "attnlab" in o] == ["attnlab.attention"], ops
    assert sinks.grad is not None and sinks.grad.shape == (4,) and (sinks.grad != 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [
    {"softcap": 7.0, "causal": True},
    {"alibi_slopes": "h", "window": (5, 3)},
    {"sinks": True, "kv_len": "gpu"},
    {"softcap": 3.0, "alibi_slopes": "bh", "sinks": True, "causal": True, "align": "bottom_right"},
], ids=["softcap", "alibi_window", "sinks_kvlen", "all"])
def test_repeated_gpu_calls_with_modifiers_launch_the_plan_and_agree(kw, monkeypatch):
    """The portable forward's plan (the JIT once, then the compiled kernel's launcher with the call's own slopes
    and sinks) against the float64 reference, call after call with new inputs of one signature. The Hopper
    kernel is off here (on sm_90 it takes the soft cap and ALiBi); test_hopper.py repeats its calls."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from attnlab.backends.triton import forward as fwd
    from attnlab.backends.triton import hopper_forward as hopper

    monkeypatch.setattr(hopper, "_mode", "0")

    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, Nq, Nk, D = 3, 4, 2, 70, 90, 64
    fwd.forget_plans()
    for _ in range(3):
        seed = int(torch.randint(0, 999, (), generator=g))
        q, k, v = (t.cuda() for t in qkv(B, Hq, Hkv, Nq, Nk, D, BF16, seed=seed))
        call = dict(kw)
        if call.get("alibi_slopes") is not None:
            shape = (Hq,) if call["alibi_slopes"] == "h" else (B, Hq)
            call["alibi_slopes"] = (torch.rand(shape, generator=g) + 0.1).cuda()
        if call.get("sinks"):
            call["sinks"] = torch.randn(Hq, generator=g).cuda()
        if call.get("kv_len") == "gpu":
            call["kv_len"] = torch.randint(0, Nk + 1, (B,), generator=g).cuda()
        if "causal" in call or "window" in call:
            call.setdefault("align", "top_left")
        got = attnlab.attention(q, k, v, backend="triton", **call)
        ref, _ = attnlab.reference(q, k, v, **call)
        assert torch.isfinite(got).all()
        assert (got.double() - ref).abs().max().item() < 2e-2
    (plan,) = fwd._PLANS.values()  # one signature, one plan: its later calls used the compiled kernel directly
    assert plan.kernels
