"""attention_varlen (packed sequences) and a value head dim of its own: the public call's rules.

The values and gradients of every backend are checked by tests/test_contract.py (case lists ``varlen`` and
``head_dim``) and tests/test_triton_bwd.py (``PACKED``); here: what the call accepts and refuses, the routes it
takes, torch.compile, and on a GPU the promises about prefix sums it never reads (no out-of-bounds access,
rows a too small max_seqlen leaves out are 0).
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.reference import reference_varlen

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run pytest -m gpu on a GPU machine)")


def packed(lq, lk, Hq=2, Hkv=2, D=16, Dv=None, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n, h, d: torch.randn(n, h, d, generator=gen).to(device=device, dtype=dtype)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return (draw(sum(lq), Hq, D), draw(sum(lk), Hkv, D), draw(sum(lk), Hkv, Dv or D), cu(lq), cu(lk),
            max(lq), max(lk))


def call(args, **kw):
    return attnlab.attention_varlen(*args, **kw)


BAD = [
    # (description, change to the arguments, keywords, exception, words the message must contain)
    ("cu int64", lambda a: (*a[:3], a[3].long(), *a[4:]), {}, TypeError, ["int32"]),
    ("cu not a tensor", lambda a: (*a[:3], [0, 3, 7], *a[4:]), {}, TypeError, ["int32 tensor"]),
    ("cu 2-D", lambda a: (*a[:3], a[3][None], *a[4:]), {}, ValueError, ["[B + 1]"]),
    ("cu start", lambda a: (*a[:3], a[3] + 1, *a[4:]), {}, ValueError, ["start at 0"]),
    ("cu end", lambda a: (*a[:4], torch.tensor([0, 3, 5], dtype=torch.int32), *a[5:]), {}, ValueError,
     ["end at", "7"]),
    ("cu decreasing", lambda a: (*a[:3], torch.tensor([0, 8, 7, 7], dtype=torch.int32), a[4], *a[5:]), {},
     ValueError, ["never decrease"]),
    ("cu lengths differ", lambda a: (*a[:3], torch.tensor([0, 7], dtype=torch.int32), *a[4:]), {}, ValueError,
     ["B + 1 entries"]),
    ("max too small", lambda a: (*a[:5], 2, a[6]), {}, ValueError, ["max_seqlen_q", "at least", "4"]),
    ("max negative", lambda a: (*a[:6], -1), {}, ValueError, ["max_seqlen_k", ">= 0"]),
    ("max float", lambda a: (*a[:5], 4.0, a[6]), {}, TypeError, ["max_seqlen_q", "int"]),
    ("rank 4", lambda a: (a[0][None], *a[1:]), {}, ValueError, ["rank 3", "[total, H, D]"]),
    ("k/v rows", lambda a: (*a[:2], a[2][:-1], *a[3:]), {}, ValueError, ["same packed keys"]),
    ("causal without align", lambda a: a, {"causal": True}, ValueError, ["align"]),
    ("window without align", lambda a: a, {"window": (2, 2)}, ValueError, ["align"]),
    ("return_lse", lambda a: a, {"return_lse": 1}, TypeError, ["return_lse"]),
]


@pytest.mark.parametrize("what, change, kw, exc, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_error(what, change, kw, exc, words):
    args = change(packed([3, 4], [4, 3]))
    with pytest.raises(exc) as err:
        call(args, **kw)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("backend", ["triton", "reference", "torch", "sdpa", "auto"])
def test_lse_layout_and_empty_sequences(backend):
    """out [total_q, Hq, Dv], lse [Hq, total_q]; a sequence without keys gives 0 and lse -inf on every route."""
    args = packed([3, 0, 5, 2], [4, 6, 0, 1], Hq=4, Hkv=2, D=16, Dv=8)
    out, lse = call(args, causal=True, align="bottom_right", backend=backend, return_lse=True)
    assert out.shape == (10, 4, 8) and lse.shape == (4, 10) and lse.dtype == torch.float32
    assert (out[3:8] == 0).all() and torch.isneginf(lse[:, 3:8]).all()  # sequence 2 has no key
    ref, ref_lse = reference_varlen(*args, causal=True, align="bottom_right")
    assert (out.double() - ref).abs().max() < 1e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


def test_hundreds_of_sequences_each_find_their_tiles():
    """More sequences than one pass of the kernels' prefix-sum count (256 at a time), many of them empty or
    shorter than a tile, and a long one last: the Triton route's values and gradients match the reference."""
    gen = torch.Generator().manual_seed(3)
    lq = [*torch.randint(0, 4, (299,), generator=gen).tolist(), 37]
    lk = [*torch.randint(0, 4, (299,), generator=gen).tolist(), 41]
    q, k, v, cu_q, cu_k, mq, mk = packed(lq, lk, Hq=1, Hkv=1, D=16, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attnlab.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True, align="bottom_right", backend="triton")
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_varlen(q64, k64, v64, cu_q, cu_k, mq, mk, causal=True, align="bottom_right")
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for got, exp in zip(grads, want):
        assert (got.double() - exp).abs().max() < 1e-4


