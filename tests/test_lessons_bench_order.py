"""attnlab.lessons.bench_order: the order-of-competitors experiment, read into one table."""

from __future__ import annotations

import json

import pytest

from attnlab.lessons import bench_order

BF16, FP16 = bench_order.CASES.values()


def _csv_rows(times):
    return [{"case": case, "backend": b, "ms": str(ms)} for case, per in times.items() for b, ms in per.items()]


def test_predecessors_cross_the_turns():
    turns = [["a", "b", "c"], ["c", "a", "b"], ["a", "c", "b"]]
    assert bench_order.predecessors(turns, "a") == ["c", "b"]  # after c in its turn; then the last of the one before
    assert bench_order.predecessors(turns, "c") == ["c", "a"]  # first in turn 1: after turn 0's last, itself


def test_each_pair_is_the_rival_over_attnlab_with_whom_each_follows(tmp_path):
    order = ["sdpa-flash", "cuda-mma", "sdpa-cudnn", "triton"]
    runs = [
        {"name": "f", "order": "fixed", "backends": order, "turn_orders": [order] * 3,
         "rows": _csv_rows({BF16: {"cuda-mma": 2.0, "sdpa-flash": 3.0, "sdpa-cudnn": 1.0, "triton": 4.0},
                            FP16: {"cuda-mma": 1.0, "sdpa-flash": 1.0, "sdpa-cudnn": 2.0, "triton": 1.0}})},
        {"name": "s", "order": "shuffled per turn, seed 0 for every case", "backends": ["cuda-mma", "sdpa-flash"],
         "turn_orders": [["cuda-mma", "sdpa-flash"], ["sdpa-flash", "cuda-mma"], ["sdpa-flash", "cuda-mma"]],
         "rows": [{"case": c, "cuda-mma": {"ms": 1.0}, "sdpa-flash": {"ms": 1.5}} for c in (BF16, FP16)]},
    ]
    path = tmp_path / "order.json"
    path.write_text(json.dumps({"runs": runs}))
    t = bench_order.order_table(path)
    got = {(r["attnlab"], r["rule"]): r for r in t.to_dict("records")}
    assert set(got) == {("cuda-mma", "fixed"), ("triton", "fixed"), ("cuda-mma", "one shuffle")}
    fixed = got[("cuda-mma", "fixed")]
    assert (fixed["attnlab follows"], fixed["rival follows"]) == ("sdpa-flash x2", "triton x2")
    assert fixed["bf16 N16384 full"] == pytest.approx(1.5) and fixed["fp16 N16384 full"] == pytest.approx(1.0)
    assert got[("triton", "fixed")]["bf16 N16384 full"] == pytest.approx(0.25)
    assert got[("triton", "fixed")]["attnlab follows"] == "sdpa-cudnn x2"
    shuffled = got[("cuda-mma", "one shuffle")]
    assert (shuffled["attnlab follows"], shuffled["rival follows"]) == ("sdpa-flash x2", "sdpa-flash, cuda-mma")
    runs[1]["rows"] = runs[1]["rows"][:1]  # no fp16 row: the run times no pair on every case
    path.write_text(json.dumps({"runs": runs}))
    with pytest.raises(ValueError, match="run 's' times no pair"):
        bench_order.order_table(path)


def test_the_record_reads_as_the_decisions_log_says():
    t = bench_order.order_table()
    tri = t[(t["attnlab"] == "triton") & (t["rule"] == "fixed")].set_index("attnlab follows")
    assert tri.loc["sdpa-cudnn x4", "bf16 N16384 full"].max() == pytest.approx(0.884, abs=5e-4)
    assert tri["bf16 N16384 full"].min() == pytest.approx(0.864, abs=5e-4)
    assert tri.loc["sdpa-flash x4", "bf16 N16384 full"] == pytest.approx(0.982, abs=5e-4)
    mma = t[(t["attnlab"] == "cuda-mma") & (t["rule"] == "fixed")].set_index("rival follows")
    assert mma.loc["triton x4", "bf16 N16384 full"].max() == pytest.approx(1.133, abs=5e-4)
    one = t[t["rule"] == "one shuffle"]
    assert set(one[one["attnlab"] == "triton"]["rival follows"]) >= {"triton x3, cuda-mma"}
    assert "over 6 runs, each in one fixed order" in bench_order.summary(t)


def test_the_spread_runs_read_as_the_decisions_log_says():
    t = bench_order.order_table()
    spread = t[t["rule"] == "spread"]
    assert len(spread) == 8  # four runs at ab1131d, each timing both pairs
    for follows in list(spread["attnlab follows"]) + list(spread["rival follows"]):
        assert " x3" not in follows and " x4" not in follows  # no predecessor in three of four later rounds
    mma = spread[spread["attnlab"] == "cuda-mma"]["bf16 N16384 full"]
    assert (mma.min(), mma.max()) == (pytest.approx(0.986, abs=5e-4), pytest.approx(1.074, abs=5e-4))
    tri = spread[spread["attnlab"] == "triton"]["bf16 N16384 full"]
    assert (tri.min(), tri.max()) == (pytest.approx(0.921, abs=5e-4), pytest.approx(0.971, abs=5e-4))
    assert "0.986x to 1.074x over 4 runs with the rounds spread" in bench_order.summary(t)


def test_on_the_bf16_row_the_spread_runs_land_inside_the_fixed_orders_range():
    t = bench_order.order_table()
    label = next(iter(bench_order.CASES))
    for _, g in t.groupby("attnlab"):
        fixed, spread = (g[g["rule"] == rule][label] for rule in ("fixed", "spread"))
        assert fixed.min() < spread.min() and spread.max() < fixed.max()
