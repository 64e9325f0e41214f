"""The public API: validation of bad input, the torch and sdpa backends, the checker and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import attnlab
from attnlab.cases import Case, default_cases, make_inputs
from attnlab.check import compare, strict_fp32, summarize, tf32_enabled, verify


def qkv(B=2, Hq=4, Hkv=2, Nq=8, Nk=8, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Hq, Nq, D, generator=g).to(dtype),
        torch.randn(B, Hkv, Nk, D, generator=g).to(dtype),
        torch.randn(B, Hkv, Nk, D, generator=g).to(dtype),
    )


# ---- bad input: every rule of the contract has a clear error ---------------------------------------------
BAD = [
    # (description, builder returning (q, k, v, kwargs), exception, words the message must contain)
    ("rank", lambda: (*(t[0] for t in qkv()), {}), ValueError, ["rank 4"]),
    ("not a tensor", lambda: ([1.0], *qkv()[1:], {}), TypeError, ["torch.Tensor"]),
    ("D mismatch", lambda: (qkv()[0], *qkv(D=8)[1:], {}), ValueError, ["head dim", "16", "8"]),
    ("D > 256", lambda: (*qkv(D=260), {}), ValueError, ["[1, 256]", "260"]),
    ("Hq % Hkv", lambda: (*qkv(Hq=3, Hkv=2), {}), ValueError, ["multiple", "Hq=3", "Hkv=2"]),
    ("k/v shape", lambda: (*qkv()[:2], qkv(Nk=9)[2], {}), ValueError, ["all but the head dim"]),
    ("Dv > 256", lambda: (*qkv()[:2], qkv(D=260)[2], {}), ValueError, ["Dv", "[1, 256]", "260"]),
    ("batch", lambda: (qkv(B=3)[0], *qkv()[1:], {}), ValueError, ["batch"]),
    ("dtype mismatch", lambda: (qkv()[0].half(), *qkv()[1:], {}), TypeError, ["one dtype"]),
    ("float64", lambda: (*qkv(dtype=torch.float64), {}), TypeError, ["float32, float16, bfloat16"]),
    ("int dtype", lambda: (*(t.int() for t in qkv()), {}), TypeError, ["float32"]),
    ("layout", lambda: (*qkv(), {"layout": "nhd"}), ValueError, ["layout", "bhnd", "bnhd"]),
    ("backend", lambda: (*qkv(), {"backend": "flash9"}), ValueError, ["unknown backend", "sdpa"]),
    ("kv_len range", lambda: (*qkv(), {"kv_len": [3, 9]}), ValueError, ["kv_len", "[0, 8]", "9"]),
    ("kv_len negative", lambda: (*qkv(), {"kv_len": torch.tensor([-1, 2])}), ValueError, ["[0, 8]"]),
    ("kv_len shape", lambda: (*qkv(), {"kv_len": torch.tensor([1, 2, 3])}), ValueError, ["[B] = [2]"]),
    ("kv_len len", lambda: (*qkv(), {"kv_len": [1, 2, 3]}), ValueError, ["B = 2"]),
    ("kv_len float", lambda: (*qkv(), {"kv_len": torch.tensor([1.0, 2.0])}), TypeError, ["integer"]),
    ("q_len range", lambda: (*qkv(), {"q_len": 12}), ValueError, ["q_len", "[0, 8]"]),
    ("mask shape", lambda: (*qkv(), {"mask": torch.ones(3, 8, dtype=torch.bool)}), ValueError, ["broadcast"]),
    ("mask rank", lambda: (*qkv(), {"mask": torch.ones(1, 1, 1, 8, 8, dtype=torch.bool)}), ValueError, ["rank 5"]),
    ("mask dtype", lambda: (*qkv(), {"mask": torch.ones(8, 8, dtype=torch.int32)}), TypeError, ["bool", "floating"]),
    ("ambiguous align", lambda: (*qkv(Nq=4), {"causal": True}), ValueError, ["top_left", "bottom_right", "4 != 8"]),
    ("ambiguous window", lambda: (*qkv(Nq=4), {"window": (2, 2)}), ValueError, ["ambiguous"]),
    ("align value", lambda: (*qkv(), {"causal": True, "align": "center"}), ValueError, ["align", "top_left"]),
    ("window type", lambda: (*qkv(), {"window": 3}), TypeError, ["pair"]),
    ("window side", lambda: (*qkv(), {"window": (1.5, None)}), TypeError, ["left"]),
    ("scale", lambda: (*qkv(), {"scale": float("nan")}), TypeError, ["scale"]),
    ("causal type", lambda: (*qkv(), {"causal": "yes"}), TypeError, ["causal"]),
]


@pytest.mark.parametrize("name,build,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_a_clear_message(name, build, exc, words):
    q, k, v, kw = build()
    with pytest.raises(exc) as err:
        attnlab.attention(q, k, v, **kw)
    for w in words:
        assert w in str(err.value), f"{name}: {w!r} not in {err.value!s}"


def test_mask_on_another_device_is_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="device"):
        attnlab.attention(q, k, v, mask=torch.ones(8, 8, dtype=torch.bool, device="meta"))


def test_unavailable_backend_says_why():
    status = attnlab.backends()
    for name, a in status.items():
        if not a.available:
            assert a.reason
            with pytest.raises(ValueError, match="unavailable"):
                attnlab.attention(*qkv(), backend=name)


# ---- behaviour ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "sdpa", "reference", "auto"])
def test_output_has_q_dtype_layout_and_no_nan_on_empty_rows(backend):
    q, k, v = qkv(Nq=6, Nk=10, dtype=torch.bfloat16)
    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse = attnlab.attention(qn, kn, vn, layout="bnhd", causal=True, align="bottom_right",
                                 kv_len=[10, 3], backend=backend, return_lse=True)
    assert out.shape == qn.shape and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # batch 1: Lk = 3, Lq = 6 -> diagonal offset -3: rows 0..2 see no key
    assert torch.equal(out[1, :3].float(), torch.zeros_like(out[1, :3].float()))
    assert torch.isneginf(lse[1, :, :3]).all()


def test_zero_sizes():
    q, k, v = qkv(Nk=0)
    out, lse = attnlab.attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    q, k, v = qkv(Nq=0)
    assert attnlab.attention(q, k, v).shape == (2, 4, 0, 16)


def test_torch_and_sdpa_pass_verify_on_every_case():
    df = verify(backends=["torch", "sdpa"])
    assert len(df) == 2 * sum(len(c.dtypes) for c in default_cases())
    assert df["passed"].all(), summarize(df)
    assert (df["nan"] == 0).all()


def test_verify_catches_a_wrong_backend(monkeypatch):
    """The checker must be able to fail: a backend that swaps b and h in its output is caught."""
    from attnlab.backends.textbook import TextbookBackend

    class Swapped(TextbookBackend):
        name = "swapped"

        def forward(self, prob, out, lse):
            super().forward(prob, out, lse)
            out.copy_(out.flip(0))

    from attnlab import backends as reg

    monkeypatch.setitem(reg.registry(), "swapped", Swapped())
    df = verify(backends=["swapped"], cases=[Case("dense", B=2)], dtypes=[torch.float32], seed=0)
    assert not df["passed"].any()


def test_poison_exposes_unwritten_outputs(monkeypatch):
    from attnlab.backends.textbook import TextbookBackend

    class Lazy(TextbookBackend):
        name = "lazy"

        def forward(self, prob, out, lse):
            tmp = torch.empty_like(out)
            super().forward(prob, tmp, lse)
            out[:, :, :-1] = tmp[:, :, :-1]  # forgets the last row

    from attnlab import backends as reg

    monkeypatch.setitem(reg.registry(), "lazy", Lazy())
    df = verify(backends=["lazy"], cases=[Case("dense", B=1, Nq=9)], dtypes=[torch.float32], seed=0)
    assert not df["passed"].any() and (df["nan"] > 0).all()


def test_compare_criteria():
    ref = torch.linspace(-1, 1, 100, dtype=torch.float64).reshape(1, 1, 10, 10)
    good = ref.to(torch.float32)
    assert compare(good, ref).passed
    bad = good.clone()
    bad[0, 0, 3, 7] += 1e-3
    rep = compare(bad, ref)
    assert not rep.passed and rep.worst == (0, 0, 3, 7) and abs(rep.max_abs - 1e-3) < 1e-6
    nan = good.clone()
    nan[0, 0, 0, 0] = float("nan")
    rep = compare(nan, ref)
    assert not rep.passed and rep.nan_count == 1
    # baseline criterion: an output twice as bad as the baseline (plus floor) fails even within atol
    half_ref = ref.to(torch.bfloat16)
    base = (ref + 1e-3).to(torch.bfloat16)
    worse = (ref + 0.03).to(torch.bfloat16)
    rep = compare(worse, ref, base=base)
    assert rep.abs_rel_passed and rep.baseline_passed is False and not rep.passed
    assert compare(half_ref, ref, base=base).passed
    assert "FAIL" in repr(rep) and "baseline" in repr(rep)


def test_strict_fp32_turns_tf32_off_and_restores():
    before_prec = torch.get_float32_matmul_precision()
    with strict_fp32():
        assert not tf32_enabled()
    assert torch.get_float32_matmul_precision() == before_prec


def test_inputs_keep_their_strides():
    q, _k, _v, _ = make_inputs(Case("x", view="strided_d", D=8), dtype=torch.float32, device="cpu", seed=0)
    assert q.stride(-1) != 1
    q, _k, _v, _ = make_inputs(Case("x", view="transposed"), dtype=torch.float32, device="cpu", seed=0)
    assert not q.is_contiguous()


def test_cli_info_and_check():
    env_py = [sys.executable, "-m", "attnlab"]
    res = subprocess.run([*env_py, "info"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "torch" in res.stdout and "sdpa" in res.stdout and "backends:" in res.stdout
    from attnlab import sdpa_provider

    provider_line = "registered flash provider of SDPA (inactive" if sdpa_provider.available() else "no SDPA provider"
    assert provider_line in res.stdout
    res = subprocess.run([*env_py, "check", "--backends", "torch", "--seed", "1"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "torch:" in res.stdout and "passed" in res.stdout


def test_auto_picks_by_device_and_dtype():
    from attnlab.backends import resolve
    from attnlab.problem import make_problem

    assert resolve("auto", make_problem(*qkv())).name == "sdpa"
    q, k, v = qkv()
    q[0, 0, 1, 2] = float("nan")
    assert resolve("auto", make_problem(q, k, v)).name == "reference"  # SDPA on CPU may turn a NaN row into 0


@pytest.mark.gpu
def test_auto_on_gpu_prefers_the_measured_fastest():
    from attnlab.backends import resolve, status
    from attnlab.problem import make_problem

    st = status()
    half = make_problem(*(t.cuda() for t in qkv(Nq=40, Nk=40, dtype=torch.bfloat16)))  # a prefill: Nq > 16
    decode = make_problem(*(t.cuda() for t in qkv(Nq=1, Nk=40, dtype=torch.bfloat16)))
    fp32 = make_problem(*(t.cuda() for t in qkv()))
    if st["triton"].available:
        assert resolve("auto", half).name == "triton"
        assert resolve("auto", decode).name == "triton-decode"
    if st["cuda-rowmax"].available:
        assert resolve("auto", fp32).name == "cuda-rowmax"


@pytest.mark.parametrize("backend", ["reference", "torch", "sdpa", "triton"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_in_the_inputs_propagates(backend, where):
    """NaN in the inputs is the caller's and propagates (docs/contract.md): the affected rows come back NaN, not
    0 as an empty row would; every other element is untouched."""
    if backend not in attnlab.backends():
        pytest.skip(f"backend {backend} not in this build")
    q, k, v = qkv(Hq=2, Hkv=2, Nq=20, Nk=20)
    # v: key 0, which every causal row sees (a NaN in V at a key a row does not attend reaches that row in
    # the reference's matmul as 0 * NaN, but not in kernels that never load it: the caller's problem).
    {"q": q, "k": k, "v": v}[where][1, 0, 0 if where == "v" else 7, 3] = float("nan")
    out, lse = attnlab.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    ref, _ = attnlab.reference(q, k, v, causal=True)
    # q NaN: row 7 only; k NaN: every row that sees key 7 (rows 7..19); v NaN: column 3 of every row
    rows = {"q": slice(7, 8), "k": slice(7, 20), "v": slice(0, 20)}[where]
    want = torch.zeros_like(ref, dtype=torch.bool)
    if where == "v":
        want[1, 0, rows, 3] = True
    else:
        want[1, 0, rows, :] = True
    assert torch.equal(torch.isnan(ref), want), "the reference itself must propagate exactly there"
    assert torch.equal(torch.isnan(out), want)
    assert torch.equal(torch.isnan(lse), want.any(-1) if where != "v" else torch.zeros_like(lse, dtype=torch.bool))
    assert torch.allclose(out[~want].double(), ref[~want], atol=1e-5), "the other elements are unaffected"


@pytest.mark.gpu
# Not "sdpa": its NaN handling is PyTorch's kernels'. On the H200 (torch 2.11, float32, causal) SDPA's
# output had a different NaN pattern than the contract's; attnlab only fixes SDPA's fully masked rows.
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda-naive", "cuda-tiled", "cuda-rowmax", "cuda-mma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_the_inputs_propagates_on_gpu(backend, dtype):
    if backend == "cuda-mma" and dtype == torch.float32:
        pytest.skip("cuda-mma takes 16-bit inputs only (its refusal: test_cuda.py)")
    q, k, v = (t.cuda() for t in qkv(B=2, Hq=4, Hkv=2, Nq=300, Nk=300, D=64, dtype=dtype))
    q[1, 2, 150, 3] = float("nan")  # query row 150 of head 2
    k[0, 1, 40, 5] = float("nan")  # key 40 of kv head 1 (query heads 2 and 3): rows 40.. see it
    out, lse = attnlab.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    want = torch.zeros(out.shape, dtype=torch.bool, device="cuda")
    want[1, 2, 150] = True
    want[0, 2:4, 40:] = True
    assert torch.equal(torch.isnan(out), want)
    assert torch.equal(torch.isnan(lse), want.any(-1))


@pytest.mark.parametrize("backend", ["reference", "torch", "sdpa", "triton", "auto"])
def test_differentiable_backends_carry_the_gradient(backend):
    q, k, v = (t.requires_grad_() for t in qkv(Hq=2, Hkv=1, Nq=9, Nk=9, D=8))
    out = attnlab.attention(q, k, v, causal=True, backend=backend)
    assert out.grad_fn is not None
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_a_backend_without_backward_refuses_inputs_that_require_grad(monkeypatch):
    from attnlab.backends import registry

    monkeypatch.setattr(registry()["torch"], "differentiable", False)  # stands in for a forward-only kernel
    q, k, v = qkv(Hq=2, Hkv=1, Nq=9, Nk=9, D=8)
    with pytest.raises(ValueError, match="has no backward"):
        attnlab.attention(q, k, v.requires_grad_(), backend="torch")
    with torch.no_grad():
        assert attnlab.attention(q, k, v, backend="torch").grad_fn is None  # no grad wanted: it runs
    bias = torch.zeros(1, 1, 9, 9, requires_grad=True)  # a bias that requires grad counts as well
    with pytest.raises(ValueError, match="has no backward"):
        attnlab.attention(q, k, v.detach(), mask=bias, backend="torch")
    assert attnlab.attention(q, k, v, backend="auto").grad_fn is not None


def test_auto_picks_a_differentiable_backend_when_grad_is_needed(monkeypatch):
    from attnlab import backends as B
    from attnlab.problem import make_problem

    prob = make_problem(*qkv())
    monkeypatch.setitem(B.AUTO_ORDER, ("cpu", "float32"), ("sdpa", "torch"))
    monkeypatch.setattr(B.registry()["sdpa"], "differentiable", False)
    assert B.resolve("auto", prob).name == "sdpa"
    assert B.resolve("auto", prob, needs_grad=True).name == "torch"
