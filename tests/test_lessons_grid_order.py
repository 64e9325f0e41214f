"""attnlab.lessons.grid_order: the grid-order records read into one table, and the model's tails."""

from __future__ import annotations

import json

import pytest

from attnlab.lessons import grid_order


def test_the_records_read_as_the_decisions_log_says():
    t = grid_order.ab_table().set_index(["commit", "case"])
    assert t.loc[("bfd58f2", "bf16 b2 hq32 hkv8 n4096 d128 causal"), "dkdv"] == pytest.approx(1.151, abs=5e-4)
    assert t.loc[("bdd0553", "bf16 b4 hq16 hkv16 n4096 d128 full"), "all"] == pytest.approx(0.923, abs=5e-4)
    assert t.loc[("bfd58f2", "bf16 b4 hq32 hkv4 n2048 d128 causal"), "dK/dV programs per SM"] == pytest.approx(
        256 / 132)
    mha = t.loc[("b7b613e", "bf16 b1 hq16 hkv16 n4096 d128 causal")]
    assert (mha["dkdv"], mha["all"]) == (pytest.approx(1.134, abs=5e-4), pytest.approx(1.231, abs=5e-4))
    assert t.loc[("b7b613e", "bf16 b2 hq16 hkv16 n2048 d128 causal"), "all"] == pytest.approx(1.166, abs=5e-4)
    assert t.loc[("3453bb6", "bf16 b2 hq16 hkv16 n2048 d128 causal"), "all"] == pytest.approx(1.176, abs=5e-4)
    assert grid_order.summary(t.reset_index()).startswith(
        "On the causal rows whose dK/dV grid holds fewer than 6 programs per SM, the setting `auto` takes (the tiles "
        "outermost in each grid that short) read 1.135x to 1.264x (9 rows); on the other rows either setting read "
        "0.923x to 1.039x.")


def test_a_case_whose_orders_differ_is_left_out(tmp_path):
    row = {"case": "bf16 b1 hq4 hkv2 n256 d64 causal", "equal": True,
           "ms": {"none": 2.0, "dkdv": 1.0, "all": 4.0, "sdpa-cudnn": 1.0}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"environment": {"commit": "c"}, "rows": [row, {**row, "equal": False}]}))
    t = grid_order.ab_table((path,))
    assert len(t) == 1 and (t.loc[0, "dkdv"], t.loc[0, "all"], t.loc[0, "group"]) == (2.0, 0.5, 2)
    assert t.loc[0, "dK/dV programs per SM"] == pytest.approx(4 / 132)
    assert t.loc[0, "dQ programs per SM"] == pytest.approx(8 / 132)


def test_the_tail_shrinks_with_the_tiles_outermost():
    m = grid_order.model_table({"gqa": (16, 32, 4)})
    assert m.loc["gqa", "side by side"] > 1.2 > 1.05 > m.loc["gqa", "tiles outermost"]
