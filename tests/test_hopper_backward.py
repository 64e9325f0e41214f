"""The Hopper backward (attnlab.backends.triton.hopper_backward): which calls it takes, that it compiles for sm_90
with the installed triton (CPU), that a variant's first call runs the portable kernels, and on an sm_90 GPU that
the public call's gradients meet the contract through it."""

from __future__ import annotations

import pytest
import torch
from test_hopper import _qkv as hopper_inputs

import attnlab
from attnlab.backends.triton import background
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.problem import make_problem
from attnlab.reference import masked_scores, softmax_rows


def _qkv(D=128, **kw):
    """The forward tests' inputs, at the backward's head dim."""
    return hopper_inputs(D=D, **kw)


@pytest.fixture
def on_sm90(monkeypatch):
    monkeypatch.setattr(hopper, "on_sm90", lambda t: True)
    monkeypatch.setattr(hopper, "_mode", "1")


def _why(q, k, v, dout=None, **kw):
    prob = make_problem(q, k, v, **kw)
    return hb.unsupported(prob, torch.empty_like(prob.q) if dout is None else dout)


# ---- which calls it takes (CPU: the device check stubbed) ----------------------------------------------------


def test_takes_dense_causal_gqa_and_either_alignment(on_sm90):
    q, k, v = _qkv(Nq=300, Nk=500)
    assert _why(q, k, v) is None
    assert _why(q, k, v, causal=True, align="bottom_right") is None
    assert _why(q, k, v, causal=True, align="top_left") is None
    assert _why(*_qkv(dtype=torch.float16, Hkv=1)) is None
    assert _why(q, k, v, causal=True, align="top_left", alibi_slopes=torch.rand(4)) is None
    assert _why(*_qkv(B=2, Nq=300, Nk=500), causal=True, align="bottom_right", alibi_slopes=torch.rand(2, 4)) is None
    assert _why(*_qkv(B=2, Nq=300, Nk=500), alibi_slopes=torch.rand(2, 4)) is None
    assert _why(*_qkv(D=64), causal=True, align="bottom_right") is None
    assert _why(q, k, v, window=(127, 0), align="bottom_right", sinks=torch.zeros(4)) is None  # gpt-oss's layer
    assert _why(q, k, v, window=(64, None), align="top_left") is None


def test_head_dim_64_on_full_rows_only_with_grouped_query_heads(on_sm90):
    assert _why(*_qkv(D=64, Hq=4, Hkv=2)) is None
    assert "with grouped query heads only" in _why(*_qkv(D=64, Hq=4, Hkv=4))
    assert "with grouped query heads only" in _why(*_qkv(D=64, Hq=4, Hkv=4), alibi_slopes=torch.rand(4))
    assert _why(*_qkv(D=64, Hq=4, Hkv=4), causal=True) is None
    assert _why(*_qkv(D=64, Hq=4, Hkv=4), window=(None, 0)) is None
    assert "with grouped query heads only" in _why(*_qkv(D=64, Hq=4, Hkv=4), window=(8, 0))
    assert _why(*_qkv(D=64, Hq=4, Hkv=2), window=(1023, 0)) is None
    assert _why(*_qkv(D=128, Hq=4, Hkv=4)) is None


def test_head_dim_64_windows_only_from_the_width_named(on_sm90):
    """At D 64 a band narrower than PORTABLE_WINDOWS_BELOW keys runs on the portable passes, with or without sinks;
    the causal band, a left or right edge alone and wide windows run the Gluon pass; D 128 takes every width."""
    q, k, v = _qkv(D=64, Hq=4, Hkv=2)
    for window in ((127, 0), (1022, 0), (500, 500), (-5, 3)):
        assert "at least 1024 keys wide only" in _why(q, k, v, window=window), window
    assert "at least 1024 keys wide only" in _why(q, k, v, window=(127, 0), sinks=torch.zeros(4))
    for window in ((1023, 0), (1000, 23), (None, 0), (64, None), (None, 5), (2**40, 0)):
        assert _why(q, k, v, window=window) is None, window
    for window in ((127, 0), (-5, 3), (10, -20), (-10, None)):  # D 128: every width, empty bands too
        assert _why(*_qkv(D=128, Hq=4, Hkv=2), window=window, sinks=torch.zeros(4)) is None, window


def test_a_window_left_edge_only_with_grouped_query_heads(on_sm90):
    assert _why(*_qkv(D=128, Hq=4, Hkv=2), window=(127, 0)) is None
    assert "with grouped query heads only" in _why(*_qkv(D=128, Hq=4, Hkv=4), window=(127, 0))
    assert "with grouped query heads only" in _why(*_qkv(D=128, Hq=4, Hkv=4), window=(2047, 0), sinks=torch.zeros(4))
    assert _why(*_qkv(D=128, Hq=4, Hkv=4), window=(None, 5)) is None  # a right edge alone: rows as long as causal


