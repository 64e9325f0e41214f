"""attnlab.lessons.cuda_ladder on the host: the recorded ladder's ratios, from a file written the way measure()
writes it."""

from __future__ import annotations

import json

import pytest

from attnlab.lessons import cuda_ladder


def test_recorded_ratios_are_per_case_and_dtype(tmp_path):
    rows = [
        {"case": "a", "dtype": "float32", "backend": "cuda-rowmax", "passed": True, "graph_us": 100.0},
        {"case": "a", "dtype": "float32", "backend": "cuda-tiled", "passed": True, "graph_us": 150.0},
        {"case": "a", "dtype": "bfloat16", "backend": "cuda-rowmax", "passed": True, "graph_us": 80.0},
        {"case": "a", "dtype": "bfloat16", "backend": "cuda-mma", "passed": True, "graph_us": 20.0},
        {"case": "a", "dtype": "bfloat16", "backend": "sdpa-flash", "passed": True, "graph_us": 25.0},
        {"case": "a", "dtype": "bfloat16", "backend": "cuda-naive", "passed": False, "error": "x"},
    ]
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps({"environment": {}, "rows": rows}))
    df = cuda_ladder.recorded(path).set_index(["dtype", "backend"])
    assert df.loc[("float32", "cuda-tiled"), "x_rowmax"] == pytest.approx(1.5)
    assert df.loc[("bfloat16", "cuda-mma"), "x_rowmax"] == pytest.approx(0.25)
    assert df.loc[("bfloat16", "cuda-mma"), "flash_over_this"] == pytest.approx(1.25)
    assert df.loc[("float32", "cuda-tiled"), "flash_over_this"] != df.loc[("float32", "cuda-tiled"), "flash_over_this"]
    assert df.loc[("bfloat16", "cuda-naive"), "graph_us"] != df.loc[("bfloat16", "cuda-naive"), "graph_us"]  # NaN
    lad = cuda_ladder.recorded(path)
    got = cuda_ladder.over_rowmax("a", "bfloat16", lad)
    assert got.to_dict() == pytest.approx({"cuda-rowmax": 1.0, "cuda-mma": 0.25, "sdpa-flash": 0.3125})  # no naive
    assert cuda_ladder.over_rowmax("b", "float32", lad) is None


def test_nothing_recorded_is_none(tmp_path):
    assert cuda_ladder.recorded(tmp_path / "absent.json") is None


def test_environment_is_read_back(tmp_path):
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps({"environment": {"gpu": "X", "commit": "abc"}, "rows": []}))
    assert cuda_ladder.environment(path) == {"gpu": "X", "commit": "abc"}
    assert cuda_ladder.environment(tmp_path / "absent.json") == {}


def test_top_rungs_says_the_three_times_and_the_ratios(tmp_path):
    rows = [{"case": "c", "dtype": "bfloat16", "backend": b, "passed": True, "graph_us": us}
            for b, us in (("cuda-mma", 200.0), ("sdpa-flash", 300.0), ("triton", 150.0))]
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps({"environment": {"gpu": "G", "commit": "0123456789"}, "rows": rows}))
    got = cuda_ladder.top_rungs(path, case="c")
    assert got.startswith("On the G at commit 0123456, c in bfloat16: `cuda-mma` 0.200 ms")
    assert "1.50x FlashAttention-2's speed and 0.75x the Triton kernel's" in got
    path.write_text(json.dumps({"environment": {}, "rows": rows[:2]}))  # no triton row
    assert cuda_ladder.top_rungs(path, case="c") is None
    path.write_text(json.dumps({"environment": {}, "rows": [*rows[:2], {**rows[2], "passed": False}]}))
    assert cuda_ladder.top_rungs(path, case="c") is None  # a time is quoted only for an output that passed
    assert cuda_ladder.top_rungs(tmp_path / "absent.json") is None


def test_the_newest_record_is_a_whole_ladder_that_passed():
    lad = cuda_ladder.recorded(cuda_ladder.NEWEST)
    assert lad is not None and lad["passed"].all()
    assert set(lad["backend"]) >= {"cuda-naive", "cuda-tiled", "cuda-rowmax", "cuda-mma", "triton", "sdpa-flash"}
    assert cuda_ladder.top_rungs() is not None
