"""The front door on every correct install: the CLI's checks, auto and NaN, argument types, no triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import attnlab

CLI = [sys.executable, "-m", "attnlab"]


@pytest.mark.parametrize("args", [
    ["check", "--scale", "-1"], ["check", "--scale", "0"], ["check", "--scale", "x"],
    ["bench", "--suite", "quick", "--device", "cpu", "--reps", "0"],
    ["bench", "--suite", "quick", "--device", "cpu", "--reps", "-1"],
    ["bench", "--suite", "quick", "--device", "cpu", "--min-reps", "0"],
    ["compile-check", "--jobs", "0"],
    ["check", "--backends", "no-such-backend"],
], ids=" ".join)
def test_bad_cli_values_are_one_line_errors(args):
    got = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, (got.stdout[-500:], got.stderr[-2000:])
    assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr, got.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine: the CUDA backends are unavailable there")
def test_check_refuses_a_backend_unavailable_here():
    got = subprocess.run([*CLI, "check", "--backends", "cuda-naive"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2 and "unavailable here" in got.stderr and len(got.stderr.splitlines()) == 1


def test_check_skips_what_a_backend_does_not_take_and_exits_0():
    """triton-decode refuses Nq > 16: its rows are skipped with the reason, not failed."""
    from attnlab.cases import Case

    cases = [Case("prefill", B=1, Hq=2, Nq=40, D=16, causal=True), Case("decode", B=1, Hq=2, Nq=2, Nk=40, D=16)]
    df = attnlab.check.verify(backends=["triton-decode", "torch"], cases=cases, device="cpu", seed=1,
                              dtypes=[torch.float32])
    dec = df[df["backend"] == "triton-decode"].set_index("case")
    assert dec.loc["prefill", "status"] == "skipped" and "16" in dec.loc["prefill", "error"]
    assert dec.loc["decode", "status"] == "ok"
    assert attnlab.check.all_passed(df)
    assert "1 skipped" in attnlab.check.summarize(df)


def test_attnlab_check_exits_0_on_this_machine():
    got = subprocess.run([*CLI, "check", "--backends", "torch", "triton-decode"], capture_output=True, text=True,
                         timeout=900)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-2000:]
    assert "skipped" in got.stdout


def test_auto_on_cpu_propagates_a_nan():
    """A NaN in one query row gives NaN in that row's output (SDPA's CPU kernel gave 0 there)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    q[0, 1, 3, 5] = float("nan")
    out, lse = attnlab.attention(q, k, v, return_lse=True)
    assert torch.isnan(out[0, 1, 3]).all() and torch.isnan(lse[0, 1, 3])
    assert not torch.isnan(out[0, 0]).any() and not torch.isnan(out[0, 1, :3]).any()


def test_auto_on_cpu_propagates_a_nan_in_a_key_and_keeps_sdpa_otherwise():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g, dtype=torch.bfloat16) for _ in range(3))
    clean = attnlab.attention(q, k, v, causal=True)
    assert torch.equal(clean, attnlab.attention(q, k, v, causal=True, backend="sdpa"))  # finite inputs: SDPA
    k[0, 0, 5, 0] = float("nan")
    out = attnlab.attention(q, k, v, causal=True)
    assert torch.isnan(out[0, 0, 5:]).all() and not torch.isnan(out[0, 0, :5]).any()  # the rows that see key 5


def test_return_lse_must_be_a_bool():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="return_lse"):
        attnlab.attention(q, q, q, return_lse=1)


def test_numpy_integers_are_taken_where_ints_are():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g) for _ in range(3))
    kw = dict(causal=True, window=(np.int64(4), None), kv_len=[np.int32(7), np.int64(12)], q_len=np.int64(9),
              scale=np.float32(0.25))
    plain = dict(causal=True, window=(4, None), kv_len=[7, 12], q_len=9, scale=0.25)
    assert torch.equal(attnlab.attention(q, k, v, backend="torch", **kw),
                       attnlab.attention(q, k, v, backend="torch", **plain))


def test_dense_k_with_a_block_table_names_the_cache_layout():
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 2, 8, 16)  # dense [B, Hkv, Nk, D]
    with pytest.raises(ValueError, match=r"paged caches \[num_blocks, block_size, Hkv, D\]"):
        attnlab.attention(q, k, k, block_table=torch.zeros(1, 2, dtype=torch.int32), kv_len=[8])


def test_import_and_cpu_backends_work_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as on a platform PyPI has no triton wheel for
        import torch, attnlab
        st = attnlab.backends()
        assert not st["triton"].available and "not installed" in st["triton"].reason, st["triton"]
        q = torch.randn(1, 2, 8, 16)
        for b in ("auto", "torch", "sdpa", "reference"):
            attnlab.attention(q, q, q, causal=True, backend=b)
        q.requires_grad_()
        attnlab.attention(q, q, q, causal=True).sum().backward()
        print("ok")
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0 and got.stdout.strip().endswith("ok"), got.stderr[-3000:]


def test_backends_say_what_each_takes():
    table = attnlab.backends()
    assert "Nq <= 16" in table.takes()["triton-decode"]
    assert "takes Nq <= 16" in repr(table)


def test_auto_on_cpu_keeps_sdpa_for_a_minus_inf_bias_and_leaves_it_for_nan():
    from attnlab.backends import resolve
    from attnlab.problem import make_problem

    q = torch.randn(1, 2, 8, 16)
    bias = torch.zeros(1, 1, 8, 8)
    bias[..., 3] = float("-inf")  # masks key 3: the contract's rule, not bad input
    assert resolve("auto", make_problem(q, q, q, mask=bias.expand(1, 2, 8, 8))).name == "sdpa"
    bias[0, 0, 2, 2] = float("nan")
    assert resolve("auto", make_problem(q, q, q, mask=bias)).name == "reference"


def test_auto_on_cpu_sees_a_nan_in_a_paged_cache():
    from attnlab.paged import to_paged

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    k[0, 1, 6, 0] = float("nan")
    kc, vc, bt = to_paged(k, v, 4)
    out = attnlab.attention(q, kc, vc, block_table=bt, kv_len=[16], causal=True)
    assert torch.isnan(out[0, 1, 6:]).all() and not torch.isnan(out[0, 0]).any()
