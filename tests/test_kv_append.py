"""KV append (``k_new``/``v_new``): the cache is written at each sequence's length, dense or paged, and the call
attends over the longer sequences; lengths are checked on the host and never trusted from the GPU."""

from __future__ import annotations

import pytest
import torch

import attnlab

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run pytest -m gpu on a GPU machine)")


def _dense(B=3, Hq=4, Hkv=2, Nk=40, D=16, n_new=3, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    draw = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    return (draw(B, Hq, n_new, D), draw(B, Hkv, Nk, D), draw(B, Hkv, Nk, D), draw(B, Hkv, n_new, D),
            draw(B, Hkv, n_new, D))


def _expected_dense(kc, vc, kn, vn, kv_len):
    ke, ve = kc.clone(), vc.clone()
    for b, n in enumerate(kv_len):
        stop = min(n + kn.shape[2], kc.shape[2])
        ke[b, :, n:stop] = kn[b, :, :stop - n]
        ve[b, :, n:stop] = vn[b, :, :stop - n]
    return ke, ve


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("backend", ["triton", "triton-decode", "reference", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_append_writes_then_attends(layout, backend, dtype):
    q, kc, vc, kn, vn = _dense(dtype=dtype)
    kv_len = [5, 0, 37]
    T = (lambda x: x) if layout == "bhnd" else (lambda x: x.transpose(1, 2).contiguous())
    kc2, vc2 = T(kc.clone()), T(vc.clone())
    out = attnlab.attention(T(q), kc2, vc2, k_new=T(kn), v_new=T(vn), kv_len=torch.tensor(kv_len), causal=True,
                            align="bottom_right", layout=layout, backend=backend)
    ke, ve = _expected_dense(kc, vc, kn, vn, kv_len)
    back = (lambda x: x) if layout == "bhnd" else (lambda x: x.transpose(1, 2))
    assert torch.equal(back(kc2), ke) and torch.equal(back(vc2), ve)
    ref, _ = attnlab.reference(q, ke, ve, kv_len=[n + 3 for n in kv_len], causal=True, align="bottom_right")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (back(out).double() - ref).abs().max() < tol


def test_paged_append():
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, D, nb, bs, n_new = 3, 4, 2, 16, 12, 8, 3
    kc, vc = torch.randn(nb, bs, Hkv, D, generator=g), torch.randn(nb, bs, Hkv, D, generator=g)
    # blocks 0, 2 and 7 are in two tables, but no block one sequence writes is read by another (the contract)
    table = torch.tensor([[3, 1, 7, 0, 2], [4, 5, 6, 8, 9], [10, 11, 0, 7, 2]], dtype=torch.int32)
    q, kn, vn = (torch.randn(B, h, n_new, D, generator=g) for h in (Hq, Hkv, Hkv))
    kv_len = [6, 0, 37]
    kc2, vc2 = kc.clone(), vc.clone()
    out = attnlab.attention(q, kc2, vc2, k_new=kn, v_new=vn, kv_len=kv_len, block_table=table, causal=True,
                            align="bottom_right", backend="triton-decode")
    ke, ve = kc.clone(), vc.clone()
    for b in range(B):
        for t in range(n_new):
            p = kv_len[b] + t
            ke[table[b, p // bs], p % bs] = kn[b, :, t]
            ve[table[b, p // bs], p % bs] = vn[b, :, t]
    assert torch.equal(kc2, ke) and torch.equal(vc2, ve)
    ref, _ = attnlab.reference(q, ke, ve, kv_len=[n + n_new for n in kv_len], block_table=table, causal=True,
                               align="bottom_right")
    assert (out.double() - ref).abs().max() < 1e-5


def _paged_from_dense(kc, vc, bs, seed):
    """The dense caches [B, Hkv, Nk, D] (Nk a multiple of ``bs``) as a paged cache of blocks of ``bs`` keys in a
    shuffled order, with spare blocks: (k_cache, v_cache, block_table)."""
    B, Hkv, Nk, D = kc.shape
    per = Nk // bs
    table = torch.randperm(B * per + 3, generator=torch.Generator().manual_seed(seed))[:B * per].view(B, per)
    kp, vp = torch.zeros(B * per + 3, bs, Hkv, D, dtype=kc.dtype), torch.zeros(B * per + 3, bs, Hkv, D, dtype=kc.dtype)
    for b in range(B):
        for i in range(per):
            kp[table[b, i]] = kc[b, :, i * bs:(i + 1) * bs].transpose(0, 1)
            vp[table[b, i]] = vc[b, :, i * bs:(i + 1) * bs].transpose(0, 1)
    return kp, vp, table.to(torch.int32)


FUSED = [
    # (name, B, Hq, Hkv, Nq, n_new, Nk, keywords): the decode kernel's own write, through the interpreter (16-key
    # tiles, 3 splits, 16 packed rows a row tile), against the separate write followed by the reference
    ("one new key", 3, 4, 2, 1, 1, 80, dict(causal=True, align="bottom_right")),
    ("more new keys than a tile", 2, 2, 1, 3, 21, 80, dict(causal=True, align="bottom_right")),
    ("two row tiles", 2, 8, 1, 4, 4, 64, dict(causal=True, align="bottom_right")),
    ("window and modifiers", 3, 4, 2, 2, 5, 80, dict(window=(9, 0), align="bottom_right", softcap=7.0,
                                                     alibi_slopes="yes", sinks="yes")),
    ("no mask", 2, 4, 4, 2, 3, 48, dict()),
]


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("name, B, Hq, Hkv, Nq, n_new, Nk, kw", FUSED, ids=[f[0] for f in FUSED])
def test_the_decode_kernel_writes_the_append_itself(monkeypatch, paged, name, B, Hq, Hkv, Nq, n_new, Nk, kw):
    """triton-decode writes the new keys in its own launch (no attnlab::kv_append) and attends over them: the
    caches and the output are those of the separate write followed by the float64 reference."""
    from attnlab import kv_append

    g = torch.Generator().manual_seed(Nk + n_new)
    q = torch.randn(B, Hq, Nq, 16, generator=g)
    kc, vc = torch.randn(B, Hkv, Nk, 16, generator=g), torch.randn(B, Hkv, Nk, 16, generator=g)
    kn, vn = torch.randn(B, Hkv, n_new, 16, generator=g), torch.randn(B, Hkv, n_new, 16, generator=g)
    kw = dict(kw)
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = torch.rand(Hq, generator=g)
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(Hq, generator=g)
    kv_len = [Nk - n_new, 0, 17][:B] if B > 2 else [Nk - n_new - 5, 33]
    ke, ve = _expected_dense(kc, vc, kn, vn, kv_len)
    ref, ref_lse = attnlab.reference(q, ke, ve, kv_len=[n + n_new for n in kv_len], **kw)
    writes = []
    monkeypatch.setattr(kv_append.Append, "write", lambda self: writes.append(self))
    if paged:
        kp, vp, table = _paged_from_dense(kc, vc, 16, seed=Nk)
        out, lse = attnlab.attention(q, kp, vp, k_new=kn, v_new=vn, kv_len=kv_len, block_table=table,
                                     backend="triton-decode", return_lse=True, **kw)
        kd = kp[table.long()].reshape(B, Nk, Hkv, 16).transpose(1, 2)
        vd = vp[table.long()].reshape(B, Nk, Hkv, 16).transpose(1, 2)
    else:
        kd, vd = kc.clone(), vc.clone()
        out, lse = attnlab.attention(q, kd, vd, k_new=kn, v_new=vn, kv_len=kv_len, backend="triton-decode",
                                     return_lse=True, **kw)
    assert not writes, "the decode kernel did not write the append itself"
    assert torch.equal(kd, ke) and torch.equal(vd, ve)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5


def test_an_append_with_no_query_row_is_still_written():
    q, kc, vc, kn, vn = _dense()
    kc2, vc2 = kc.clone(), vc.clone()
    out = attnlab.attention(q[:, :, :0], kc2, vc2, k_new=kn, v_new=vn, kv_len=[5, 0, 37], backend="triton-decode")
    ke, ve = _expected_dense(kc, vc, kn, vn, [5, 0, 37])
    assert out.shape == (3, 4, 0, 16) and torch.equal(kc2, ke) and torch.equal(vc2, ve)


def test_writes_past_the_capacity_are_dropped():
    """What GPU lengths may ask (the host check refuses it): the kernel writes only the positions that fit."""
    _, kc, vc, kn, vn = _dense(Nk=8)
    kc2, vc2 = kc.clone(), vc.clone()
    torch.ops.attnlab.kv_append(kc2, vc2, kn, vn, torch.tensor([6, 8, 20], dtype=torch.int32), None, "bhnd")
    ke, ve = _expected_dense(kc, vc, kn, vn, [6, 8, 20])
    assert torch.equal(kc2, ke) and torch.equal(vc2, ve)


BAD = [
    ("no kv_len", dict(kv_len=None), ValueError, ["needs kv_len"]),
    ("no v_new", dict(v_new=None), ValueError, ["v_new is missing"]),
    ("overflow", dict(kv_len=[38, 0, 0]), ValueError, ["capacity", "[0, 40]"]),
    ("negative", dict(kv_len=[-1, 0, 0]), ValueError, ["[0, 40]"]),
    ("grad", dict(k_new="grad"), ValueError, ["requires grad"]),
    ("heads", dict(k_new="heads"), ValueError, ["do not fit the caches"]),
    ("dtype", dict(k_new="half"), TypeError, ["dtype"]),
]


@pytest.mark.parametrize("what, change, exc, words", BAD, ids=[b[0] for b in BAD])
def test_bad_append_is_a_clear_error(what, change, exc, words):
    q, kc, vc, kn, vn = _dense()
    kw = dict(k_new=kn, v_new=vn, kv_len=[5, 0, 37])
    kw.update(change)
    if kw["k_new"] == "grad":
        kw["k_new"] = kn.clone().requires_grad_()
    elif kw["k_new"] == "heads":
        kw["k_new"], kw["v_new"] = kn[:, :1], vn[:, :1]
    elif kw["k_new"] == "half":
        kw["k_new"] = kn.half()
    with pytest.raises(exc) as err:
        attnlab.attention(q, kc, vc, **kw)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_compile_sees_the_append_and_the_attention():
    q, kc, vc, kn, vn = _dense()
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    kv_len = torch.tensor([5, 0, 37], dtype=torch.int32)
    fn = torch.compile(lambda *a: attnlab.attention(a[0], a[1], a[2], k_new=a[3], v_new=a[4], kv_len=a[5],
                                                    causal=True, align="bottom_right", backend="triton"),
                       backend=backend, fullgraph=True)
    kc2, vc2 = kc.clone(), vc.clone()
    out = fn(q, kc2, vc2, kn, vn, kv_len)
    assert {"attnlab.kv_append", "attnlab.attention"} <= {o for o in ops if "attnlab" in o}, ops
    ke, ve = _expected_dense(kc, vc, kn, vn, [5, 0, 37])
    assert torch.equal(kc2, ke)
    ref, _ = attnlab.reference(q, ke, ve, kv_len=[8, 3, 40], causal=True, align="bottom_right")
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.gpu
@gpu
def test_gpu_lengths_are_clamped_and_the_call_captures():
    """Lengths on the GPU: an append past the capacity is dropped and attends over min(kv_len + Nnew, capacity)
    keys; the append and the attention replay from one CUDA graph."""
    q, kc, vc, kn, vn = _dense(Nk=64, dtype=torch.bfloat16, device="cuda")
    kv_len = torch.tensor([5, 62, 30], dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    out = attnlab.attention(q, kc2, vc2, k_new=kn, v_new=vn, kv_len=kv_len, causal=True, align="bottom_right")
    ke, ve = _expected_dense(kc, vc, kn, vn, [5, 62, 30])
    assert torch.equal(kc2, ke)
    ref, _ = attnlab.reference(q, ke, ve, kv_len=[8, 64, 33], causal=True, align="bottom_right")
    assert (out.double() - ref).abs().max() < 3e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnlab.attention(q, kc2, vc2, k_new=kn, v_new=vn, kv_len=kv_len, causal=True, align="bottom_right")
    kc2.copy_(kc)
    vc2.copy_(vc)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc2, ke)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("n_new", [1, 4])
def test_repeated_append_calls_launch_no_copy(paged, n_new):
    """Decode steps as a server makes them (bf16, GQA, GPU lengths, D128): each call's fast path writes the new
    keys inside the decode kernel (the profiler sees no append kernel), and every step's caches and output
    match the separate write followed by the reference."""
    from attnlab import fast_calls

    B, Hq, Hkv, Nk, D = 2, 8, 2, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(n_new)
    draw = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
    kc, vc = draw(B, Hkv, Nk, D), draw(B, Hkv, Nk, D)
    kw = dict(causal=True, align="bottom_right", sinks=torch.randn(Hq, device="cuda", generator=g), softcap=30.0)
    if paged:
        kp, vp, table = (t.cuda() for t in _paged_from_dense(kc.cpu(), vc.cpu(), 16, seed=n_new))
    fast_calls.clear()
    for step, start in enumerate((1000, 1000 + n_new, 4096 - n_new)):
        q, kn, vn = draw(B, Hq, n_new, D), draw(B, Hkv, n_new, D), draw(B, Hkv, n_new, D)
        kv_len = torch.tensor([start, start // 3], dtype=torch.int32, device="cuda")
        ke, ve = _expected_dense(kc, vc, kn, vn, kv_len.tolist())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            if paged:
                out = attnlab.attention(q, kp, vp, k_new=kn, v_new=vn, kv_len=kv_len, block_table=table, **kw)
                torch.cuda.synchronize()
                kd = kp[table.long()].reshape(B, Nk, Hkv, D).transpose(1, 2)
                vd = vp[table.long()].reshape(B, Nk, Hkv, D).transpose(1, 2)
            else:
                out = attnlab.attention(q, kc, vc, k_new=kn, v_new=vn, kv_len=kv_len, **kw)
                torch.cuda.synchronize()
                kd, vd = kc, vc
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert step == 0 or not any("append" in n for n in names), names
        assert torch.equal(kd, ke) and torch.equal(vd, ve), step
        ref, _ = attnlab.reference(q, ke, ve, kv_len=(kv_len + n_new).tolist(), **kw)
        assert (out.double() - ref).abs().max() < 3e-2, step
        kc, vc = ke, ve


def test_a_refused_call_leaves_the_caches_unchanged():
    """Every check of the call runs before the append writes: a bad block table id, a wrong head dim of q, a
    table of the wrong batch size are errors with the caches as they were."""
    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    kn, vn = torch.randn(1, 2, 2, 16, generator=g), torch.randn(1, 2, 2, 16, generator=g)
    q = torch.randn(1, 4, 2, 16, generator=g)
    table = torch.tensor([[2, 99]], dtype=torch.int32)
    for args, words in (((q, table), "block_table ids"), ((q[..., :8], torch.tensor([[2, 3]], dtype=torch.int32)),
                                                          "head dim"),
                        ((q, torch.tensor([[2, 3], [4, 5]], dtype=torch.int32)), "[B=1")):
        kc2, vc2 = kc.clone(), vc.clone()
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            attnlab.attention(args[0], kc2, vc2, k_new=kn, v_new=vn, kv_len=[3], block_table=args[1])
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_a_strided_block_table():
    """A transposed (non-contiguous) block table is read through both its strides."""
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(9, 4, 2, 16, generator=g), torch.randn(9, 4, 2, 16, generator=g)
    kn, vn = torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g)
    q = torch.randn(2, 4, 3, 16, generator=g)
    table = torch.tensor([[3, 4], [1, 5], [7, 6], [0, 8]], dtype=torch.int32).t()  # strides (1, 2)
    kc2, vc2 = kc.clone(), vc.clone()
    attnlab.attention(q, kc2, vc2, k_new=kn, v_new=vn, kv_len=[6, 0], block_table=table, causal=True,
                      align="bottom_right")
    ke = kc.clone()
    for b, n in enumerate([6, 0]):
        for t in range(3):
            p = n + t
            ke[table[b, p // 4], p % 4] = kn[b, :, t]
    assert torch.equal(kc2, ke)


@pytest.mark.parametrize("kv_len", [5, [5, 0, 37], "scalar tensor"])
def test_compile_takes_every_kind_of_lengths(kv_len):
    q, kc, vc, kn, vn = _dense()
    kv = torch.tensor(5) if kv_len == "scalar tensor" else kv_len
    fn = torch.compile(lambda *a: attnlab.attention(*a, k_new=kn, v_new=vn, kv_len=kv, causal=True,
                                                    align="bottom_right", backend="triton"),
                       backend="eager", fullgraph=True)
    kc2, vc2 = kc.clone(), vc.clone()
    out = fn(q, kc2, vc2)
    lens = [5, 5, 5] if not isinstance(kv, list) else kv
    ke, ve = _expected_dense(kc, vc, kn, vn, lens)
    assert torch.equal(kc2, ke)
    ref, _ = attnlab.reference(q, ke, ve, kv_len=[n + 3 for n in lens], causal=True, align="bottom_right")
    assert (out.double() - ref).abs().max() < 1e-5
