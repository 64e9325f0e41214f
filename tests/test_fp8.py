"""The FP8 forward (attnlab.fp8): float8_e4m3fn q, k, v with descales, through attnlab.attention.

The kernel runs in Triton's interpreter here; the GPU tests (marked ``gpu``) run it compiled where the GPU has an
8-bit MMA (compute capability 8.9+)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cases import Case, default_cases, gpu_cases, make_inputs, score_mod_cases
from attnlab.check import compare, verify

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attnlab.backends.triton import forward_kernel as fk  # noqa: E402
from attnlab.backends.triton.interpreter import interpreter  # noqa: E402

F8 = torch.float8_e4m3fn


def _inputs(seed=0, B=2, Hq=4, Hkv=2, Nq=37, Nk=45, D=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(F8)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(F8)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(F8)
    return q, k, v, g


def test_every_contract_case_passes_in_fp8_against_the_reference():
    """The kernel (interpreted), the textbook FP8 emulation and auto, on the default and score-modifier cases with
    per-head and per-tensor descales: both criteria of the checker, against float64 on the real values."""
    df = verify(["triton", "torch", "auto"], default_cases() + score_mod_cases(), device="cpu", dtypes=[F8])
    assert len(df) and (df.dtype == "float8_e4m3fn").all()
    bad = df[(df.status != "ok") & ~((df.status == "skipped") & (df.layout == "packed"))]  # (varlen takes no FP8)
    assert bad.empty, bad[["backend", "case", "status", "max_abs", "base_max_abs", "error"]].to_string()


def test_the_kernel_rounds_p_to_e4m3():
    """The kernel's P V takes P rounded to e4m3: its output matches a float64 emulation that rounds P (scaled as
    the kernel's, by the row max) to e4m3, much closer than the reference that keeps P exact."""
    q, k, v, _ = _inputs(B=1, Hq=1, Hkv=1, Nq=16, Nk=16, D=16)
    out = attnlab.attention(q, k, v, backend="triton").double()
    s = q.double() @ k.double().transpose(-1, -2) / 4
    p = torch.exp(s - s.amax(-1, keepdim=True))
    emulated = (p.float().to(F8).double() @ v.double()) / p.sum(-1, keepdim=True)
    exact = (p @ v.double()) / p.sum(-1, keepdim=True)
    assert (out - emulated).abs().max() < 2**-7  # the bfloat16 output's rounding
    assert (out - exact).abs().max() > 4 * (out - emulated).abs().max()


@triton.jit
def _rounding_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, fk._round_e4m3(tl.load(X + offs)))


def test_the_interpreters_rounding_to_e4m3_is_torchs():
    """The interpreter path rounds P by arithmetic (triton 3.9's interpreter loses the carry into the exponent):
    every e4m3 value in [0, 1], the midpoints between neighbours (ties to even) and a hair either side of each,
    and random values, round as torch rounds them."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(F8).float()  # every non-negative e4m3 value below 448
    grid = grid[grid <= 1.0]
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.rand(2000,
                   generator=torch.Generator().manual_seed(0)), torch.tensor([0.4897, 0.1220, 0.0091, 1e-30, 0.0])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    y = torch.empty_like(x)
    with interpreter(_rounding_kernel) as kernel:
        kernel[(1,)](x, y, N=n)
    want = x.to(F8).float()
    wrong = (y != want).nonzero().flatten()
    assert wrong.numel() == 0, [(float(x[i]), float(y[i]), float(want[i])) for i in wrong[:5]]


def test_descales_scale_what_they_say():
    """v's descale scales the output (exactly: a power of two), per tensor or per head alike; q's and k's scale
    the scores, as the reference on the real values has it; a number, a one-element tensor and a [B, H] tensor of
    that value are one call."""
    q, k, v, g = _inputs()
    base = attnlab.attention(q, k, v, backend="triton")
    assert base.dtype == torch.bfloat16
    assert torch.equal(attnlab.attention(q, k, v, v_descale=2.0, backend="triton"), 2 * base)
    per_head = torch.full((2, 2), 2.0)
    assert torch.equal(attnlab.attention(q, k, v, v_descale=per_head, backend="triton"), 2 * base)
    assert torch.equal(attnlab.attention(q, k, v, v_descale=torch.tensor([2.0]), backend="triton"), 2 * base)
    dq, dk = torch.rand(2, 4, generator=g) + 0.5, torch.rand(2, 2, generator=g) + 0.5
    out = attnlab.attention(q, k, v, q_descale=dq, k_descale=dk, backend="triton")
    ref, _ = attnlab.reference(q, k, v, q_descale=dq, k_descale=dk)
    real = [q.double() * dq[:, :, None, None], k.double() * dk[:, :, None, None], v.double()]
    by_hand, _ = attnlab.reference(*real)
    torch.testing.assert_close(ref, by_hand, atol=1e-12, rtol=0)
    base_torch = attnlab.attention(q, k, v, q_descale=dq, k_descale=dk, backend="torch")
    assert compare(out, ref, dtype=F8, base=base_torch).passed
    assert not compare(base, ref, dtype=F8, base=base_torch).passed  # (without the descales: far off)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy, on the NaN rows in the interpreter)
def test_nan_in_the_inputs_propagates():
    """A NaN code in q (or v) makes its row's output NaN, as the reference has it; nothing else changes. (Triton
    3.9's interpreter widens the e4m3 NaN codes to +-480: the kernel makes them NaN again there.)"""
    q, k, v, _ = _inputs()
    clean = attnlab.attention(q, k, v, backend="triton")
    q[0, 1, 5, 3] = float("nan")
    v[1, 0, 7, 2] = float("nan")
    out = attnlab.attention(q, k, v, backend="triton")
    ref, _ = attnlab.reference(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out).any()
    assert torch.equal(out[~torch.isnan(ref)], clean[~torch.isnan(ref)])