@pytest.mark.parametrize("shape, kw, expect", [  # 132 SMs off the GPU; a wave is 132 programs
    (dict(B=8, Hkv=2, Nq=2048, Nk=2048), dict(causal=True), 2),  # 256 programs: 1.9 waves
    (dict(B=2, Hq=32, Hkv=8, Nq=4096, Nk=4096), dict(causal=True), 1),  # 3.9 waves
    (dict(B=1, Hq=64, Hkv=8, Nq=8192, Nk=8192), dict(causal=True), 1),  # 3.9 waves, past 4096 keys
    (dict(B=2, Hq=16, Hkv=16, Nq=8192, Nk=8192), dict(causal=True), 0),  # 15.5 waves
    (dict(B=16, Hq=16, Hkv=16, Nq=300, Nk=500), dict(window=(None, 0), align="top_left"), 1),  # 7.8 waves
    (dict(B=16, Hq=16, Hkv=16, Nq=300, Nk=4097), dict(causal=True, align="bottom_right"), 0),
    (dict(Nq=300, Nk=500), dict(), 0),
])
def test_the_programs_order_by_rule_unless_forced(monkeypatch, shape, kw, expect):
    monkeypatch.setattr(hb, "SPLIT", 1)  # the groups whole: waves of the unsplit grid
    prob = make_problem(*_qkv(**shape, D=8), **kw)
    assert hb.ORDER is None and hb.order(prob) == expect
    monkeypatch.setattr(hb, "ORDER", 2)
    assert hb.order(prob) == 2 and hb._grid(prob)[2] == -(-shape["Nk"] // 128)


@pytest.mark.parametrize("shape, kw, parts, waves", [  # 132 SMs off the GPU
    (dict(B=4, Hq=8, Hkv=1, Nq=4096, Nk=4096), dict(causal=True), 4, 3.9),  # 128 programs whole: in 4 parts
    (dict(B=2, Hq=32, Hkv=4, Nq=2048, Nk=2048), dict(causal=True), 4, 3.9),
    (dict(B=1, Hq=8, Hkv=1, Nq=1024, Nk=1024), dict(causal=True), 8, 0.5),  # as far as the group goes
    (dict(B=1, Hq=16, Hkv=2, Nq=6272, Nk=6272), dict(causal=True), 4, 3.0),  # 392 programs: 2.97 waves, enough
    (dict(B=8, Hq=16, Hkv=2, Nq=2048, Nk=2048), dict(causal=True), 1, 1.9),  # a wave or more: whole
    (dict(B=1, Hq=32, Hkv=8, Nq=8192, Nk=8192), dict(causal=True), 1, 3.9),
    (dict(B=1, Hq=12, Hkv=4, Nq=2048, Nk=2048), dict(causal=True), 1, 0.5),  # a group of 3 is not split
    (dict(B=4, Hq=16, Hkv=16, Nq=4096, Nk=4096), dict(causal=True), 1, 15.5),  # no group to split
    (dict(B=4, Hq=8, Hkv=1, Nq=4096, Nk=4096), dict(), 2, 1.9),  # full rows: until every SM has a program
    (dict(B=1, Hq=8, Hkv=1, Nq=4096, Nk=4096), dict(), 8, 1.9),
    (dict(B=2, Hq=32, Hkv=8, Nq=4096, Nk=4096), dict(), 1, 3.9),
])
def test_the_group_is_split_where_the_grid_is_short(monkeypatch, shape, kw, parts, waves):
    prob = make_problem(*_qkv(**shape, D=8), **kw)
    assert hb.SPLIT is None and hb.split(prob) == parts
    assert round(hb._programs(prob, parts) / 132, 1) == waves
    assert hb._grid(prob, 0) == (-(-shape["Nk"] // 128), shape["Hkv"] * parts, shape["B"])
    monkeypatch.setattr(hb, "SPLIT", 4)
    assert hb.split(prob) == (4 if shape["Hq"] // shape["Hkv"] % 4 == 0 else 1)


@pytest.mark.parametrize("kw, band", [  # Nq 300, Nk 500: bottom-right diagonals sit 200 keys right
    (dict(), (False, False, 0, 0)),
    (dict(causal=True, align="top_left"), (True, False, 0, 0)),
    (dict(causal=True, align="bottom_right"), (True, False, 200, 0)),
    (dict(window=(None, 0), align="bottom_right"), (True, False, 200, 0)),  # the causal band spelled as a window
    (dict(window=(None, 0), align="top_left"), (True, False, 0, 0)),
    (dict(window=(127, 0), align="bottom_right"), (True, True, 200, 73)),
    (dict(window=(64, 16), align="top_left"), (True, True, 16, -64)),
    (dict(window=(64, 16), causal=True, align="top_left"), (True, True, 0, -64)),  # causal cuts the right side
    (dict(window=(8, None), align="bottom_right"), (False, True, 0, 192)),
    (dict(window=(None, -3), align="top_left"), (True, False, -3, 0)),  # rows see no key of their own
    (dict(window=(2**31 - 1, 2**40), align="top_left"), (True, True, 800, -800)),  # clamped to +-(Nq + Nk)
    (dict(window=(-(2**40), None), align="bottom_right"), (False, True, 0, 1000)),
])
def test_each_band_gets_its_edges_and_offsets(on_sm90, kw, band):
    """Row i sees no key past ``i + off_hi`` (MASK_HI) and none before ``i + off_lo`` (MASK_LO), in the alignment's
    coordinates; the compiled variant is told apart by the edges it masks."""
    q, k, v = _qkv(Nq=300, Nk=500)
    prob = make_problem(q, k, v, **kw)
    assert hb.unsupported(prob, q) is None
    rows = torch.empty(1, 4, 300)
    _, args, launch_kw = hb._launch_args(prob, q, rows, rows, torch.zeros(1, 4, 300, 128), k, v)
    named = dict(zip(hb._kernel_module().attn_bwd_hopper.arg_names, args))
    assert (launch_kw["MASK_HI"], launch_kw["MASK_LO"], named["off_hi"], named["off_lo"]) == band
    assert hb._variant(prob)[4:6] == band[:2]


@pytest.mark.parametrize("slopes", [torch.rand(4), torch.rand(2, 4), torch.rand(4, 2).t()])
def test_alibi_arguments_are_the_slopes_view_and_nk_minus_nq(on_sm90, slopes):
    """Whatever the alignment (top-left here: the causal offset is 0, ALiBi's is Nk - Nq)."""
    q, k, v = _qkv(B=2, Nq=300, Nk=500)
    prob = make_problem(q, k, v, causal=True, align="top_left", alibi_slopes=slopes)
    rows = torch.empty(2, 4, 300)
    _, args, kw = hb._launch_args(prob, q, rows, rows, torch.zeros(2, 4, 300, 128), k, v)
    names = hb._kernel_module().attn_bwd_hopper.arg_names
    named = dict(zip(names, args))
    assert named["off_hi"] == 0 and named["alibi_off"] == 200 and kw["HAS_ALIBI"] is True
    assert named["Alibi"] is prob.mods.alibi and (named["s_ab"], named["s_ah"]) == prob.mods.alibi.stride()


@pytest.mark.parametrize("order, axes", [(0, ("tiles", "Hkv", "B")), (1, ("Hkv", "tiles", "B")),
                                         (2, ("Hkv", "B", "tiles"))])
def test_each_order_lays_out_the_grid_and_refuses_past_its_limits(on_sm90, monkeypatch, order, axes):
    monkeypatch.setattr(hb, "ORDER", order)
    monkeypatch.setattr(hb, "SPLIT", 1)
    q, k, v = _qkv(B=3, Hq=4, Hkv=2, Nq=300, Nk=500)
    size = {"tiles": 4, "Hkv": 2, "B": 3}
    assert hb._grid(make_problem(q, k, v)) == tuple(size[a] for a in axes)
    q1, k1, v1 = (t[:1, :, :4] for t in (q, k, v))
    tall = make_problem(q1.expand(65536, -1, -1, -1), k1.expand(65536, -1, -1, -1), v1.expand(65536, -1, -1, -1))
    assert ("65535" in (hb.unsupported(tall, tall.q) or "")) == (axes.index("B") > 0)


@pytest.mark.parametrize("forced", [None, 1])
@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True, align="bottom_right", alibi_slopes=torch.rand(4)),
                                dict(causal=True, align="top_left", alibi_slopes=torch.rand(4, 2).t()),
                                dict(window=(40, 7), align="bottom_right", sinks=torch.rand(4))])
def test_a_relaunch_passes_the_kernels_arguments_in_its_order(on_sm90, monkeypatch, order, kw, forced):
    """The compiled kernel's own launcher takes every argument, constexprs included, by position: the values a
    relaunch builds must be the first launch's, in the kernel's signature order (the group whole or split)."""
    monkeypatch.setattr(hb, "ORDER", order)
    monkeypatch.setattr(hb, "SPLIT", forced)
    monkeypatch.setattr(hopper, "ready", lambda *a, **k: True)
    seen = {}
    monkeypatch.setattr(hb._rt, "run_compiled", lambda c, grid, stream, values: seen.update(grid=grid, values=values))
    monkeypatch.setattr(hb._rt, "stream_of", lambda index: 0)
    q, k, v = _qkv(B=2, Nq=300, Nk=301)
    prob = make_problem(q, k, v, **kw)
    monkeypatch.setitem(hb._kernels, hb._variant(prob), object())
    lse2, delta, acc = torch.empty(2, 4, 300), torch.empty(2, 4, 300), torch.zeros(2, 4, 300, 128)  # told apart
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    parts = hb.split(prob)
    assert parts == (forced or 2)  # by rule the group of 2 is split: 12 programs whole
    assert hb.run(prob, q, delta, lse2, dk, dv, acc) is acc
    if parts > 1:  # the kernel writes the parts' float32 sums, which the host adds into dk and dv
        dk, dv = hb._partials(prob, parts)
    grid, args, launch_kw = hb._launch_args(prob, q, lse2, delta, acc, dk, dv)
    names = hb._kernel_module().attn_bwd_hopper.arg_names
    expect = [*args, *(launch_kw[n] for n in names[len(args):])]
    assert seen["grid"] == grid and len(seen["values"]) == len(names) == len(expect)
    for name, got, want in zip(names, seen["values"], expect):
        if isinstance(got, hopper.LightDescriptor):
            assert got.base.data_ptr() == want.base.data_ptr() and list(got.shape) == list(want.shape), name
        elif isinstance(got, torch.Tensor) and parts > 1 and name in ("DK", "DV"):
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), name
        elif isinstance(got, torch.Tensor):
            assert got is want, name
        else:
            assert got == want and type(got) is type(want), (name, got, want)


