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