def test_the_emulation_rounds_p_before_normalizing():
    """The torch backend (the checker's FP8 baseline) rounds exp(s - row max), as the kernel does: over 2048 keys
    the normalized P would mostly fall under e4m3's smallest values and the baseline be far off."""
    q, k, v, _ = _inputs(B=1, Hq=1, Hkv=1, Nq=64, Nk=2048, D=16)
    ref, _ = attnlab.reference(q, k, v)
    emul = attnlab.attention(q, k, v, backend="torch")
    assert compare(emul, ref, dtype=F8).rel_l2 < 0.03


def test_q_descale_per_kv_head_is_flashattention3s_shape():
    """Under GQA a q descale of [B, Hkv] (FlashAttention-3's shape) is its query heads' [B, Hq] repeated."""
    q, k, v, g = _inputs()
    dq = torch.rand(2, 2, generator=g) + 0.5
    assert torch.equal(attnlab.attention(q, k, v, q_descale=dq, backend="triton"),
                       attnlab.attention(q, k, v, q_descale=dq.repeat_interleave(2, dim=1), backend="triton"))


def test_layout_lse_and_empty_rows():
    """bnhd in, bnhd out (bfloat16); lse float32 [B, Hq, Nq]; a row with no key gives 0 and lse -inf."""
    q, k, v, _ = _inputs()
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = attnlab.attention(qb, kb, vb, layout="bnhd", kv_len=[0, 45], return_lse=True, backend="triton")
    assert out.shape == qb.shape and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 37)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


def test_auto_on_cpu_is_the_emulation():
    q, k, v, _ = _inputs()
    prob = attnlab.problem.make_problem(q, k, v)
    assert attnlab.backends.resolve("auto", prob).name == "torch"


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(q_descale=2.0, dtype=torch.bfloat16), ValueError, "q_descale applies to float8_e4m3fn inputs only"),
        (dict(q_descale=2.0, block_table=torch.zeros(2, 1, dtype=torch.int32), dtype=torch.bfloat16), ValueError,
         "q_descale applies to float8_e4m3fn inputs only"),
        (dict(v_new=torch.zeros(2, 2, 1, 32)), ValueError, "k_new and v_new come together"),
        (dict(v_descale=torch.ones(3, 3)), ValueError, "[B, H] = [2, 2]"),
        (dict(k_descale="2"), TypeError, "number or a float tensor"),
        (dict(q_descale=float("nan")), ValueError, "finite"),
        (dict(backend="sdpa"), ValueError, "runs on reference, torch, triton"),
        (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "dense k and v"),
        (dict(mixed=True), TypeError, "share one dtype"),
    ],
)
def test_bad_fp8_calls_say_what_is_allowed(kwargs, error, words):
    q, k, v, _ = _inputs()
    kwargs = dict(kwargs)
    if "dtype" in kwargs:
        dt = kwargs.pop("dtype")
        q, k, v = (t.float().to(dt) for t in (q, k, v))
    if kwargs.pop("mixed", False):
        v = v.float().to(torch.bfloat16)
    with pytest.raises(error, match=re.escape(words)):
        attnlab.attention(q, k, v, **kwargs)


