"""attnlab.precision: the emulated roundings against known values."""

import pytest
import torch

from attnlab.lessons import precision


def test_round_mantissa():
    x = torch.tensor([1.0, 1 + 2**-11, 1 + 3 * 2**-11, -1 - 3 * 2**-11, float("inf"), float("nan")])
    r = precision.round_to_tf32(x)
    assert r[:4].tolist() == [1.0, 1.0, 1 + 2**-9, -1 - 2**-9]  # ties to even
    assert torch.isinf(r[4]) and torch.isnan(r[5])
    y = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(precision.round_mantissa(y, 7), y.bfloat16().float())
    assert torch.equal(precision.round_mantissa(y, 23), y)


def test_tf32_fails_the_float32_tolerance_and_ieee_passes():
    t = precision.tf32_effect(H=2, N=64, D=32)
    assert list(t["passed"]) == [True, False]


def test_scale_rounding_is_exact_for_powers_of_two():
    assert precision.scale_rounding(64, torch.bfloat16) == 0.0
    assert precision.scale_rounding(128, torch.bfloat16) > 0.5


def test_fast_exp_error_grows_with_the_argument():
    t = precision.exp_error_table((-1.0, -60.0))
    assert (t["cpu_exp_ulp"] < 2).all()
    assert t["fast_exp_emulated_ulp"].iloc[1] > t["fast_exp_emulated_ulp"].iloc[0]
    assert (t["fast_exp_emulated_ulp"] <= 2 + 1.173 * t["x"].abs() + 1).all()


def test_error_sweep_relative_columns():
    df = precision.error_sweep(Ns=(16, 32), Ds=(16,), dtypes=(torch.float32,), H=1)
    assert (df["max_rel"] == df["max_abs"] / df["ref_max"]).all()
    assert (df["rel_tolerance"] == df["tolerance"] / df["ref_max"]).all()


def test_the_recorded_gpu_precision_reads_back_and_speaks_from_its_data(tmp_path):
    from attnlab.lessons import precision_gpu

    assert precision_gpu.recorded(tmp_path / "none.json") is None
    rec = precision_gpu.recorded()
    if rec is None:
        pytest.skip("no recorded GPU precision (a wheel without data/)")
    assert set(rec["exp"]["x"]) == {x0 for x0, _ in precision.exp_inputs()}  # the emulation's inputs
    text = precision_gpu.verdict(rec)
    worst = rec["exp"]["cuda_fast_expf_ulp"].max()
    assert f"at most {worst:.1f} ulp" in text and rec["environment"]["gpu"] in text
