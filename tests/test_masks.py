"""MaskSpec: the predicate, the loop bounds and the tile classifier agree with each other and the rule."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.masks import EMPTY, FULL, PARTIAL, MaskSpec


@st.composite
def specs(draw):
    B = draw(st.integers(1, 3))
    Nq, Nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["window"] = (draw(st.none() | st.integers(0, 12)), draw(st.none() | st.integers(0, 12)))
    if "causal" in kw or "window" in kw:
        kw["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):
        kw["kv_len"] = [draw(st.integers(0, Nk)) for _ in range(B)]
    if draw(st.booleans()):
        kw["q_len"] = [draw(st.integers(0, Nq)) for _ in range(B)]
    return MaskSpec.build(B, 2, Nq, Nk, **kw)


def test_rule_by_hand():
    # Nq=3, Nk=5, bottom-right causal: row i sees keys j <= i + 2.
    s = MaskSpec.build(1, 1, 3, 5, causal=True, align="bottom_right")
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(s.allowed()[0, 0], want)
    # top-left with Nq > Nk: rows past Nk see every key; window (1, 0): the diagonal and one before.
    s = MaskSpec.build(1, 1, 4, 4, window=(1, 0))
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(s.allowed()[0, 0], want)
    # padding: kv_len 2 and q_len 1 in batch 1
    s = MaskSpec.build(2, 1, 2, 3, kv_len=[3, 2], q_len=[2, 1])
    assert s.allowed()[1, 0].tolist() == [[True, True, False], [False, False, False]]
    # bottom-right uses the effective lengths: Lq=1, Lk=2 -> the only row sees keys 0..1
    s = MaskSpec.build(1, 1, 2, 3, causal=True, align="bottom_right", kv_len=[2], q_len=[1])
    assert s.allowed()[0, 0].tolist() == [[True, True, False], [False, False, False]]


def test_broadcast_mask_is_a_view():
    m = torch.rand(5, 7) < 0.5
    s = MaskSpec.build(2, 3, 5, 7, mask=m)
    assert s.mask.shape == (2, 3, 5, 7)
    assert s.mask.stride()[:2] == (0, 0)
    assert s.mask.untyped_storage().data_ptr() == m.untyped_storage().data_ptr()
    bias = torch.randn(1, 3, 1, 7, dtype=torch.float16)
    s = MaskSpec.build(2, 3, 5, 7, mask=bias)
    # the bias keeps the caller's dtype and storage (the kernels convert it in registers): no float32 copy
    assert s.bias.dtype == torch.float16 and s.bias.stride(0) == 0 and s.bias.stride(2) == 0
    assert s.bias.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
    assert s.bias_src is s.bias


@settings(max_examples=150, deadline=None)
@given(specs())
def test_key_range_covers_exactly_the_structural_keys(s):
    """Kernels loop over key_range: it must contain every allowed key and nothing outside [0, Lk)."""
    ok = s.allowed(explicit=False)
    _, lk = s.host_lengths()
    for b in range(s.B):
        for i0 in range(0, s.Nq, 7):
            i1 = min(s.Nq, i0 + 7)
            lo, hi = s.key_range(b, i0, i1)
            cols = ok[b, 0, i0:i1].any(dim=0).nonzero().flatten().tolist()
            if cols:
                assert lo <= min(cols) and max(cols) < hi
                # tight: the first and last allowed keys of the block are the bounds
                assert lo == min(cols) and hi == max(cols) + 1
            assert 0 <= lo and hi <= max(lo, lk[b])


@settings(max_examples=80, deadline=None)
@given(specs(), st.sampled_from([1, 4, 16]), st.sampled_from([1, 8, 16]))
def test_tile_classes_match_the_predicate(s, bm, bn):
    c = s.tile_classes(bm, bn)
    ok = s.allowed(explicit=False)
    for t in range(c.shape[2]):
        for u in range(c.shape[3]):
            block = ok[:, 0, t * bm : (t + 1) * bm, u * bn : (u + 1) * bn]
            for b in range(s.B):
                want = FULL if block[b].all() else PARTIAL if block[b].any() else EMPTY
                assert int(c[b, 0, t, u]) == want


def test_tile_classes_see_explicit_masks():
    m = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    m[..., :4, :4] = False
    s = MaskSpec.build(1, 1, 8, 8, mask=m)
    assert s.tile_classes(4, 4).flatten().tolist() == [EMPTY, FULL, FULL, FULL]
    assert s.tile_classes(4, 4, explicit=False).flatten().tolist() == [FULL] * 4
    bias = torch.zeros(8, 8)
    bias[4:, 4:] = float("-inf")
    s = MaskSpec.build(1, 1, 8, 8, mask=bias)
    assert s.tile_classes(4, 4).flatten().tolist() == [FULL, FULL, FULL, EMPTY]


def test_causal_saves_about_half_the_tiles():
    s = MaskSpec.build(1, 1, 1024, 1024, causal=True)
    w = s.work_fraction(64, 64)
    assert abs(w["empty"] - (15 * 16 / 2) / 256) < 1e-9
    assert abs(w["partial"] - 16 / 256) < 1e-9


def test_kind_names():
    assert MaskSpec.build(1, 1, 4, 4).kind == "dense"
    assert MaskSpec.build(1, 1, 4, 4, causal=True).kind == "causal"
    assert MaskSpec.build(1, 1, 4, 6, causal=True, align="bottom_right", kv_len=[3]).kind == "causal_br+kv_len"
    assert MaskSpec.build(1, 1, 4, 4, window=(2, 2), mask=torch.zeros(4, 4)).kind == "window+bias"


def test_predicate_is_built_on_the_inputs_device():
    """A spec with no length or mask tensors must still build its predicate where the inputs are
    (a CPU predicate against CUDA scores broke the reference on GPU). 'meta' stands in for a GPU here."""
    s = MaskSpec.build(1, 1, 4, 4, causal=True, device="meta")
    assert s.allowed().device.type == "meta"
    assert s.lengths()[0].device.type == "meta"


def test_lengths_are_contiguous_int32_even_from_a_scalar_tensor():
    """Kernels index kv_len[b] as a plain array: a 0-dim tensor must not arrive as a stride-0 view."""
    s = MaskSpec.build(3, 1, 4, 6, kv_len=torch.tensor(5, dtype=torch.int32),
                       q_len=torch.tensor([1, 9, 2, 9, 3], dtype=torch.int32)[::2])
    for t in (s.kv_len, s.q_len):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.stride() == (1,)
        assert t.untyped_storage().nbytes() == 3 * 4
    assert s.kv_len.tolist() == [5, 5, 5]