def _launched(values: tuple) -> list:
    """A launch's values as comparable items: descriptors and tensors by address, shape and strides."""
    out = []
    for x in values:
        if isinstance(x, hopper.LightDescriptor):
            out.append(("desc", x.base.data_ptr(), tuple(x.shape), tuple(x.strides)))
        elif isinstance(x, torch.Tensor):
            out.append(("tensor", x.data_ptr(), x.dtype, tuple(x.shape), x.stride()))
        else:
            out.append((type(x), x))
    return out


@pytest.mark.parametrize("forced", [None, 1])
def test_a_keyed_call_plans_once_and_launches_as_an_unkeyed_one(on_sm90, monkeypatch, forced):
    """The backward passes its launch key: the rule checks, split, order and grid run on a key's first call alone,
    and its later calls launch what an unkeyed call launches; a switch of mode, deterministic mode or the forced
    split decides again, and a refusal is kept as well."""
    monkeypatch.setattr(hb, "SPLIT", forced)
    monkeypatch.setattr(hb, "_plans", {})  # (this test's own)
    monkeypatch.setattr(hopper, "ready", lambda *a, **k: True)
    seen = []
    monkeypatch.setattr(hb._rt, "run_compiled", lambda c, grid, stream, values: seen.append((grid, values)))
    monkeypatch.setattr(hb._rt, "stream_of", lambda index: 0)
    checks, rule = [], hb.unsupported
    monkeypatch.setattr(hb, "unsupported", lambda *a: checks.append(1) or rule(*a))
    q, k, v = _qkv(B=2, Nq=300, Nk=301)
    prob = make_problem(q, k, v, window=(40, 7), align="bottom_right", sinks=torch.rand(4))
    monkeypatch.setitem(hb._kernels, hb._variant(prob), object())
    lse2, delta, acc = torch.empty(2, 4, 300), torch.empty(2, 4, 300), torch.zeros(2, 4, 300, 128)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    key = ("a launch key",)
    for _ in range(3):
        assert hb.run(prob, q, delta, lse2, dk, dv, acc, key) is acc
    assert len(checks) == 1 and len(hb._plans) == 1
    assert hb.run(prob, q, delta, lse2, dk, dv, acc) is acc  # unkeyed: planned again
    assert len(checks) == 2 and len(seen) == 4
    grids = {grid for grid, _ in seen}
    assert len(grids) == 1 and grids == {hb._grid(prob)}
    if hb.split(prob) == 1:  # (split, each launch writes parts of its own)
        launched = [_launched(values) for _, values in seen]
        assert all(x == launched[-1] for x in launched)
    monkeypatch.setattr(hopper, "_mode", "0")
    for _ in range(2):
        assert hb.run(prob, q, delta, lse2, dk, dv, acc, key) is None
    assert len(checks) == 3
    monkeypatch.setattr(hopper, "_mode", "1")
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert hb.run(prob, q, delta, lse2, dk, dv, acc, key) is None
    finally:
        torch.use_deterministic_algorithms(prev)
    monkeypatch.setattr(hb, "SPLIT", 2 if forced == 1 else 1)
    monkeypatch.setitem(hb._kernels, hb._variant(prob), object())
    assert hb.run(prob, q, delta, lse2, dk, dv, acc, key) is acc
    assert len(checks) == 5 and len(seen) == 5


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_the_parts_sums_land_in_dk_and_dv(on_sm90, monkeypatch, layout):
    """With the group split the kernel writes float32 parts (kv head h's part p at head h * parts + p); the host
    adds them up into the caller's dk and dv, whatever their strides. The launch is stubbed: it fills the parts."""
    monkeypatch.setattr(hb, "SPLIT", 4)
    monkeypatch.setattr(hopper, "ready", lambda *a, **k: True)
    monkeypatch.setattr(hb._rt, "stream_of", lambda index: 0)
    g = torch.Generator().manual_seed(0)
    parts = {}

    def launch(compiled, grid, stream, values):
        names = hb._kernel_module().attn_bwd_hopper.arg_names
        for name in ("DK", "DV"):
            parts[name] = values[names.index(name)]
            parts[name].copy_(torch.randn(parts[name].shape, generator=g))

    monkeypatch.setattr(hb._rt, "run_compiled", launch)
    q, k, v = _qkv(B=2, Hq=8, Hkv=2, Nq=300, Nk=200)
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    prob = make_problem(q, k, v, layout=layout)
    monkeypatch.setitem(hb._kernels, hb._variant(prob), object())
    rows, acc = torch.empty(2, 8, 300), torch.zeros(2, 8, 300, 128)
    dk, dv = (torch.full_like(t, float("nan")).transpose(1, 2) if layout == "bnhd" else torch.full_like(t, float("nan"))
              for t in (k, v))  # the gradients as [B, H, N, D] views of the caller's tensors
    assert hb.run(prob, prob.q, rows, rows, dk, dv, acc) is acc
    for name, grad in (("DK", dk), ("DV", dv)):
        part = parts[name]
        assert part.dtype == torch.float32 and part.shape == (2, 2 * 4, 200, 128)
        assert torch.equal(grad, part.view(2, 2, 4, 200, 128).sum(2).to(grad.dtype)), name


