"""attnlab.lessons.bench_order: the order-of-competitors experiment, read into one table."""

from __future__ import annotations

import json

import pytest

from attnlab.lessons import bench_order

BF16, FP16 = bench_order.CASES.values()


def _csv_rows(times):
    return [{"case": case, "backend": b, "ms": str(ms)} for case, per in times.items() for b, ms in per.items()]


def test_each_pair_is_the_rival_over_attnlab_with_whom_each_follows(tmp_path):
    runs = [
        {"name": "f", "order": "fixed", "backends": ["sdpa-flash", "cuda-mma", "sdpa-cudnn", "triton"],
         "rows": _csv_rows({BF16: {"cuda-mma": 2.0, "sdpa-flash": 3.0, "sdpa-cudnn": 1.0, "triton": 4.0},
                            FP16: {"cuda-mma": 1.0, "sdpa-flash": 1.0, "sdpa-cudnn": 2.0, "triton": 1.0}})},
        {"name": "s", "order": "shuffled per turn", "backends": ["cuda-mma", "sdpa-flash"],
         "rows": [{"case": c, "cuda-mma": {"ms": 1.0}, "sdpa-flash": {"ms": 1.5}} for c in (BF16, FP16)]},
    ]
    path = tmp_path / "order.json"
    path.write_text(json.dumps({"runs": runs}))
    t = bench_order.order_table(path)
    got = {(r["attnlab"], r["rule"]): r for r in t.to_dict("records")}
    assert set(got) == {("cuda-mma", "fixed"), ("triton", "fixed"), ("cuda-mma", "shuffled")}
    fixed = got[("cuda-mma", "fixed")]
    assert (fixed["attnlab follows"], fixed["rival follows"]) == ("sdpa-flash", "triton")  # cyclic: flash is first
    assert fixed["bf16 N16384 full"] == pytest.approx(1.5) and fixed["fp16 N16384 full"] == pytest.approx(1.0)
    assert got[("triton", "fixed")]["bf16 N16384 full"] == pytest.approx(0.25)
    assert got[("triton", "fixed")]["attnlab follows"] == "sdpa-cudnn"
    assert got[("cuda-mma", "shuffled")]["attnlab follows"] == "varies"
    assert got[("cuda-mma", "shuffled")]["bf16 N16384 full"] == pytest.approx(1.5)
    runs[1]["rows"] = runs[1]["rows"][:1]  # no fp16 row: the run times no pair on every case
    path.write_text(json.dumps({"runs": runs}))
    with pytest.raises(ValueError, match="run 's' times no pair"):
        bench_order.order_table(path)


def test_the_record_reads_as_the_decisions_log_says():
    t = bench_order.order_table()
    tri = t[(t["attnlab"] == "triton") & (t["rule"] == "fixed")].set_index("attnlab follows")
    assert tri.loc["sdpa-cudnn", "bf16 N16384 full"].max() == pytest.approx(0.884, abs=5e-4)
    assert tri["bf16 N16384 full"].min() == pytest.approx(0.864, abs=5e-4)
    assert tri["bf16 N16384 full"].max() == pytest.approx(0.982, abs=5e-4)
    mma = t[(t["attnlab"] == "cuda-mma") & (t["rule"] == "fixed")]
    assert mma["bf16 N16384 full"].max() == pytest.approx(1.133, abs=5e-4)
    assert mma[mma["attnlab follows"] == "triton"]["fp16 N16384 full"].min() == pytest.approx(0.895, abs=5e-4)
    assert "over 6 runs in a fixed order" in bench_order.summary(t)
