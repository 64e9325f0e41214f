"""The public call on a GPU: no device sync, CUDA-graph capture, torch.compile, clamped GPU lengths."""

from __future__ import annotations

import contextlib

import pytest
import torch

import attnlab
from attnlab.problem import make_problem
from attnlab.reference import masked_scores, softmax_rows

pytestmark = pytest.mark.gpu

KERNELS = ["triton", "cuda-naive", "cuda-tiled", "cuda-rowmax", "cuda-mma"]


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
    q, k, v = _inputs(dtype=torch.bfloat16 if backend == "cuda-mma" else torch.float32)  # mma: 16-bit only
    wild = torch.tensor([-5, 10**6], device="cuda")
    got = attnlab.attention(q, k, v, kv_len=wild, backend=backend)
    want = attnlab.attention(q, k, v, kv_len=[0, 200], backend=backend)
    assert torch.equal(got, want)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def _captured(call):
    """``call`` warmed up twice on a side stream, then captured in a CUDA graph: (graph, its output)."""
    from attnlab.bench.replay import capture

    return capture(call)


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graph_capture_and_replay(backend):
    _available(backend)
    q, k, v = _inputs()
    lens = torch.tensor([150, 200], device="cuda", dtype=torch.int32)
    kw = dict(causal=True, kv_len=lens, backend=backend)
    graph, out = _captured(lambda: attnlab.attention(q, k, v, **kw))
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
    if backend == "cuda-mma" and dtype == torch.float32:
        pytest.skip("cuda-mma takes 16-bit inputs only (its refusal: test_cuda.py)")
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