@pytest.mark.parametrize("kw, reason", [
    (dict(kv_len=[100]), "no lengths"),
    (dict(q_len=[100]), "no lengths"),
    (dict(softcap=30.0), "no soft cap"),
    (dict(softcap=30.0, alibi_slopes=torch.ones(4)), "no soft cap"),
    (dict(mask=torch.ones(1, 1, 200, 200, dtype=torch.bool)), "no explicit mask"),
])
def test_refuses_what_it_does_not_compute(on_sm90, kw, reason):
    kw = {n: torch.tensor(x, dtype=torch.int32) if n.endswith("_len") else x for n, x in kw.items()}
    assert reason in _why(*_qkv(), **kw)


def test_refuses_other_head_dims_dtypes_and_deterministic_mode(on_sm90):
    assert "D = Dv in (64, 128)" in _why(*_qkv(D=96))
    assert "float16 and bfloat16 only" in _why(*_qkv(dtype=torch.float32))
    assert _why(*_qkv(Nq=333)) is None  # each head's rows of lse2 and Delta padded to 4 (run)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in _why(*_qkv())
    finally:
        torch.use_deterministic_algorithms(prev)


def test_refuses_what_tma_cannot_read(on_sm90):
    q, k, v = _qkv()
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    shifted = flat[1:].view(q.shape)  # a base 2 bytes past a 16-byte boundary
    assert "TMA needs" in _why(shifted, k, v)
    assert "TMA needs" in _why(q, k, v, dout=shifted)