def test_inputs_that_require_grad_are_refused_not_detached():
    q, k, v, _ = _inputs()
    dq = torch.ones(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="no backward"):
        attnlab.attention(q, k, v, q_descale=dq)
    with torch.no_grad():
        assert attnlab.attention(q, k, v, q_descale=dq).dtype == torch.bfloat16


def test_packed_sequences_refuse_fp8():
    q = torch.randn(10, 2, 16).to(F8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="attention_varlen takes float32"):
        attnlab.attention_varlen(q, q, q, cu, cu, 6, 6)


def _count_nodes(gm, _inputs):
    _count_nodes.calls.append(
        [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "attnlab" in str(n.target)])
    return gm.forward


def test_compile_fullgraph_sees_one_fp8_op():
    q, k, v, _ = _inputs()
    dv = torch.rand(2, 2) + 0.5

    def f(q, k, v, dv):
        return attnlab.attention(q, k, v, causal=True, kv_len=[40, 7], align="bottom_right", q_descale=0.75,
                                 v_descale=dv, backend="triton")

    _count_nodes.calls = []
    torch._dynamo.reset()
    got = torch.compile(f, backend=_count_nodes, fullgraph=True)(q, k, v, dv)
    assert _count_nodes.calls == [["attnlab.attention_fp8"]], _count_nodes.calls
    assert torch.equal(got, f(q, k, v, dv))


_SM90 = """
import os, re, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch
from triton.backends.compiler import GPUTarget
from attnlab.backends.triton import cold_launch, configs, forward
from attnlab.problem import make_problem

F8 = torch.float8_e4m3fn
D = int(sys.argv[1])
q = torch.randn(1, 2, 256, D).to(F8)
prob = make_problem(q, q.clone(), q.clone(), causal=True, v_descale=0.5)
cfg = configs.candidates(prob.dtype, configs.padded_head_dim(D))[0]
head, mid, tail, constants = forward._arguments(prob, cfg, False, True)
args = forward._bind(head, mid, tail, torch.empty(1, 2, 256, D, dtype=torch.bfloat16), torch.empty(1, 2, 256))
kw = dict(constants, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **configs.COMPILE_OPTIONS)
compiled, _ = cold_launch.compile_only(forward._k.attn_fwd_kernel, args, kw, 0, target=GPUTarget("cuda", 90, 32))
print(" ".join(sorted(set(re.findall(r"wgmma\\.mma_async\\S*", compiled.asm["ptx"])))))
"""


