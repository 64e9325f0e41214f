"""Notebook 06's replay of the Triton guide's choices (attnlab.lessons.guide_quirks)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.lessons import guide_quirks as gq


def test_the_guide_loop_is_softmax_when_every_tile_has_a_key():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 10, generator=g, dtype=torch.float64)
    v = torch.randn(10, 4, generator=g, dtype=torch.float64)
    want = torch.softmax(s, 1) @ v
    for l_init in (0.0, 1.0):  # the first tile's alpha = 0 wipes the initial l_i out
        assert torch.allclose(gq.guide_loop(s * math.log2(math.e), v, 3, l_init), want, atol=1e-12)


def test_l_init_only_matters_where_the_loop_already_fails():
    t = gq.l_init_table()
    assert (t.iloc[0] < 1e-12).all()
    assert t.iloc[1:].isna().all().all()  # -inf - (-inf) on a masked first tile, whatever l_i started at


@pytest.mark.parametrize("D, wrong", [(64, False), (128, False), (96, True), (100, True)])
def test_unmasked_padding_mixes_rows_only_when_d_is_not_a_power_of_two(D, wrong):
    assert (gq.padded_head_dim_error(D) > 0.05) is wrong
    if not wrong:
        assert gq.padded_head_dim_error(D) < 1e-12


def test_head_maps_and_the_interleaved_mistake():
    m = gq.head_maps(8, 2)
    assert m["h // group"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and not m["same"].all()
    assert gq.head_maps(4, 4)["same"].all()  # MHA: both maps are the identity
    grouped, tiled = gq.interleaved_map_error()
    assert grouped < 1e-6 and tiled > 0.1


def test_headless_mqa_is_refused_with_a_reason_and_unsqueeze_is_the_call():
    r = gq.headless_mqa()
    assert r["head-less k"].startswith("ValueError") and "rank 4" in r["head-less k"]
    assert r["unsqueeze(1) is a view"] is True and r["max |MQA - repeated|"] < 1e-6