def test_refuses_more_rows_than_tma_coordinates_reach(on_sm90):
    """lse2 and Delta are read by TMA through one-dimensional descriptors of all rows: int32 coordinates."""
    q = torch.empty(1, 2**16, 2**15, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2**13, 2**15, 128, dtype=torch.bfloat16, device="meta")
    assert "fewer than 2**31 query rows" in _why(q, k, k)
    # 2**17 heads of 16383 rows fit, but not once each head's rows are padded to 16384
    q = torch.empty(1, 2**17, 2**14 - 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2**13, 128, 128, dtype=torch.bfloat16, device="meta")
    assert q.shape[1] * q.shape[2] < 2**31
    assert "fewer than 2**31 query rows" in _why(q, k, k)


def test_odd_nq_passes_lse2_and_delta_with_rows_padded_to_four(on_sm90, monkeypatch):
    """TMA reads each row tile from a 16-byte aligned start: with Nq = 301 the launch gets lse2 and Delta of 304
    rows a head (the first 301 the caller's) and Nq_rows 304."""
    monkeypatch.setattr(hopper, "ready", lambda *a, **k: True)
    seen = {}
    monkeypatch.setattr(hb._rt, "run_compiled", lambda c, grid, stream, values: seen.update(values=values))
    monkeypatch.setattr(hb._rt, "stream_of", lambda index: 0)
    q, k, v = _qkv(Nq=301, Nk=200)
    prob = make_problem(q, k, v, causal=True, align="bottom_right")
    monkeypatch.setitem(hb._kernels, hb._variant(prob), object())
    lse2, delta = torch.randn(1, 4, 301), torch.randn(1, 4, 301)
    hb.run(prob, q, delta, lse2, torch.empty_like(k), torch.empty_like(v), torch.zeros(1, 4, 301, 64))
    named = dict(zip(hb._kernel_module().attn_bwd_hopper.arg_names, seen["values"]))
    assert (named["Nq"], named["Nq_rows"]) == (301, 304)
    for name, want in (("lse2_desc", lse2), ("delta_desc", delta)):
        got = named[name].base.view(1, 4, 304)
        assert list(named[name].shape) == [4 * 304] and torch.equal(got[..., :301], want)


def test_rows_tma_cannot_read_go_to_the_portable_kernels(on_sm90, monkeypatch):
    """A Delta or lse2 not contiguous or not 16-byte aligned is not launched on (run returns None at once)."""
    reached = []
    monkeypatch.setattr(hopper, "ready", lambda *a, **k: reached.append(1) or False)
    q, k, v = _qkv()
    prob = make_problem(q, k, v)
    good = torch.empty(1, 4, 200)
    shifted = torch.empty(4 * 200 + 1)[1:].view(1, 4, 200)  # a base 4 bytes past a 16-byte boundary
    strided = torch.empty(1, 200, 4).transpose(1, 2)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for delta, lse2 in ((shifted, good), (good, shifted), (strided, good), (good, strided)):
        assert hb.run(prob, q, delta, lse2, dk, dv) is None
    assert not reached
    assert hb.run(prob, q, good, good, dk, dv) is None and reached  # aligned rows reach the compile check


def test_off_sm90_and_switched_off_it_takes_nothing(monkeypatch):
    assert "sm_90 GPUs only" in _why(*_qkv())
    monkeypatch.setattr(hopper, "on_sm90", lambda t: True)
    prev = hopper.set_mode("0")
    try:
        assert "ATTNLAB_HOPPER=0" in _why(*_qkv())
    finally:
        hopper.set_mode(prev)


def test_a_variants_first_call_runs_the_portable_kernels_and_its_second_starts_the_compile(on_sm90, monkeypatch):
    """The forward's compile modes (hopper_forward.ready), under the backward's own variant key."""
    from concurrent.futures import Future

    submitted = []

    def ahead(kernel, grid, args, kw, device, jit=False):
        submitted.append((kernel, grid, kw, jit))
        return Future()

    if isinstance(hb._kernel_module(), str):
        pytest.skip(hb._kernel_module())
    monkeypatch.setattr(background, "ahead", ahead)
    monkeypatch.setattr(hopper, "_compiles", {})
    monkeypatch.setattr(hopper, "_seen", set())
    q, k, v = _qkv(Nq=300, Nk=500)
    prob = make_problem(q, k, v, causal=True, align="bottom_right")
    rows = torch.empty(1, 4, 300)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    assert hb.run(prob, q, rows, rows, dk, dv) is None and not submitted  # first call: the portable kernels
    assert hb.run(prob, q, rows, rows, dk, dv) is None and len(submitted) == 1  # second: the compile starts
    kernel, grid, kw, jit = submitted[0]
    assert kernel is hb._kernel_module().attn_bwd_hopper and jit and (kw["MASK_HI"], kw["MASK_LO"]) == (True, False)
    assert grid == (4, 1, 4)  # under two waves, so order 2: Hkv 2 x 2 parts, B, ceil(500 / 128) key tiles
    assert hb.run(prob, q, rows, rows, dk, dv) is None and len(submitted) == 1  # in flight: not started twice
    assert hopper._compiles.keys() == {hb._variant(prob)}  # the backward's key, not a forward's


