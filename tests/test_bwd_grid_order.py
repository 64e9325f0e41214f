"""attnlab.bench.bwd_grid_order's model of the dK/dV pass: the figures the decisions log quotes."""

from __future__ import annotations

import pytest

from attnlab.bench.bwd_grid_order import modeled_time


@pytest.mark.parametrize(("heads", "tiles", "group", "side_by_side", "outermost"), [
    (16, 32, 4, 1.281, 1.016),  # GQA 32/8 B2 N4096 with 128-key tiles: 512 programs
    (64, 32, 1, 1.070, 1.004),  # MHA B4 H16 N4096: 2,048 programs
    (8, 128, 4, 1.013, 1.005),  # GQA 32/8 B1 N16384: 1,024 programs
    (16, 32, 1, 1.281, 1.016),  # MHA B1 H16 N4096: 512 programs
])
def test_the_model_reads_as_the_decisions_log_says(heads, tiles, group, side_by_side, outermost):
    assert modeled_time(heads, tiles, group, False) == pytest.approx(side_by_side, abs=5e-4)
    assert modeled_time(heads, tiles, group, True) == pytest.approx(outermost, abs=5e-4)


def test_one_wave_takes_its_longest_program():
    assert modeled_time(132, 1, 3, False) == pytest.approx(1.0)  # equal programs, one each
    # 4 heads x 33 tiles on 132 SMs: the first key tile's 33 row tiles against a mean of 17
    assert modeled_time(4, 33, 1, False) == pytest.approx(33 / 17)
