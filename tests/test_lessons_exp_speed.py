"""attnlab.lessons.exp_speed: the recorded timing read back on the host, and (marked gpu) measured."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.lessons import exp_speed


def test_recorded_rows_are_read_relative_to_exp2f(tmp_path):
    path = tmp_path / "exp.json"
    rows = [{"variant": "CUDA expf (accurate)", "ms": 3.0, "passed": True},
            {"variant": "CUDA exp2f", "ms": 1.5, "passed": True},
            {"variant": "Triton tl.exp", "passed": False, "max_rel_err": 1.0}]
    path.write_text(json.dumps({"environment": {"gpu": "X", "commit": "abc"}, "rows": rows}))
    got = exp_speed.recorded(path)
    assert got.loc["CUDA expf (accurate)", "x exp2f"] == pytest.approx(2.0)
    assert got.loc["Triton tl.exp", "x exp2f"] != got.loc["Triton tl.exp", "x exp2f"]  # not timed: NaN
    assert exp_speed.environment(path)["gpu"] == "X"
    assert exp_speed.recorded(tmp_path / "absent.json") is None and exp_speed.environment(tmp_path / "no") == {}


@pytest.mark.gpu
def test_every_variant_passes_and_is_timed_on_the_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    rows = exp_speed.measure(tmp_path / "exp.json")
    assert len(rows) == len(exp_speed.CUDA_VARIANTS) + 2
    assert all(r["passed"] and r["ms"] > 0 for r in rows), rows