#: The spills the measured kernel has (a few of the causal mask's indices; docs/decisions.md, "One Gluon pass for
#: the backward, dQ by TMA reduce-adds") with room for another triton's register allocation, and no more.
MAX_SPILL_BYTES = 512


def test_compiles_for_sm90_with_the_installed_triton(monkeypatch):
    """The kernel compiles for sm_90 (no GPU needed), with no warpgroup MMA serialized and its spills bounded, in
    each program order, its group whole or split (float32 partial dK and dV)."""
    if isinstance(hb._kernel_module(), str):
        pytest.skip(hb._kernel_module())
    from test_hopper import ptxas_report
    from triton.backends.compiler import GPUTarget

    from attnlab.backends.triton.cold_launch import compile_only

    alibi_causal = dict(causal=True, align="bottom_right", alibi_slopes=torch.rand(4))
    causal = dict(causal=True, align="bottom_right")
    window = dict(window=(127, 0), align="bottom_right")
    for order, parts, D, kw in ((0, 1, 128, dict()), (0, 1, 128, causal), (0, 2, 128, causal),
                                (0, 1, 128, alibi_causal), (1, 1, 128, alibi_causal), (2, 2, 128, alibi_causal),
                                (0, 2, 64, dict()), (0, 1, 64, causal), (0, 1, 64, window),
                                (0, 2, 128, dict(window=(100, 20), align="top_left")),
                                (0, 1, 128, dict(window=(8, None), align="top_left"))):
        monkeypatch.setattr(hb, "ORDER", order)
        monkeypatch.setattr(hb, "SPLIT", parts)
        q, k, v = _qkv(Nq=300, Nk=500, D=D)
        prob = make_problem(q, k, v, **kw)
        rows = torch.empty(1, 4, 300)
        acc = torch.zeros(1, 4, 300, D)
        dk, dv = hb._partials(prob, parts) if parts > 1 else (k, v)
        _, args, launch_kw = hb._launch_args(prob, q, rows, rows, acc, dk, dv)
        assert launch_kw["SPLIT"] == parts
        assert launch_kw["enable_fp_fusion"] is True
        compiled = compile_only(hb._kernel_module().attn_bwd_hopper, args, launch_kw, 0,
                                target=GPUTarget("cuda", 90, 32))[0]
        assert compiled.metadata.num_warps == 12  # two consumer warpgroups, the loader's and the writer's warps
        assert compiled.metadata.shared <= 227 * 1024
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.reduce.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
        spills, serialized = ptxas_report(ptx)
        assert not serialized, "ptxas serializes the kernel's warpgroup MMAs (too few registers in a partition)"
        assert spills <= MAX_SPILL_BYTES, f"the Hopper backward spills {spills} bytes"


# ---- on an sm_90 GPU ------------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs an sm_90 GPU")