def _fresh(q, k, v, seed):
    """New tensors of q, k and v's signature (shapes, strides, dtypes) holding other values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(t.clone().copy_(torch.randn(t.shape, device="cuda", generator=g).to(t.dtype)) for t in (q, k, v))


FAST_CASES = {
    "dense": {},
    "causal_lse": dict(causal=True, return_lse=True),
    "bnhd_gqa_window": dict(layout="bnhd", window=(37, 5)),
    "kv_len_gpu_int64_wild": dict(kv_len="gpu64"),
    "kv_len_int_causal_br": dict(kv_len=120, causal=True, align="bottom_right"),
    "q_len_kv_len_gpu": dict(q_len="gpu32", kv_len="gpu32", causal=True, align="bottom_right"),
    "bool_mask_broadcast": dict(mask="bool"),
    "bf16_bias": dict(mask="bias", return_lse=True),
    "softcap_alibi_heads": dict(softcap=20.0, alibi_slopes="h", causal=True),
    "alibi_batch_sinks_f32_lse": dict(alibi_slopes="bh", sinks="f32", return_lse=True),
    "sinks_bf16_window": dict(sinks="bf16", window=(40, 0)),
}


def _mod_tensors(kw: dict, B: int, Hq: int, g: torch.Generator) -> dict:
    """Fresh ALiBi slopes ("h": [Hq], "bh": [B, Hq], float32) and sinks ("f32" or "bf16": [Hq]) for a case
    that names them."""
    out = dict(kw)
    if isinstance(out.get("alibi_slopes"), str):
        shape = (Hq,) if out["alibi_slopes"] == "h" else (B, Hq)
        out["alibi_slopes"] = torch.rand(shape, device="cuda", generator=g) * 0.1
    if isinstance(out.get("sinks"), str):
        dtype = torch.float32 if out["sinks"] == "f32" else torch.bfloat16
        out["sinks"] = torch.randn(Hq, device="cuda", generator=g).to(dtype)
    return out


@contextlib.contextmanager
def _whole_way_is_an_error(monkeypatch):
    """Inside, a call that would validate and plan again (``api._run``) fails: the fast call must serve it."""
    import attnlab.api

    def whole_way(*args, **kwargs):
        raise AssertionError("the call took the whole way, not its fast call")

    with monkeypatch.context() as m:
        m.setattr(attnlab.api, "_run", whole_way)
        yield


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("case", list(FAST_CASES))
def test_repeated_calls_take_the_fast_path_and_agree(case, backend, monkeypatch):
    """The second call of a signature runs the cached fast call (attnlab.fast_calls); it must give what the whole
    way gives, on new values: new q, k, v and new GPU lengths (out-of-range ones too, clamped)."""
    from attnlab import fast_calls as calls

    _available("triton")
    kw = dict(FAST_CASES[case])
    q, k, v = _inputs(N=200)
    if kw.get("layout") == "bnhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    g = torch.Generator(device="cuda").manual_seed(7)

    def lengths(kind):
        if kind == "gpu64":
            return torch.randint(-20, 260, (2,), device="cuda", generator=g)  # int64, some out of range
        return torch.randint(1, 201, (2,), device="cuda", generator=g, dtype=torch.int32)

    def masks(kind):
        if kind == "bool":
            return torch.rand(1, 4, 200, 200, device="cuda", generator=g) > 0.3
        return torch.randn(1, 4, 200, 200, device="cuda", generator=g).to(torch.bfloat16)

    def call_kw():
        out = dict(kw, backend=backend)
        for name in ("kv_len", "q_len"):
            if isinstance(out.get(name), str):
                out[name] = lengths(out[name])
        if isinstance(out.get("mask"), str):
            out["mask"] = masks(out["mask"])
        return _mod_tensors(out, 2, 4, g)

    calls.clear()
    attnlab.attention(q, k, v, **call_kw())  # the whole way: validates, plans, remembers the signature
    assert len(calls._CALLS) == 1, "a GPU Triton call should leave a fast call behind"
    for seed in (1, 2):
        q2, k2, v2 = _fresh(q, k, v, seed)
        kw2 = call_kw()
        with _sync_is_an_error(), _whole_way_is_an_error(monkeypatch):
            got = attnlab.attention(q2, k2, v2, **kw2)
        calls.clear()  # the same call the whole way, for comparison
        want = attnlab.attention(q2, k2, v2, **kw2)
        assert len(calls._CALLS) == 1
        if kw.get("return_lse"):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            got = got[0]
        else:
            assert torch.equal(got, want)
        ref = attnlab.reference(q2, k2, v2, **{n: x for n, x in kw2.items() if n not in ("backend", "return_lse")})
        ref = ref[0] if isinstance(ref, tuple) else ref
        assert attnlab.check.compare(got, ref).passed


def test_a_new_signature_never_reuses_a_fast_call():
    """Strides, dtype, a mask's presence or a length's kind change the signature: each takes the whole way."""
    from attnlab import fast_calls as calls

    _available("triton")
    calls.clear()
    q, k, v = _inputs(N=128)
    attnlab.attention(q, k, v, backend="triton")
    variants = [
        (q.transpose(2, 3).contiguous().transpose(2, 3), k, v, {}),  # same shape, other strides
        (q[:, :, :100], k, v, {}),  # a view of fewer rows
        (q, k, v, dict(causal=True)),
        (q, k, v, dict(kv_len=torch.tensor([5, 128], device="cuda"))),
        (q.float(), k.float(), v.float(), {}),
    ]
    for qq, kk, vv, kw in variants:
        got = attnlab.attention(qq, kk, vv, backend="triton", **kw)
        ref, _ = attnlab.reference(qq, kk, vv, **kw)
        assert attnlab.check.compare(got, ref).passed, kw
    assert len(calls._CALLS) == 1 + len(variants)


@pytest.mark.parametrize("kw", [
    {}, dict(kv_len="gpu", causal=True, align="bottom_right", return_lse=True), dict(layout="bnhd"),
    dict(mask="bias", kv_len=333), dict(kv_len="gpu", window=(64, 0), align="bottom_right"),
    dict(softcap=30.0, sinks="bf16"),
    dict(alibi_slopes="bh", sinks="f32", kv_len="gpu", causal=True, align="bottom_right", return_lse=True),
    dict(alibi_slopes="h", layout="bnhd"),
], ids=["dense", "kv_len_causal_br_lse", "bnhd", "bias_int_len", "window_br", "softcap_sinks_bf16",
        "alibi_batch_sinks_f32_kv_len_lse", "alibi_heads_bnhd"])
@pytest.mark.parametrize("backend", ["triton-decode", "auto"])
def test_repeated_decode_calls_take_the_fast_path_and_agree(kw, backend, monkeypatch):
    """The split-KV decode path's fast call (split and merge launched directly) against the whole way."""
    from attnlab import fast_calls as calls

    _available("triton-decode")
    g = torch.Generator(device="cuda").manual_seed(3)
    B, Hq, Hkv, Nq, Nk, D = 3, 8, 2, 3, 1000, 128

    def inputs():
        shapes = [(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)]
        ts = [torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes]
        return [t.transpose(1, 2).contiguous() for t in ts] if kw.get("layout") == "bnhd" else ts

    def call_kw():
        out = dict(kw, backend=backend)
        if out.get("kv_len") == "gpu":
            out["kv_len"] = torch.randint(0, Nk + 50, (B,), device="cuda", generator=g)
        if out.get("mask") == "bias":
            out["mask"] = torch.randn(1, Hq, Nq, Nk, device="cuda", generator=g).to(torch.bfloat16)
        return _mod_tensors(out, B, Hq, g)

    calls.clear()
    attnlab.attention(*inputs(), **call_kw())
    assert len(calls._CALLS) == 1
    for _ in range(2):
        args, kw2 = inputs(), call_kw()
        with _sync_is_an_error(), _whole_way_is_an_error(monkeypatch):
            got = attnlab.attention(*args, **kw2)
        calls.clear()
        want = attnlab.attention(*args, **kw2)
        got, want = (got, want) if kw.get("return_lse") else ((got,), (want,))
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        ref = attnlab.reference(*args, **{n: x for n, x in kw2.items() if n not in ("backend", "return_lse")})
        assert attnlab.check.compare(got[0], ref[0]).passed


