"""attnlab.lessons.mma_steps: the tensor-core kernel's steps, each a ratio within one recorded run."""

from __future__ import annotations

import json
import math

import pytest

from attnlab.lessons import mma_steps


def _write(directory, rows_by_step, equal=True):
    for step, (name, before, after, _dims) in mma_steps.STEPS.items():
        rows = [{"dtype": dt, "N": N, "D": D, "causal": c, "flash_over": {before: b, after: a},
                 "equal": {before: True, after: equal}}
                for dt, N, D, c, b, a in rows_by_step[step]]
        (directory / name).write_text(json.dumps({"environment": {"gpu": "G", "commit": "abcdef0123"}, "rows": rows}))


def test_each_step_is_after_over_before_in_its_own_run(tmp_path):
    _write(tmp_path, {
        "pair stores": [("bfloat16", 1024, 64, True, 0.8, 1.0), ("bfloat16", 1024, 128, False, 0.5, 0.6),
                        ("float16", 1024, 64, True, 0.1, 9.0), ("bfloat16", 999, 64, False, 1.0, 1.0)],
        "whole-row stores": [("bfloat16", 1024, 64, True, 1.0, 1.1), ("bfloat16", 1024, 128, False, 1.0, 0.9)],
        "no rescale branch": [("bfloat16", 1024, 64, True, 1.0, 1.2), ("bfloat16", 1024, 128, False, 2.0, 1.0)],
    })
    t = mma_steps.step_speedups(tmp_path)
    assert list(t.index) == [(128, 1024, "full"), (64, 1024, "causal")]  # shapes every run has; D 128 first
    assert t.loc[(64, 1024, "causal"), "pair stores"] == pytest.approx(1.25)  # the float16 row is not read
    assert t.loc[(128, 1024, "full"), "whole-row stores"] == pytest.approx(0.9)
    assert math.isnan(t.loc[(128, 1024, "full"), "no rescale branch"])  # the step leaves D 128 as it was
    assert t.loc[(64, 1024, "causal"), "all steps"] == pytest.approx(1.25 * 1.1 * 1.2)
    assert t.loc[(128, 1024, "full"), "all steps"] == pytest.approx(1.2 * 0.9)
    assert mma_steps.environments(tmp_path) == dict.fromkeys(mma_steps.STEPS, "G, abcdef0")
    assert mma_steps.same_code_spread(tmp_path) == (pytest.approx(0.5), pytest.approx(0.5))  # D 128: 1.0 / 2.0


def test_a_record_whose_outputs_differ_or_repeat_a_shape_is_refused(tmp_path):
    one = {step: [("bfloat16", 1024, 64, True, 1.0, 1.1)] for step in mma_steps.STEPS}
    _write(tmp_path, one, equal=False)
    with pytest.raises(ValueError, match="the outputs of 'main' and 'pack2store' differ at \\(64, 1024, 'causal'\\)"):
        mma_steps.step_speedups(tmp_path)
    _write(tmp_path, {step: rows * 2 for step, rows in one.items()})
    with pytest.raises(ValueError, match="recorded twice"):
        mma_steps.step_speedups(tmp_path)


def test_the_recorded_steps_read_as_the_decisions_log_says():
    t = mma_steps.step_speedups()
    assert len(t) == 14 and set(t.index.get_level_values("D")) == {64, 128}
    # the stores paid most on the short rows, the branch on every D 64 row
    assert t.loc[(128, 1024, "full"), "pair stores"] > 1.1
    assert (t.xs(64, level="D")["no rescale branch"] > 1.02).all()
    assert t.xs(128, level="D")["no rescale branch"].isna().all()
    assert all(env.startswith("NVIDIA H100") for env in mma_steps.environments().values())
    lo, hi = mma_steps.same_code_spread()
    assert lo < 1 < hi and hi - lo < 0.05