CASES = {
    "full_gqa": dict(shape=dict(Nq=1000, Nk=1000), kw=dict()),
    "causal": dict(shape=dict(Nq=1000, Nk=1000, Hkv=8), kw=dict(causal=True)),
    "causal_br_short_q": dict(shape=dict(Nq=333, Nk=777), kw=dict(causal=True, align="bottom_right")),
    "causal_br_long_q": dict(shape=dict(Nq=777, Nk=333), kw=dict(causal=True, align="bottom_right")),  # empty rows
    "causal_tl_long_q": dict(shape=dict(Nq=777, Nk=333), kw=dict(causal=True, align="top_left")),
    "full_short_k": dict(shape=dict(Nq=300, Nk=65, Hkv=1), kw=dict()),
    "one_key": dict(shape=dict(Nq=64, Nk=1), kw=dict()),
    "fp16_causal": dict(shape=dict(Nq=300, Nk=300, dtype=torch.float16), kw=dict(causal=True)),
    "causal_tl_short_q": dict(shape=dict(Nq=333, Nk=777), kw=dict(causal=True, align="top_left")),  # unseen keys
    "window_right0_br": dict(shape=dict(Nq=300, Nk=500), kw=dict(window=(None, 0), align="bottom_right")),
    # every score strongly negative (lse2 far below 0) and a ragged last key tile: its padding keys must not reach
    # dQ (their p = exp2(-lse2) overflows float16 to inf, and inf times a zero key is NaN)
    "fp16_negative_ragged": dict(shape=dict(Nq=200, Nk=65, dtype=torch.float16), kw=dict(), negative=True),
    "bnhd": dict(shape=dict(Nq=257, Nk=257), kw=dict(causal=True), bnhd=True),
    # ALiBi: distances |i + Nk - Nq - j| whatever the alignment; slopes per head ([Hq]) or per batch entry and head
    "alibi_causal_tl_short_q": dict(shape=dict(Nq=333, Nk=777), kw=dict(causal=True, align="top_left"), alibi="h"),
    "alibi_causal_tl_long_q_bh": dict(shape=dict(Nq=500, Nk=300), kw=dict(causal=True, align="top_left"),
                                      alibi="bh"),
    # D 64: one 32-column box per half of dQ
    "d64_causal_gqa": dict(shape=dict(Nq=1000, Nk=1000, D=64), kw=dict(causal=True)),
    "d64_causal_br_fp16_short_q": dict(shape=dict(Nq=333, Nk=777, D=64, dtype=torch.float16),
                                       kw=dict(causal=True, align="bottom_right")),
    "alibi_causal_br_fp16": dict(shape=dict(Nq=300, Nk=500, dtype=torch.float16),
                                 kw=dict(causal=True, align="bottom_right"), alibi="h"),
    # ALiBi on full rows, Nq != Nk either way; D 64 without GQA: taken under the causal band, full rows portable
    "alibi_full_short_q_bh": dict(shape=dict(Nq=333, Nk=777), kw=dict(), alibi="bh"),
    "alibi_full_long_q_fp16": dict(shape=dict(Nq=500, Nk=300, dtype=torch.float16), kw=dict(), alibi="h"),
    "d64_causal_mha": dict(shape=dict(Nq=301, Nk=301, D=64, Hkv=8), kw=dict(causal=True)),
    "d64_full_mha_portable": dict(shape=dict(Nq=300, Nk=300, D=64, Hkv=8), kw=dict(), portable=True),
    "nq3_causal_br": dict(shape=dict(Nq=3, Nk=70), kw=dict(causal=True, align="bottom_right")),  # rows padded 3 -> 4
    # windows: both edges, either alignment, Nq != Nk either way, a left edge alone, rows that see no key, sinks
    "window_left_br_short_q": dict(shape=dict(Nq=333, Nk=777), kw=dict(window=(100, 0), align="bottom_right")),
    "window_two_sided_tl_long_q": dict(shape=dict(Nq=777, Nk=333), kw=dict(window=(50, 30), align="top_left")),
    "window_left_only_fp16": dict(shape=dict(Nq=500, Nk=500, dtype=torch.float16), kw=dict(window=(64, None))),
    "window_off_diagonal_tl": dict(shape=dict(Nq=300, Nk=300), kw=dict(window=(-70, 200), align="top_left"),
                                   sinks=True),  # rows past 229 see no key: their lse is the sink's
    "d64_window_gqa_sinks": dict(shape=dict(Nq=1500, Nk=1500, D=64), kw=dict(window=(1023, 0)), sinks=True),
    "d64_narrow_window_gqa_portable": dict(shape=dict(Nq=600, Nk=600, D=64), kw=dict(window=(127, 0)), sinks=True,
                                           portable=True),
    "window_alibi_sinks_br": dict(shape=dict(Nq=400, Nk=700), kw=dict(window=(200, 5), align="bottom_right"),
                                  alibi="h", sinks=True),
    "sinks_causal": dict(shape=dict(Nq=300, Nk=300), kw=dict(causal=True), sinks=True),
    "d64_window_mha_portable": dict(shape=dict(Nq=300, Nk=300, D=64, Hkv=8), kw=dict(window=(31, 0)),
                                    portable=True),
    "d128_window_mha_portable": dict(shape=dict(Nq=300, Nk=300, Hkv=8), kw=dict(window=(31, 0)), portable=True),
}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", list(CASES))
def test_the_public_backward_runs_the_hopper_kernel_and_meets_the_contract(case):
    """Gradients of a loss on out and lse (the lse's gradient enters through Delta) against float64 autograd of
    the reference: within twice the same-dtype textbook's error plus 1% of the largest gradient (the public
    call's policy), finite, and 0 for rows with no allowed key."""
    spec = CASES[case]
    q, k, v = _qkv(B=2, Hq=8, device="cuda", seed=5, **{"Hkv": 2, **spec["shape"]})
    if spec.get("negative"):
        q, k = q.abs() * 3, -k.abs() * 3
    kw = spec["kw"]
    if spec.get("alibi"):  # slopes of FlashAttention's size, and one 4x larger, per head
        B, Hq = q.shape[:2]
        shape = (Hq,) if spec["alibi"] == "h" else (B, Hq)
        gs = torch.Generator("cuda").manual_seed(3)
        kw = dict(kw, alibi_slopes=torch.rand(shape, device="cuda", generator=gs) * 0.25 + 2.0 ** -8)
    if spec.get("sinks"):  # one logit per query head, about the scores' size
        kw = dict(kw, sinks=torch.randn(q.shape[1], device="cuda", generator=torch.Generator("cuda").manual_seed(4)))
    if spec.get("bnhd"):
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        kw = dict(kw, layout="bnhd")
    g = torch.Generator("cuda").manual_seed(7)
    w_out = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
    prob = make_problem(q, k, v, **kw)
    w_lse = torch.randn(prob.B, prob.Hq, prob.Nq, device="cuda", generator=g)

    def loss(out, lse):
        return (out.float() * w_out.float()).sum() + torch.where(torch.isinf(lse), 0.0, lse * w_lse).sum()

    sinks = kw.get("sinks")  # a leaf of its own in each computation below, its gradient judged as q's, k's, v's
    names = ("q", "k", "v") + (() if sinks is None else ("sinks",))

    def leaves_of(ts, sinks_dtype=None):
        x = [t.clone().requires_grad_() if sinks_dtype is None else t.to(sinks_dtype).requires_grad_() for t in ts]
        return x + ([] if sinks is None else [sinks.to(sinks_dtype or sinks.dtype).clone().requires_grad_()])

    def kw_of(x):
        return kw if sinks is None else dict(kw, sinks=x[3])

    leaves = leaves_of((q, k, v))
    prev, before = hopper.set_mode("sync"), hb.launches
    try:
        loss(*attnlab.attention(*leaves[:3], backend="triton", return_lse=True, **kw_of(leaves))).backward()
    finally:
        hopper.set_mode(prev)
    runs = 0 if spec.get("portable") else 1
    assert hb.launches == before + runs, "the backward did not run the kernel the case names"
    ref = leaves_of((q, k, v), torch.float64)
    loss(*attnlab.reference(*ref[:3], **kw_of(ref))).backward()
    base = leaves_of((q, k, v))  # autograd of the textbook in the same dtype
    bprob = make_problem(*base[:3], **kw_of(base))
    out, lse = softmax_rows(masked_scores(bprob, 0, bprob.Nq, q.dtype), bprob.v, bprob.group,
                            None if sinks is None else base[3])
    if spec.get("bnhd"):
        out = out.transpose(1, 2)
    loss(out, lse).backward()
    for name, a, r, b in zip(names, leaves, ref, base):
        assert torch.isfinite(a.grad).all(), f"d{name} has NaN/Inf"
        err = (a.grad.double() - r.grad).abs().max().item()
        base_err = (b.grad.double() - r.grad).abs().max().item()
        assert err <= 2 * base_err + 1e-2 * r.grad.abs().max().item(), f"d{name}: {err:.3g} vs {base_err:.3g}"
    if case == "causal_br_long_q":  # rows 0..Nq - Nk - 1 see no key: dq is exactly 0 there
        empty = spec["shape"]["Nq"] - spec["shape"]["Nk"]
        assert not leaves[0].grad[:, :, :empty].any() and leaves[0].grad[:, :, empty].any()
    if case == "window_off_diagonal_tl":  # keys i + 70 .. i + 200: rows from Nk - 70 on see none
        assert not leaves[0].grad[:, :, 230:].any() and leaves[0].grad[:, :, 229].any()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("order, parts", [(0, None), (1, None), (2, None), (0, 1), (2, 2)])