@pytest.mark.parametrize("backend", ["triton", "triton-decode"])
def test_a_models_sinks_parameter_takes_the_fast_path_under_no_grad(backend, monkeypatch):
    """gpt-oss keeps its sinks as a bf16 ``nn.Parameter``: at inference (no_grad) its repeated calls run the fast
    call, and give what the whole way gives."""
    from attnlab import fast_calls as calls

    _available(backend)
    Nq = 1 if backend == "triton-decode" else 200
    g = torch.Generator(device="cuda").manual_seed(11)
    sinks = torch.nn.Parameter(torch.randn(4, device="cuda", generator=g).bfloat16())

    def inputs(seed):
        q, k, v = _inputs(N=200, seed=seed)
        return q[:, :, :Nq].contiguous(), k, v

    kw = dict(sinks=sinks, causal=True, align="bottom_right", backend=backend)
    calls.clear()
    with torch.no_grad():
        attnlab.attention(*inputs(0), **kw)
        assert len(calls._CALLS) == 1, "a call with parameter sinks should leave a fast call behind"
        args = inputs(1)
        with _sync_is_an_error(), _whole_way_is_an_error(monkeypatch):
            got = attnlab.attention(*args, **kw)
        calls.clear()
        want = attnlab.attention(*args, **kw)
    assert torch.equal(got, want)
    ref, _ = attnlab.reference(*args, sinks=sinks.detach(), causal=True, align="bottom_right")
    assert attnlab.check.compare(got, ref).passed