def _unchecked(prob, cu):
    """``prob`` with prefix sums ``cu`` taken as never read back (as GPU ones are): not validated, only clamped."""
    import dataclasses

    return dataclasses.replace(prob, packed=dataclasses.replace(prob.packed, cu_q=cu, cu_k=cu, checked=False))


def _packed_gradients(prob, out, lse, dout):
    from attnlab.backends.triton.backward import gradients

    bhnd = lambda t: t.unsqueeze(0).transpose(1, 2)
    return gradients(prob, bhnd(out), lse, bhnd(dout))[:3]


def test_unchecked_prefix_sums_of_no_sequence_launch_nothing():
    """Prefix sums [0] over tensors that hold rows: no program runs (none reads past the prefix sums), and the
    gradients are zero."""
    from attnlab.problem import make_packed_problem

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 40], dtype=torch.int32)
    prob = _unchecked(make_packed_problem(q, k, v, cu, cu, 40, 40), cu[:1])  # cu[1] lies just past the view
    out, dout = torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    for grad in _packed_gradients(prob, out, torch.randn(1, 2, 40, generator=g), dout):
        assert (grad == 0).all()


def test_unchecked_prefix_sums_out_of_order_never_read_stale_memory(monkeypatch):
    """Decreasing prefix sums leave some tiles to no program: rows the preprocess never visits must not feed the
    dK/dV pass whatever the memory held (stale memory stands in as NaN)."""
    from attnlab.problem import make_packed_problem
    from attnlab.varlen import _forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(100, 1, 16, generator=g) for _ in range(3))
    ok = torch.tensor([0, 50, 50, 100], dtype=torch.int32)
    prob = _unchecked(make_packed_problem(q, k, v, ok, ok, 100, 100), torch.tensor([0, 100, 50, 100],
                                                                                  dtype=torch.int32))
    out, lse = _forward(prob, True, needs_grad=True)
    assert torch.isfinite(out).all()
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, *a, **kw: real(t, *a, **kw).fill_(float("nan")))
    for grad in _packed_gradients(prob, out, lse.unsqueeze(0), torch.randn(out.shape, generator=g)):
        assert torch.isfinite(grad).all()


def test_no_sequence_at_all():
    q, k, v = torch.randn(0, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8)
    cu = torch.zeros(1, dtype=torch.int32)
    for backend in ("triton", "torch"):
        out, lse = attnlab.attention_varlen(q, k, v, cu, cu, 0, 0, backend=backend, return_lse=True)
        assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


def test_routes():
    """The Triton backend runs packed (no padded copy); the others run padded and agree with it."""
    from attnlab import varlen

    assert varlen._packed_route("triton", torch.empty(1))
    assert not varlen._packed_route("auto", torch.empty(1))  # CPU: auto's CPU choice, padded
    assert not varlen._packed_route("sdpa", torch.empty(1))
    args = packed([5, 9], [7, 9], Hq=4, Hkv=1, D=24, Dv=40)
    a = call(args, window=(3, 1), align="top_left", backend="triton")
    b = call(args, window=(3, 1), align="top_left", backend="sdpa")
    assert (a - b).abs().max() < 1e-5


def test_compile_sees_one_op():
    """torch.compile of the packed route traces one attnlab op (its fake implementation gives the shapes)."""
    args = packed([5, 9], [7, 9], Hq=2, Hkv=2, D=16)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = torch.compile(lambda *a: attnlab.attention_varlen(*a, causal=True, align="bottom_right", backend="triton"),
                       backend=backend, fullgraph=True)
    out = fn(*args)
    assert [o for o in ops if "attnlab" in o] == ["attnlab.attention_varlen"], ops
    ref, _ = reference_varlen(*args, causal=True, align="bottom_right")
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.gpu
@gpu
def test_gpu_prefix_sums_are_never_read_back_nor_trusted():
    """Prefix sums on the GPU: a too small max_seqlen leaves rows out as 0 (lse -inf) and ignores keys past it;
    wild values (past the total, decreasing) read nothing out of bounds (compute-sanitizer runs this too)."""
    args = packed([40, 3, 70], [50, 3, 70], Hq=4, Hkv=2, D=64, dtype=torch.bfloat16, device="cuda")
    q, k, v, cu_q, cu_k, _, _ = args
    out, lse = attnlab.attention_varlen(q, k, v, cu_q, cu_k, 48, 60, causal=True, align="bottom_right",
                                        return_lse=True)
    torch.cuda.synchronize()
    assert (out[43 + 48:] == 0).all() and torch.isneginf(lse[:, 43 + 48:]).all()  # rows past max_seqlen_q
    ref, _ = reference_varlen(q[:43], k[:53], v[:53], cu_q[:3].cpu(), cu_k[:3].cpu(), 40, 50, causal=True,
                              align="bottom_right")
    assert (out[:43].double() - ref).abs().max() < 2e-2  # the sequences within the bounds are exact
    wild = torch.tensor([0, 200, 5, 10**6], dtype=torch.int32, device="cuda")
    out = attnlab.attention_varlen(q, k, v, wild, wild, 128, 128)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()