@pytest.mark.parametrize("D", [16, 128])
def test_both_products_are_8_bit_wgmma_on_sm90(D):
    """Compiled for sm_90 (no GPU needed): Q K^T and P V are e4m3 x e4m3 warpgroup MMAs, nothing 16-bit. D 16
    compiles too: an 8-bit dot reduces over at least 32, so the kernel pads D to 32 for FP8."""
    from triton.runtime import jit

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    if not hasattr(jit, "compute_cache_key"):  # triton 3.4
        pytest.skip(f"triton {triton.__version__}'s JIT has no compute_cache_key, which the offline compile uses")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    got = subprocess.run([sys.executable, "-c", _SM90, str(D)], capture_output=True, text=True, env=env, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    forms = got.stdout.split()
    assert forms and all(f.endswith(".f32.e4m3.e4m3") for f in forms), forms
    if D == 128:  # Q K^T over BLOCK_N = 64 keys, P V over D = 128
        assert any(".m64n128k32." in f for f in forms) and any(".m64n64k32." in f for f in forms), forms


# ---- on a GPU ----------------------------------------------------------------------------------------------


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
def test_gpu_contract_in_fp8():
    """The compiled kernel on the GPU cases and the score-modifier cases, fresh inputs: both criteria."""
    if not _fp8_gpu():
        pytest.skip("FP8 needs compute capability 8.9+")
    df = verify(["triton"], gpu_cases() + score_mod_cases(), device="cuda", dtypes=[F8])
    bad = df[(df.status != "ok") & ~((df.status == "skipped") & (df.layout == "packed"))]
    assert len(df) and bad.empty, bad[["case", "status", "max_abs", "base_max_abs", "error"]].to_string()


@pytest.mark.gpu
@pytest.mark.parametrize("v_keys_contiguous", [False, True], ids=["v_dense", "v_keys_contiguous"])
def test_gpu_fp8_error_beside_a_bf16_call(v_keys_contiguous):
    """B2 H8 N1024 D128 causal: the FP8 call's error against float64 stays within the FP8 tolerance and within
    2x the textbook FP8 emulation's, and the bf16 call on the same real values is closer still (it keeps P in
    bf16). V handed over keys-contiguous (as Hopper's 8-bit MMA reads its second operand) gives the same output."""
    if not _fp8_gpu():
        pytest.skip("FP8 needs compute capability 8.9+")
    case = Case("fp8_gpu", B=2, Hq=8, Nq=1024, D=128, causal=True)
    q, k, v, kw = make_inputs(case, dtype=F8, device="cuda", seed=int.from_bytes(os.urandom(3), "little"))
    if v_keys_contiguous:
        v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = attnlab.attention(q, k, v, backend="triton", **kw)
    ref, _ = attnlab.reference(q, k, v, **kw)
    emul = attnlab.attention(q, k, v, backend="torch", **kw)
    rep = compare(out, ref, dtype=F8, base=emul)
    assert rep.passed, rep
    real = [(t.double() * d.double().view(*d.shape, 1, 1) if d.dim() == 2 else t.double() * d.double()).bfloat16()
            for t, d in zip((q, k, v), (kw["q_descale"], kw["k_descale"], kw["v_descale"]))]
    rest = {n: x for n, x in kw.items() if not n.endswith("descale")}
    bf16 = attnlab.attention(*real, backend="triton", **rest)
    ref_bf16, _ = attnlab.reference(*real, **rest)
    assert compare(bf16, ref_bf16).max_abs < rep.max_abs


def test_the_gpu_probe_says_in_one_line_what_it_needs(tmp_path, capsys):
    from attnlab.bench import fp8_probe

    if _fp8_gpu():
        pytest.skip("this machine can run the probe")
    assert fp8_probe.main([str(tmp_path / "fp8.json")]) == 2
    assert capsys.readouterr().err.strip().endswith("needs a GPU of compute capability 8.9 or newer (an 8-bit MMA)")
    assert not (tmp_path / "fp8.json").exists()


def test_compiled_calls_take_a_descale_number_that_changes():
    """A Python-number descale that changes between compiled calls (dynamo makes it symbolic) still traces as one
    op, without a graph break, and gives the eager result."""
    q, k, v, _ = _inputs()

    def f(q, k, v, s):
        return attnlab.attention(q, k, v, q_descale=s, backend="triton")

    _count_nodes.calls = []
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=_count_nodes, fullgraph=True)
    for s in (0.5, 0.75, 1.25):
        assert torch.equal(compiled(q, k, v, s), f(q, k, v, s))
    assert all(c == ["attnlab.attention_fp8"] for c in _count_nodes.calls), _count_nodes.calls


def test_the_emulation_merges_a_sink_after_rounding_as_the_kernel_does():
    """With a sink well above the scores, the emulation (the checker's baseline) still rounds P against the keys'
    max: rounded against the sink's, every P would fall under e4m3's range and the output to 0."""
    q, k, v, _ = _inputs(B=1, Hq=2, Hkv=2, Nq=40, Nk=40)
    sinks = torch.full((2,), 12.0)
    ref, _ = attnlab.reference(q, k, v, sinks=sinks)
    for backend in ("torch", "triton"):
        out = attnlab.attention(q, k, v, sinks=sinks, backend=backend)
        assert (out.double() - ref).abs().max() < 0.05 * ref.abs().max(), backend


def test_verify_lists_packed_cases_as_skipped_in_fp8():
    """FP8 asked of packed cases: a skipped row per backend with the reason, never an empty table that passes."""
    from attnlab.cases import varlen_cases

    df = verify(["triton", "torch"], varlen_cases()[:2], device="cpu", dtypes=[F8])
    assert len(df) == 4 and (df.status == "skipped").all()
    assert df.error.str.contains("attention_varlen takes no float8_e4m3fn").all()