def test_the_hopper_backward_matches_the_portable_one(order, parts, monkeypatch):
    """On a larger causal GQA case the two backwards agree to float32 sums in another order, rounded once, in
    each order of the programs, the group split by rule (4 parts: 128 programs whole), whole or in 2."""
    monkeypatch.setattr(hb, "ORDER", order)
    monkeypatch.setattr(hb, "SPLIT", parts)
    q, k, v = _qkv(B=2, Hq=16, Hkv=4, Nq=2048, Nk=2048, device="cuda", seed=9)
    dout = torch.randn_like(q)
    grads = []
    for mode in ("sync", "0"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        prev, before = hopper.set_mode(mode), hb.launches
        try:
            attnlab.attention(*leaves, backend="triton", causal=True).backward(dout)
        finally:
            hopper.set_mode(prev)
        assert hb.launches == before + (mode == "sync")
        grads.append([t.grad.float() for t in leaves])
    for name, a, b in zip("qkv", *grads):
        err = (a - b).abs().max().item()
        assert err <= 2e-2 * b.abs().max().item(), f"d{name}: {err:.3g}"


@pytest.mark.gpu
@needs_sm90
def test_relaunches_of_a_compiled_variant_and_repeat_runs():
    """A variant's later calls (other shapes) take the compiled kernel's own launcher; two runs of one call give
    bitwise the same dK and dV (summed in registers in a fixed order: a race in the kernel's buffers shows here)
    and dQ within its reduce-adds' order."""
    prev = hopper.set_mode("sync")
    try:
        results = []
        for Nq, Nk in ((300, 300), (1000, 700), (1000, 700)):  # the last shape twice
            q, k, v = _qkv(B=2, Hq=8, Nq=Nq, Nk=Nk, device="cuda", seed=11)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            before = hb.launches
            attnlab.attention(*leaves, backend="triton", causal=True, align="bottom_right").backward(
                torch.ones_like(q))
            assert hb.launches == before + 1
            results.append([t.grad for t in leaves])
        assert hb._variant(make_problem(q, k, v, causal=True, align="bottom_right")) in hb._kernels
    finally:
        hopper.set_mode(prev)
    (dq1, dk1, dv1), (dq2, dk2, dv2) = results[1], results[2]
    assert torch.equal(dk1, dk2) and torch.equal(dv1, dv2)
    assert (dq1.float() - dq2.float()).abs().max().item() <= 1e-2 * dq1.float().abs().max().item()


@pytest.mark.gpu
@needs_sm90
def test_alibi_relaunches_with_other_slopes_and_shapes_match_the_portable_backward():
    """One ALiBi variant launched three times (the JIT, then its own launcher with [Hq] and then [B, Hq] slopes of
    other strides, Nq != Nk): each call's gradients agree with the portable backward's."""
    prev = hopper.set_mode("sync")
    try:
        for Nq, Nk, per_batch in ((300, 300, False), (500, 700, False), (700, 500, True)):
            q, k, v = _qkv(B=2, Hq=8, Nq=Nq, Nk=Nk, device="cuda", seed=13)
            g = torch.Generator("cuda").manual_seed(Nq)
            shape = (8, 2) if per_batch else (8,)
            slopes = torch.rand(shape, device="cuda", generator=g) * 0.25 + 2.0 ** -8
            slopes = slopes.t() if per_batch else slopes  # [B, Hq] with strides (1, 2)
            kw = dict(causal=True, align="bottom_right", alibi_slopes=slopes)
            dout = torch.randn_like(q)
            grads = []
            for mode in ("sync", "0"):
                hopper.set_mode(mode)
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                before = hb.launches
                attnlab.attention(*leaves, backend="triton", **kw).backward(dout)
                assert hb.launches == before + (mode == "sync")
                grads.append([t.grad.float() for t in leaves])
            for name, a, b in zip("qkv", *grads):
                err = (a - b).abs().max().item()
                assert err <= 2e-2 * b.abs().max().item(), f"{Nq}x{Nk} d{name}: {err:.3g}"
        assert hb._variant(make_problem(q, k, v, **kw)) in hb._kernels
    finally:
        hopper.set_mode(prev)