def _decode_inputs(B=2, Hq=8, Hkv=2, Nk=4096, D=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def test_decode_split_merge_never_synchronizes_and_replays_in_a_graph():
    """The split-KV decode with several splits and their merge: no device sync, CUDA-graph capture and
    replay on new inputs and lengths."""
    _available("triton")
    q, k, v = _decode_inputs()
    lens = torch.tensor([4096, 1000], device="cuda", dtype=torch.int32)
    kw = dict(kv_len=lens, backend="triton-decode")
    attnlab.attention(q, k, v, **kw)
    torch.cuda.synchronize()
    with _sync_is_an_error():
        out = attnlab.attention(q, k, v, **kw)
    assert attnlab.check.compare(out, attnlab.reference(q, k, v, kv_len=lens)[0]).passed
    from attnlab.backends.triton import decode as td

    assert td.gpu_plan(make_problem(q, k, v, kv_len=lens)).n_split > 1  # the merge runs
    graph, out = _captured(lambda: attnlab.attention(q, k, v, **kw))
    for seed in (1, 2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        lens.copy_(torch.tensor([77 * seed, 4096], device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, attnlab.attention(q, k, v, **kw), atol=0, rtol=0)


def test_decode_on_two_streams_at_once():
    """Calls queued on two streams at the same time (each its own workspace, on its stream) agree with
    one at a time."""
    _available("triton")
    inputs = [_decode_inputs(seed=s) for s in (0, 1)]
    want = [attnlab.attention(*x, backend="triton-decode") for x in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    torch.cuda.synchronize()
    got = [[], []]
    for _ in range(20):
        for i, (x, s) in enumerate(zip(inputs, streams)):
            with torch.cuda.stream(s):
                got[i].append(attnlab.attention(*x, backend="triton-decode"))
    torch.cuda.synchronize()
    for i in range(2):
        for g in got[i]:
            torch.testing.assert_close(g, want[i], atol=0, rtol=0)


def test_decode_threads_on_one_stream_agree():
    """Threads queuing decode calls on one stream at once (the split states held for that stream are written
    and read by each call's two launches, queued under a lock) agree with one call at a time."""
    import threading

    _available("triton")
    inputs = [_decode_inputs(seed=s) for s in range(4)]
    want = [attnlab.attention(*x, backend="triton-decode") for x in inputs]
    got: list[list[torch.Tensor]] = [[] for _ in inputs]
    torch.cuda.synchronize()

    def work(i):
        for _ in range(30):
            got[i].append(attnlab.attention(*inputs[i], backend="triton-decode"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for i in range(len(inputs)):
        assert len(got[i]) == 30
        for g in got[i]:
            torch.testing.assert_close(g, want[i], atol=0, rtol=0)


def test_decode_split_states_are_held_grown_and_counted(monkeypatch):
    """Fast decode calls keep their split states in one buffer per stream: it grows for a larger problem,
    serves a smaller one, gives the same outputs as per-call allocation, and once released the next call's
    peak memory counts it again (what the benchmark's memory column reads)."""
    from attnlab.backends.triton import decode as td
    from attnlab.backends.triton import decode_launch as td_launch

    _available("triton")
    small, large = _decode_inputs(B=2, Nk=4096), _decode_inputs(B=8, Hq=16, Hkv=4, Nk=8192, seed=1)
    need = {}
    for name, x in (("small", small), ("large", large)):
        plan = td.gpu_plan(make_problem(*x))
        assert plan.n_split > 1, name
        need[name] = td.workspace_bytes(make_problem(*x), plan.n_split)
    assert need["large"] > need["small"]
    monkeypatch.setattr(td_launch, "HOLD_WORKSPACE", False)
    from attnlab import fast_calls as calls

    calls.clear()
    want = {n: attnlab.attention(*x, backend="triton-decode") for n, x in (("small", small), ("large", large))}
    monkeypatch.setattr(td_launch, "HOLD_WORKSPACE", True)
    calls.clear()
    td_launch.release_workspaces()
    for x in (small, large):
        attnlab.attention(*x, backend="triton-decode")  # the whole way: its fast call is made
    torch.cuda.synchronize()
    assert not td_launch._HELD
    from attnlab.backends.triton import runtime as truntime

    key = (torch.cuda.current_device(), truntime.stream_of(torch.cuda.current_device()))
    most = 0
    for n in ("small", "large", "small", "large", "small"):
        got = attnlab.attention(*(small if n == "small" else large), backend="triton-decode")
        torch.testing.assert_close(got, want[n], atol=0, rtol=0)
        most = max(most, need[n])
        assert td_launch._HELD[key].numel() * 4 >= most
        if n == "small" and most == need["small"]:
            assert td_launch._HELD[key].numel() * 4 < need["large"]  # sized for the first call, then grown
    assert len(td_launch._HELD) == 1
    td_launch.release_workspaces()
    assert key not in td_launch._HELD
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = attnlab.attention(*small, backend="triton-decode")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - out.untyped_storage().nbytes()
    assert extra >= need["small"]
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = attnlab.attention(*small, backend="triton-decode")
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before - out.untyped_storage().nbytes() < need["small"]


def test_decode_call_while_the_held_states_are_busy(monkeypatch):
    """A decode call made while the held split states' lock is taken (by a launch hook that itself calls
    attention, or another thread mid-call) does not wait for it: it gets states of its own (the held ones
    are not touched), and the same out."""
    import threading

    from attnlab import fast_calls as calls
    from attnlab.backends.triton import decode_launch as td_launch

    _available("triton")
    x = _decode_inputs(seed=3)
    calls.clear()
    want = attnlab.attention(*x, backend="triton-decode")  # the whole way, which makes the fast call
    held = []
    real = td_launch.held_workspace
    monkeypatch.setattr(td_launch, "held_workspace", lambda *a: held.append(a) or real(*a))
    attnlab.attention(*x, backend="triton-decode")
    assert len(held) == 1  # the fast call, through the held states
    got: list[torch.Tensor] = []
    assert td_launch.HELD_LOCK.acquire(timeout=5)
    try:
        t = threading.Thread(target=lambda: got.append(attnlab.attention(*x, backend="triton-decode")))
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "the call waited for the held states' lock"
    finally:
        td_launch.HELD_LOCK.release()
    t.join()
    torch.cuda.synchronize()
    assert len(held) == 1  # states of its own, not the held ones
    torch.testing.assert_close(got[0], want, atol=0, rtol=0)
