"""attnlab.online_softmax: the streamed state equals the one-shot softmax, however the keys are split."""

import math

import pytest
import torch

from attnlab.lessons import online_softmax as osm


def _row(n=40, d=3, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    s = spread * torch.randn(n, generator=g, dtype=torch.float64)
    return s, torch.randn(n, d, generator=g, dtype=torch.float64)


def test_trace_ends_at_the_softmax():
    s, v = _row(12)
    t = osm.trace(s, v)
    assert len(t) == 12
    ref = torch.softmax(s, 0) @ v
    last = t[[f"out[{d}]" for d in range(v.shape[1])]].iloc[-1].tolist()
    assert last == pytest.approx([float(x) for x in ref], abs=1e-12)
    assert t["m"].iloc[-1] == pytest.approx(float(s.max()))
    assert list(t["m"]) == sorted(t["m"])  # the running max never decreases
    assert len(osm.trace(s, v, block=5)) == 3


@pytest.mark.parametrize("block", [1, 7, 40])
def test_state_matches_one_shot(block):
    s, v = _row()
    out, lse = osm.state_of(s, v, block).finalize()
    assert torch.allclose(out, torch.softmax(s, 0) @ v, atol=1e-12)
    assert float(lse) == pytest.approx(float(torch.logsumexp(s, 0)), abs=1e-12)


def test_merge_of_two_partial_states_equals_one_shot():
    s, v = _row(50)
    for cut in (0, 1, 17, 49, 50):
        merged = osm.merge(osm.state_of(s[:cut], v[:cut]), osm.state_of(s[cut:], v[cut:]))
        out, lse = merged.finalize()
        assert torch.allclose(out, torch.softmax(s, 0) @ v, atol=1e-12)
        assert float(lse) == pytest.approx(float(torch.logsumexp(s, 0)), abs=1e-12)


def test_split_k_with_masked_keys_and_empty_rows():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 30, generator=g, dtype=torch.float64)
    v = torch.randn(3, 30, 4, generator=g, dtype=torch.float64)
    s[1] = float("-inf")  # a fully masked row
    s[2, :20] = float("-inf")  # the first two of three splits see nothing
    out, lse = osm.split_k(s, v, 3)
    ref = osm.softmax_reference(s.unsqueeze(1), v).squeeze(1)
    assert not torch.isnan(out).any()
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.equal(out[1], torch.zeros(4, dtype=torch.float64))
    assert math.isinf(float(lse[1])) and float(lse[1]) < 0


def test_exp_counts_and_errors():
    g = torch.Generator().manual_seed(2)
    s = 3 * torch.randn(4, 64, generator=g, dtype=torch.float64)
    v = torch.randn(64, 8, generator=g, dtype=torch.float64)
    ref = osm.softmax_reference(s, v)
    out_e, n_e = osm.per_element(s, v)
    out_b, n_b = osm.block_rowmax(s, v, block=16)
    out_2, n_2 = osm.block_rowmax(s, v, block=16, use_exp2=True)
    assert n_e == 2 * 4 * 64
    assert n_b == n_2 == 4 * (64 + 4)
    for out in (out_e, out_b, out_2):
        assert (out.double() - ref).abs().max() < 1e-5
    table = osm.compare_variants(R=8, N=128, D=8, block=32)
    assert list(table["exp_per_score"].round(4)) == [2.0, 1.0312, 1.0312, 1.0]


def test_fully_masked_rows_give_zero_not_nan():
    s = torch.full((2, 8), float("-inf"), dtype=torch.float64)
    v = torch.ones(8, 3, dtype=torch.float64)
    for out, _ in (osm.per_element(s, v), osm.block_rowmax(s, v, 4), osm.block_rowmax(s, v, 4, use_exp2=True)):
        assert torch.equal(out, torch.zeros(2, 3, dtype=out.dtype))
    out, lse = osm.state_of(s, v.expand(2, 8, 3)).finalize()
    assert torch.equal(out, torch.zeros(2, 3, dtype=torch.float64)) and torch.isneginf(lse).all()