@pytest.mark.gpu
@gpu
def test_gpu_graph_capture():
    """A packed call with prefix sums on the GPU is CUDA-graph safe: captured once, replayed with new data."""
    args = packed([30, 5, 64], [30, 5, 64], Hq=4, Hkv=4, D=64, dtype=torch.float16, device="cuda")
    q, k, v, cu_q, cu_k, mq, mk = args
    attnlab.attention_varlen(*args, causal=True, align="bottom_right")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnlab.attention_varlen(*args, causal=True, align="bottom_right")
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference_varlen(q, k, v, cu_q.cpu(), cu_k.cpu(), mq, mk, causal=True, align="bottom_right")
    assert (out.double() - ref).abs().max() < 5e-3


def test_varlen_bench_harness_checks_before_it_times(monkeypatch):
    """The varlen suite's harness on a CPU, small: lengths as the issue draws them, the truth per document,
    every row checked; a wrong output is a failed row with no time."""
    from attnlab.bench import varlen_suite as bench

    lengths = bench.document_lengths(total=300, lo=4, hi=64, seed=0)
    assert sum(lengths) == 300 and min(lengths[:-1]) >= 4 and max(lengths) <= 64
    monkeypatch.setattr(bench, "document_lengths", lambda: lengths)
    case = bench.VarlenCase("tiny", 4, 2, 16, 8, torch.float32)
    broken = lambda inp: (lambda q, k, v: bench._attnlab(inp)(q, k, v) * 1.01)
    monkeypatch.setitem(bench.COMPETITORS, "broken", broken)
    rows = bench.run_case(case, ["attnlab", "sdpa-efficient", "broken"], torch.device("cpu"), lambda s: None)
    by = {(r["backend"], r["mode"]): r for r in rows}
    assert by[("attnlab", "fwd")]["passed"] and by[("attnlab", "fwd")]["ms"] > 0
    assert by[("attnlab", "bwd")]["passed"] and by[("attnlab", "bwd")]["ms"] > 0
    assert by[("sdpa-efficient", "fwd")]["status"] in ("ok", "error")
    assert not by[("broken", "fwd")]["passed"] and "ms" not in by[("broken", "fwd")]
    assert by[("attnlab", "fwd")]["allowed_pairs"] == sum(n * (n + 1) // 2 for n in lengths) * 4


def test_rows_left_out_take_no_part_in_the_sinks_gradient():
    """Prefix sums never read back (as on a GPU) with a max_seqlen_q shorter than a sequence: the rows it leaves
    out are 0 with lse -inf, and the sinks' gradient sums over the rows computed only (as if the sequences had
    been cut there)."""
    import dataclasses

    from attnlab.backends.triton.backward import gradients
    from attnlab.problem import make_packed_problem
    from attnlab.varlen import _forward

    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(20, 4, 16, generator=g), torch.randn(20, 2, 16, generator=g), torch.randn(20, 2, 16,
                                                                                                      generator=g)
    sinks = torch.randn(4, generator=g)
    cu = torch.tensor([0, 10, 20], dtype=torch.int32)
    prob = make_packed_problem(q, k, v, cu, cu, 10, 10, sinks=sinks)
    prob = dataclasses.replace(prob, packed=dataclasses.replace(prob.packed, max_q=6, checked=False))
    out, lse = _forward(prob, True, needs_grad=True)
    assert (out[6:10] == 0).all() and torch.isneginf(lse[:, 6:10]).all()
    dout = torch.randn(out.shape, generator=g)
    bhnd = lambda t: t.unsqueeze(0).transpose(1, 2)
    *_, dsinks = gradients(prob, bhnd(out), lse.unsqueeze(0), bhnd(dout))
    keep = torch.cat([torch.arange(0, 6), torch.arange(10, 16)])  # the rows computed
    cut = torch.tensor([0, 6, 12], dtype=torch.int32)
    s64 = sinks.double().requires_grad_()
    ref, _ = reference_varlen(q[keep].double(), k.double(), v.double(), cut, cu, 6, 10, sinks=s64)
    (ref * dout[keep].double()).sum().backward()
    assert torch.isfinite(dsinks).all() and (dsinks.double() - s64.grad).abs().max() < 1e-5


@pytest.mark.gpu
@gpu
def test_gpu_repeated_calls_keep_their_value_head_dim():
    """Calls seen before take the cached fast path only where it allocates the output's true shape: a value
    head dim of its own (Dv 32 < D 64, and Dv 96 > D 64) gives the right shape and values on every repeat."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for dv in (32, 96):
        q, k = (torch.randn(2, 4, 100, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(2, 4, 100, dv, generator=g, device="cuda", dtype=torch.bfloat16)
        ref, _ = attnlab.reference(q, k, v, causal=True)
        for _ in range(3):
            out = attnlab.attention(q, k, v, causal=True)
            assert out.shape == (2, 4, 100, dv) and (out.double() - ref).abs().max() < 3e-2
