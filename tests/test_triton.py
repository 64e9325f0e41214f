"""Tests of the ``triton`` backend (attnlab/backends/triton/).

CPU tests run the kernel through Triton's interpreter (attnlab arranges that; nothing is set here) on
fresh random inputs, judged by the checker against the float64 reference. The default matrix and the
extra cases (``attnlab.cases``) run in tests/test_contract.py, as for every backend; here: what is
Triton's own (head dims, empty rows, NaN past kv_len, strided outputs, the interpreter, D chunks, both
orientations, the launch path).
GPU tests (marker ``gpu``) run the same matrix at larger sizes, sequences up to 16384, every autotune
candidate, and the TF32 opt-in at its own tolerance.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.backends.triton import backend as tbackend
from attnlab.backends.triton import configs as tconfigs
from attnlab.backends.triton import forward as tlaunch
from attnlab.backends.triton import forward_kernel as tkernel
from attnlab.backends.triton import runtime as truntime
from attnlab.cases import Case, chunk_cases, default_cases, extra_cases, long_cases, make_inputs
from attnlab.check import _lse_atol, compare, strict_fp32, summarize, verify
from attnlab.problem import make_problem

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HALVES = (F16, BF16)

EXTRA_CASES = extra_cases()


def _check_all(df) -> None:
    assert len(df) > 0
    assert df["passed"].astype(bool).all(), "\n" + summarize(df)


# ------------------------------------------------------------------------------------------------------
# CPU: the interpreter
# ------------------------------------------------------------------------------------------------------
def test_registered_and_available():
    table = attnlab.backends()
    assert "triton" in table
    assert table["triton"].available, table["triton"]


# The default matrix and the extra cases on CPU: tests/test_contract.py (every backend, every case list).


@pytest.mark.parametrize("D", [16, 40, 64, 100, 128])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_head_dims_cpu(D, dtype):
    case = Case(f"gqa_causal_br_d{D}", B=1, Hq=4, Hkv=2, Nq=19, Nk=36, D=D, causal=True, align="bottom_right",
                kv_len=(30,), dtypes=(dtype,))
    _check_all(verify(backends=["triton"], cases=[case], device="cpu"))


def _empty_row_inputs(device):
    """Rows with no allowed key of every kind: kv_len 0, q_len padding, an all-False mask row,
    bottom-right rows above the first key."""
    g = torch.Generator().manual_seed(0)
    B, H, Nq, Nk, D = 3, 2, 20, 12, 16
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(device) for n in (Nq, Nk, Nk))
    mask = torch.rand(B, 1, Nq, Nk, generator=g) < 0.8
    mask[:, :, 3] = False
    kw = dict(causal=True, align="bottom_right", kv_len=[0, 12, 7], q_len=[20, 15, 20], mask=mask.to(device))
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_empty_rows_zero_and_minus_inf(dtype):
    q, k, v, kw = _empty_row_inputs("cpu")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, lse = attnlab.attention(q, k, v, backend="triton", return_lse=True, **kw)
    ref, ref_lse = attnlab.reference(q, k, v, **kw)
    empty = torch.isinf(ref_lse)
    assert empty[0].all() and empty[1, :, 15:].all() and empty[:, :, 3].all() and empty[2, :, :13].all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[empty] == 0).all()
    assert (lse[empty] == float("-inf")).all()
    assert compare(out, ref, dtype=dtype)  # the rest is right too


def test_keys_past_kv_len_never_reach_the_arithmetic():
    """NaN in K and V past each batch's kv_len (padding of a KV cache) must not change one bit."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 2, 23, 16, generator=g), torch.randn(3, 2, 41, 16, generator=g), torch.randn(
        3, 2, 41, 16, generator=g)
    kv_len = [41, 17, 3]
    kw = dict(kv_len=kv_len, causal=True, align="bottom_right")
    clean = attnlab.attention(q, k, v, backend="triton", **kw)
    kp, vp = k.clone(), v.clone()
    for b, n in enumerate(kv_len):
        kp[b, :, n:] = float("nan")
        vp[b, :, n:] = float("nan")
    poisoned = attnlab.attention(q, kp, vp, backend="triton", **kw)
    assert torch.equal(clean, poisoned)


def test_strided_output_written_through_its_strides():
    """forward() writes a non-contiguous out view in place and leaves the gaps alone."""
    q, k, v, kw = _empty_row_inputs("cpu")
    prob = make_problem(q, k, v, **kw)
    big = torch.full((prob.B, prob.Nq, prob.Hq, 2 * prob.D), 7.0)
    out = big[..., ::2].transpose(1, 2)  # [B, Hq, Nq, D], strides (.., .., .., 2)
    lse_big = torch.full((prob.B, prob.Hq, prob.Nq, 3), 7.0)
    lse = lse_big[..., 1]
    tbackend.TritonBackend().forward(prob, out, lse)
    ref, ref_lse = attnlab.reference(q, k, v, **kw)
    assert compare(out, ref)
    assert compare(lse, ref_lse, atol=1e-4, rtol=0.0)
    assert (big[..., 1::2] == 7.0).all() and (lse_big[..., 0] == 7.0).all() and (lse_big[..., 2] == 7.0).all()


def test_no_hidden_contiguous_copies(monkeypatch):
    """Transposed, strided-D views and broadcast masks go to the kernel as they are."""
    case = Case("views", B=2, Hq=4, Hkv=2, Nq=21, Nk=27, D=40, layout="bnhd", view="strided_d",
                mask="bool_1h1k", kv_len=(27, 10))
    q, k, v, kw = make_inputs(case, dtype=F32, device="cpu", seed=3)
    ref, _ = attnlab.reference(q, k, v, **kw)

    def refuse(self, *args, **kwargs):
        raise AssertionError("a hidden .contiguous() copy")

    monkeypatch.setattr(torch.Tensor, "contiguous", refuse)
    out = attnlab.attention(q, k, v, backend="triton", **kw)
    monkeypatch.undo()
    assert compare(out, ref)


def test_interpreter_loop_bounds_with_old_triton_and_new_numpy(monkeypatch):
    """Triton < 3.7's interpreter converts scalar tensors with ``int(data)`` on one-element 1-D arrays,
    which NumPy >= 2.5 refuses (seen on the GPU machine: triton 3.6, NumPy 2.5.2). Emulate that and check
    the kernel's tensor loop bounds still work."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def old_style(tensor, *scope):  # triton < 3.5 patches without a scope argument
        original(tensor, *scope)

        def index(self):
            if self.handle.data.ndim > 0:
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
            return int(self.handle.data)

        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old_style)
    q, k, v, kw = _empty_row_inputs("cpu")
    out = attnlab.attention(q, k, v, backend="triton", **kw)
    ref, _ = attnlab.reference(q, k, v, **kw)
    assert compare(out, ref)


def test_interpreter_leaves_triton_language_as_it_was():
    """Running on CPU must not leave interpreter patches in triton.language: the next compiled launch in
    the same process would fail (seen on the GPU machine: 'value' object has no attribute 'dtype')."""
    import triton.language as tl

    watched = [tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype]
    before = [dict(vars(obj)) for obj in watched]
    q, k, v, kw = _empty_row_inputs("cpu")
    attnlab.attention(q, k, v, backend="triton", **kw)
    for obj, saved in zip(watched, before):
        now = dict(vars(obj))
        if isinstance(obj, type):  # (modules may gain the interpreter's helper names, never read when compiling)
            assert now.keys() == saved.keys(), (obj, now.keys() ^ saved.keys())
        changed = [key for key in saved if now.get(key) is not saved[key]]
        assert not changed, (obj, changed)


def test_tf32_opt_in_is_scoped_and_cpu_stays_exact():
    q, k, v, kw = _empty_row_inputs("cpu")
    ref, _ = attnlab.reference(q, k, v, **kw)
    assert not tconfigs.TF32
    with tconfigs.allow_tf32():
        assert tconfigs.TF32
        out = attnlab.attention(q, k, v, backend="triton", **kw)
    assert not tconfigs.TF32
    assert compare(out, ref)  # the interpreter's float32 products are exact either way


def test_unsupported_reasons():
    be = tbackend.TritonBackend()
    q = torch.zeros(1, 1, 4, 8)
    assert be.unsupported(make_problem(q, q, q)) is None
    assert "65535" in be.unsupported(make_problem(torch.zeros(65536, 1, 2, 8), torch.zeros(65536, 1, 2, 8),
                                                  torch.zeros(65536, 1, 2, 8)))


# ------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------
@pytest.fixture
def untuned(monkeypatch):
    """The matrix runs each problem with the default config (autotuning every case would compile
    every candidate for every specialization); test_every_candidate_gpu covers the other configs."""
    monkeypatch.setattr(tconfigs, "AUTOTUNE", False)


LONG_CASES = long_cases()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    default_cases(8) + [c.scaled(4) for c in EXTRA_CASES] + [c for c in EXTRA_CASES if c.name in ("decode_nq1", "nk1")],
    ids=lambda c: f"{c.name}_N{c.Nq}",
)
def test_matrix_gpu(case, untuned):
    _check_all(verify(backends=["triton"], cases=[case], device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: c.name)
def test_long_sequences_gpu(case, untuned):
    _check_all(verify(backends=["triton"], cases=[case], device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_every_candidate_gpu(dtype, D, causal):
    """Each autotune candidate computes the same function (partial and full tiles). The shapes specialize
    like the benchmark's (sizes divisible by 16, no GQA), so its tuning reuses these compilations."""
    case = Case("cand", B=2, Hq=4, Nq=1024, D=D, causal=causal)
    q, k, v, kw = make_inputs(case, dtype=dtype, device="cuda", seed=5)
    with strict_fp32():
        ref, ref_lse = attnlab.reference(q, k, v, **kw)
        base = None if dtype == F32 else attnlab.attention(q, k, v, backend="torch", **kw)
    prob = make_problem(q, k, v, **kw)
    for cfg in tconfigs.candidates(dtype, D):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(ref_lse.shape, float("nan"), device="cuda")
        tlaunch.jit_launch(prob, out, lse, cfg, interpret=False)
        rep = compare(out, ref, dtype=dtype, base=base)
        assert rep, (cfg, rep)
        assert compare(lse, ref_lse, atol=_lse_atol(dtype), rtol=0.0), cfg


@pytest.mark.gpu
def test_autotuned_path_gpu(monkeypatch):
    """The portable forward's tuning (the Hopper kernel, off here, has one configuration)."""
    from attnlab.backends.triton import hopper_forward as hopper

    monkeypatch.setattr(hopper, "_mode", "0")
    monkeypatch.setattr(tconfigs, "AUTOTUNE", True)
    case = Case("tuned", B=2, Hq=4, Nq=1024, D=64, causal=True, dtypes=(BF16,))
    _check_all(verify(backends=["triton"], cases=[case], device="cuda"))
    assert any(key[3] == "causal" for key in tconfigs._tuned)


@pytest.mark.gpu
def test_tf32_opt_in_gpu(untuned):
    """TF32 is judged at float16's tolerances (same unit roundoff, 2^-11), and is really in effect."""
    case = Case("tf32", B=2, Hq=4, Nq=517, D=64, causal=True, dtypes=(F32,))
    q, k, v, kw = make_inputs(case, dtype=F32, device="cuda", seed=7)
    with strict_fp32():
        ref, _ = attnlab.reference(q, k, v, **kw)
        ieee = attnlab.attention(q, k, v, backend="triton", **kw)
        with tconfigs.allow_tf32():
            tf32 = attnlab.attention(q, k, v, backend="triton", **kw)
    assert compare(ieee, ref)
    rep = compare(tf32, ref, dtype=F16)
    assert rep, rep
    assert rep.max_abs > compare(ieee, ref).max_abs  # TF32's rounding shows


@pytest.mark.gpu
def test_interpreter_and_compiled_in_one_process(untuned):
    case = Case("both", B=1, Hq=2, Nq=40, Nk=50, D=32, causal=True, align="bottom_right", kv_len=(45,))
    for device in ("cpu", "cuda", "cpu", "cuda"):
        _check_all(verify(backends=["triton"], cases=[case], device=device, dtypes=[F16]))


@pytest.mark.gpu
def test_no_extra_memory_gpu():
    q, k, v = (torch.randn(2, 8, 2048, 128, device="cuda", dtype=BF16) for _ in range(3))
    attnlab.attention(q, k, v, backend="triton", causal=True, return_lse=True)  # compile / tune first
    prob = make_problem(q, k, v, causal=True)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 2048, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    tbackend.TritonBackend().forward(prob, out, lse)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 2**20


def test_scalar_tensor_kv_len_is_read_per_batch_entry():
    """A 0-dim kv_len tensor means the same length for every batch entry (read as kv_len[b] in the kernel)."""
    import attnlab

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 20, 16, generator=g) for _ in range(3))
    out = attnlab.attention(q, k, v, kv_len=torch.tensor(7, dtype=torch.int32), backend="triton")
    ref, _ = attnlab.reference(q, k, v, kv_len=7)
    assert attnlab.check.compare(out, ref).passed


# ------------------------------------------------------------------------------------------------------
# CPU: the float32 chunked Q K^T, and the launch path of repeated calls
# ------------------------------------------------------------------------------------------------------
#: Cases for the D-chunked Q K^T: D of at least 32 (a chunk of 16 must split BLOCK_D), every mask kind.
CHUNK_CASES = chunk_cases()


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: c.name if isinstance(c, Case) else f"chunk{c}")
def test_qk_chunks_cpu(case, chunk, monkeypatch):
    """The D-chunked Q K^T (the float32 GPU candidates' qk_chunk) computes the same function: every mask
    kind, a D that is not a power of two, strided views; bfloat16 also runs the upcast branch."""
    monkeypatch.setattr(tconfigs, "INTERPRETER_CONFIG", tconfigs.Config(16, 16, 1, 1, qk_chunk=chunk))
    _check_all(verify(backends=["triton"], cases=[case], device="cpu", dtypes=[F32, BF16]))


#: Cases for float32 in the other orientation: every mask kind, alignments, lengths, GQA, views.
ORIENTATION_CASES = CHUNK_CASES + [c for c in EXTRA_CASES if c.name in {
    "causal_tl_nq>nk_f32", "kv_len_zero_causal_br", "mqa_bnhd_transposed_window", "bias_11qk_kv_len_q_len"}]


@pytest.mark.parametrize("case", ORIENTATION_CASES, ids=lambda c: c.name)
def test_query_major_float32_cpu(case, monkeypatch):
    """float32 runs keys-major (S^T) with rows outermost in the interpreter, as its first GPU candidates
    do; the query-major orientation and the head-by-head grid (other GPU candidates) compute the same
    function."""
    monkeypatch.setattr(tconfigs, "INTERPRETER_CONFIG", tconfigs.Config(16, 16, 1, 1))
    _check_all(verify(backends=["triton"], cases=[case], device="cpu", dtypes=[F32]))


def test_keys_major_is_float32_only_and_excludes_qk_chunk():
    cfg = tconfigs.Config(64, 32, 4, 2, keys_major=True)
    assert [tconfigs.kernel_key_axis(cfg, dt) for dt in (F32, F16, BF16)] == [0, 1, 1]
    assert tconfigs.kernel_key_axis(tconfigs.Config(64, 32), F32) == 1
    assert repr(cfg).endswith("num_stages=2, keys_major=True)")
    with pytest.raises(ValueError, match="keys_major and qk_chunk"):
        tconfigs.Config(32, 32, keys_major=True, qk_chunk=16)


def test_rows_outer_grid_puts_row_tiles_last_within_the_z_limit():
    q = torch.zeros(3, 5, 100, 16)
    prob = make_problem(q, q, q, causal=True)
    assert tlaunch._grid(prob, tconfigs.Config(32, 32)) == (4, 5, 3)
    assert tlaunch._grid(prob, tconfigs.Config(32, 32, rows_outer=True)) == (5, 3, 4)
    n = 65536 * 16 + 1  # stride-0 views: the sizes matter, not the data
    long = make_problem(*(torch.zeros(16).expand(1, 1, n, 16) for _ in range(3)))
    assert not tlaunch._rows_outer(long, tconfigs.Config(16, 16, rows_outer=True))  # 65537 row tiles
    assert tlaunch._grid(long, tconfigs.Config(16, 16, rows_outer=True)) == (65537, 1, 1)


def test_qk_chunk_applies_only_when_it_splits_d():
    cfg = tconfigs.Config(32, 32, 4, 2, qk_chunk=16)
    assert [tconfigs.kernel_qk_chunk(cfg, bd) for bd in (16, 32, 64, 256)] == [0, 16, 16, 16]
    assert tconfigs.kernel_qk_chunk(tconfigs.Config(32, 32), 64) == 0
    assert repr(tconfigs.Config(16, 16, 1, 1)) == "Config(block_m=16, block_n=16, num_warps=1, num_stages=1)"
    assert "qk_chunk=16" in repr(cfg)


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records the launcher calls."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, calls):
        self.calls = calls

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, packed, launch_md, enter, exit_, *args):
        self.calls.append(("fast", (gx, gy, gz), stream, args))


class _FakeJit:
    """Stands in for the @triton.jit kernel: ``kernel[grid](*args, **constants)`` records and returns a
    compiled kernel, as the JIT does."""

    def __init__(self, real):
        self.params = real.params
        self.calls = []
        self.compiled = _FakeCompiled(self.calls)

    def __getitem__(self, grid):
        def launch(*args, num_warps, num_stages, **constants):
            names = [p.name for p in self.params if p.is_constexpr]
            self.calls.append(("jit", grid, None, (*args, *(constants[n] for n in names))))
            return self.compiled

        return launch


def _same(a, b):
    def sig(x):  # a tensor argument is what the kernel sees of it: address, dtype, shape, strides
        return (x.data_ptr(), x.dtype, x.shape, x.stride()) if isinstance(x, torch.Tensor) else (type(x), x)

    return [sig(x) for x in a] == [sig(x) for x in b]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "jit_only"])
def test_repeated_launches_skip_the_jit_with_the_same_arguments(monkeypatch, fast):
    """The second launch of a problem with an out/lse of the same layout calls the compiled kernel
    directly, with exactly the arguments the JIT got; a new layout goes through the JIT again; with
    FAST_LAUNCH off every launch goes through the JIT."""
    fake = _FakeJit(tkernel.attn_fwd_kernel)
    monkeypatch.setattr(tkernel, "attn_fwd_kernel", fake)
    monkeypatch.setattr(truntime, "stream_of", lambda device: 1234)
    monkeypatch.setattr(truntime, "FAST_LAUNCH", fast)
    q, k, v, kw = _empty_row_inputs("cpu")
    prob = make_problem(q, k, v, **kw)
    plan = tlaunch._Plan(prob, tconfigs.Config(16, 32, 4, 2))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    out2, lse2 = torch.empty_like(q), torch.empty(q.shape[:3])
    for o, l in ((out, lse), (out2, lse2), (out, None), (out2, None)):
        plan.launch(prob, o, l)
    strided = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)
    plan.launch(prob, strided, None)
    kinds = [c[0] for c in fake.calls]
    assert kinds == (["jit", "fast", "jit", "fast", "jit"] if fast else ["jit"] * 5)
    if fast:
        for jit_call, fast_call in ((fake.calls[0], fake.calls[1]), (fake.calls[2], fake.calls[3])):
            assert fast_call[1] == plan.grid == jit_call[1] and fast_call[2] == 1234
            # the same arguments except out and lse themselves (the second launch writes out2/lse2)
            swapped = [out2 if x is out else lse2 if x is lse else x for x in jit_call[3]]
            assert _same(swapped, fast_call[3])



def test_autotune_times_direct_launches_and_keeps_the_median_best(monkeypatch):
    """Each candidate is compiled first (one JIT launch each, in parallel threads), then timed through its own
    plan (direct launches, so the host stays ahead of the GPU), by the median, and the fastest is kept."""
    import triton.testing

    fake = _FakeJit(tkernel.attn_fwd_kernel)
    monkeypatch.setattr(tkernel, "attn_fwd_kernel", fake)
    monkeypatch.setattr(truntime, "stream_of", lambda device: 0)
    cfgs = [tconfigs.Config(16, 16), tconfigs.Config(32, 16), tconfigs.Config(64, 16)]
    monkeypatch.setattr(tconfigs, "candidates", lambda dtype, block_d: cfgs)
    ms_of_block_m = {16: 3.0, 32: 1.0, 64: 2.0}
    block_m_at = [p.name for p in fake.params].index("BLOCK_M")

    def fake_do_bench(fn, warmup, rep, return_mode):
        assert return_mode == "median"
        assert (warmup, rep) == (tconfigs.TUNE_WARMUP_MS, tconfigs.TUNE_REP_MS)
        for _ in range(3):
            fn()
        return ms_of_block_m[fake.calls[-1][3][block_m_at]]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    q, k, v, kw = _empty_row_inputs("cpu")
    prob = make_problem(q, k, v, **kw)
    assert tlaunch.autotune(prob, torch.empty_like(q), None) == cfgs[1]
    assert [c[0] for c in fake.calls] == ["jit"] * 3 + ["fast"] * 9


def test_autotune_times_close_candidates_again(monkeypatch):
    """Candidates within CONFIRM_WITHIN of the first pass's fastest are timed CONFIRM_ROUNDS more times,
    interleaved, and the lowest median wins: a lucky first timing does not decide; a distant one is not
    timed again."""
    import triton.testing

    cfgs = ["a", "b", "c"]
    seq = {"a": [1.00, 1.10, 1.10, 1.10], "b": [1.02, 1.00, 1.00, 1.00], "c": [1.50]}
    launched, counted = [], []

    def fake_do_bench(fn, warmup, rep, return_mode):
        fn()
        counted.append(launched[-1])
        return seq[launched[-1]][counted.count(launched[-1]) - 1]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert tconfigs.fastest(cfgs, launched.append, "a test") == "b"
    assert counted.count("a") == counted.count("b") == 1 + tconfigs.CONFIRM_ROUNDS and counted.count("c") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c.scaled(4) for c in CHUNK_CASES] + [c.scaled(4) for c in EXTRA_CASES if c.D >= 32],
                         ids=lambda c: f"{c.name}_N{c.Nq}")
def test_qk_chunk_matrix_gpu(case, monkeypatch):
    """The compiled float32 D-chunked Q K^T on every mask kind (the autotune space only times it on
    dense and causal problems)."""
    monkeypatch.setattr(tconfigs, "AUTOTUNE", False)
    monkeypatch.setattr(tconfigs, "candidates", lambda dtype, block_d: [tconfigs.Config(32, 64, 4, 2, qk_chunk=16)])
    with strict_fp32():
        _check_all(verify(backends=["triton"], cases=[case], device="cuda", dtypes=[F32]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_fast_launch_same_as_jit_gpu(dtype, monkeypatch, untuned):
    """Launches that skip the JIT write bit for bit what JIT launches write, go through the JIT once per
    out/lse layout, and a FAST_LAUNCH of False sends every launch through the JIT."""
    case = Case("fast", B=2, Hq=4, Hkv=2, Nq=300, Nk=333, D=64, layout="bnhd", causal=True, align="bottom_right",
                kv_len=(333, 100), mask="bias_11qk")
    q, k, v, kw = make_inputs(case, dtype=dtype, device="cuda", seed=11)
    prob = make_problem(q, k, v, **kw)
    jit_calls = []
    real_launch = tlaunch.jit_launch

    def counting_launch(*args, **kwargs):
        jit_calls.append(1)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(tlaunch, "jit_launch", counting_launch)
    results = {}
    for fast in (False, True):
        monkeypatch.setattr(truntime, "FAST_LAUNCH", fast)
        tlaunch._PLANS.clear()
        jit_calls.clear()
        for with_lse in (True, True, True, False, False):
            out = torch.full_like(prob.q, float("nan"))
            lse = torch.full((prob.B, prob.Hq, prob.Nq), float("nan"), device="cuda") if with_lse else None
            tbackend.TritonBackend().forward(prob, out, lse)
            results.setdefault(fast, []).append((out, lse))
        assert len(jit_calls) == (2 if fast else 5), (fast, len(jit_calls))
    for (o1, l1), (o2, l2) in zip(results[False], results[True]):
        assert torch.equal(o1, o2) and not torch.isnan(o1).any()
        assert (l1 is None and l2 is None) or torch.equal(l1, l2)


def test_plans_are_keyed_by_the_call_signature():
    """Every call of one shape and mask kind (a new Problem each time, as attnlab.attention makes one) maps to
    one plan key; anything the JIT specializes on (strides, masks present, alignment) changes the key."""
    case = Case("sig", B=2, Hq=4, Hkv=2, Nq=30, Nk=33, D=16, causal=True, align="bottom_right", kv_len=(33, 9))
    q, k, v, kw = make_inputs(case, dtype=F32, device="cpu", seed=1)
    key = truntime.call_signature(make_problem(q, k, v, **kw))
    q2, k2, v2, kw2 = make_inputs(case, dtype=F32, device="cpu", seed=2)
    assert truntime.call_signature(make_problem(q2, k2, v2, **kw2)) == key
    assert truntime.call_signature(make_problem(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, **kw)) != key
    assert truntime.call_signature(make_problem(q, k, v, **{**kw, "kv_len": None})) != key
    assert truntime.call_signature(make_problem(q, k, v, **kw, scale=0.5)) != key
    offset = torch.empty(q.numel() + 1, dtype=F32)[1:].view(q.shape).copy_(q)  # 4-byte aligned only
    assert truntime.call_signature(make_problem(offset, k, v, **kw)) != key


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_public_calls_reuse_one_plan_gpu(dtype, monkeypatch, untuned):
    """attnlab.attention makes a new Problem per call: the plan (and the direct launcher) is found by the
    call's signature, and each call's output is the JIT launch's, bit for bit, for fresh tensors."""
    case = Case("reuse", B=2, Hq=4, Hkv=2, Nq=200, Nk=233, D=64, causal=True, align="bottom_right",
                kv_len=(233, 50), mask="bool_1h1k")
    jit_calls = []
    real_launch = tlaunch.jit_launch

    def counting_launch(*args, **kwargs):
        jit_calls.append(1)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(tlaunch, "jit_launch", counting_launch)
    tlaunch._PLANS.clear()
    for seed in range(4):
        q, k, v, kw = make_inputs(case, dtype=dtype, device="cuda", seed=seed)
        got = attnlab.attention(q, k, v, backend="triton", **kw)
        monkeypatch.setattr(truntime, "FAST_LAUNCH", False)
        want = attnlab.attention(q, k, v, backend="triton", **kw)
        monkeypatch.setattr(truntime, "FAST_LAUNCH", True)
        assert torch.equal(got, want)
    assert len(tlaunch._PLANS) == 1
    assert len(jit_calls) == 1 + 4  # the first fast-path call, then every FAST_LAUNCH=False call


def test_a_launch_with_no_hook_set_passes_no_hooks_and_no_metadata():
    """run_compiled hands Triton's launcher None for the hooks and the metadata unless a hook is set (triton
    3.6-3.9 hold hooks in a HookChain that is never None: testing for None passed them on every launch)."""
    from types import SimpleNamespace

    triton = pytest.importorskip("triton")
    seen = []
    kernel = SimpleNamespace(function=11, packed_metadata=(4, 1, 0), run=lambda *a: seen.append(a),
                             launch_metadata=lambda grid, stream, *args: ("meta", grid, stream))
    runtime = triton.knobs.runtime
    assert truntime.idle_hooks(runtime)
    truntime.run_compiled(kernel, (2, 3, 1), 99, (0x10, 5, 7))
    assert seen.pop() == (2, 3, 1, 99, 11, (4, 1, 0), None, None, None, 0x10, 5, 7)

    def hook(*args):
        return None

    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a HookChain (triton >= 3.6)
        chain.add(hook)
        try:
            assert not truntime.idle_hooks(runtime)
            truntime.run_compiled(kernel, (2, 3, 1), 99, (0x10, 5, 7))
            got = seen.pop()
            assert got[6] == ("meta", (2, 3, 1), 99) and got[7] is chain and got[9:] == (0x10, 5, 7)
        finally:
            chain.remove(hook)
    assert truntime.idle_hooks(runtime)
    assert truntime.idle_hooks(SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    assert not truntime.idle_hooks(SimpleNamespace(launch_enter_hook=hook, launch_exit_hook=None))


def _launcher_object(seen: list, **sizes):
    """A CUDA launcher object of the installed Triton, made without compiling anything: its C launch function
    records what it is handed."""
    from triton.backends.nvidia.driver import CudaLauncher

    run = object.__new__(CudaLauncher)
    attrs = dict(launch=lambda *a: seen.append(a), global_scratch_size=0, global_scratch_align=1,
                 profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=True,
                 num_ctas=1, gsan_enabled=False)
    if truntime._triton_minor() >= (3, 7):  # one shared launcher, told each kernel's argument kinds
        attrs.update(arg_annotations=("annotations",), kernel_signature=b"signature")
    attrs.update(sizes)
    for name, value in attrs.items():
        setattr(run, name, value)
    return run


def test_the_direct_c_launch_passes_what_tritons_launcher_object_passes(monkeypatch):
    """runtime.launcher calls the C launch function with exactly the arguments the installed Triton's
    CudaLauncher.__call__ hands it for a launch with no hooks (the real __call__ is run on the same object and
    both recordings compared), falls back to that object while a hook is set, and is not used for a kernel
    with a scratch buffer or a Triton whose interface it does not know."""
    from types import SimpleNamespace

    triton = pytest.importorskip("triton")
    if truntime._triton_minor() is None or not (3, 5) <= truntime._triton_minor() <= (3, 9):
        pytest.skip(f"triton {triton.__version__}: the direct launch is not used")
    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace())  # __call__ may look it up (no GPU here)
    seen: list = []
    run = _launcher_object(seen)
    kernel = SimpleNamespace(function=11, packed_metadata=(4, 1, 0), run=run,
                             launch_metadata=lambda grid, stream, *args: ("meta", grid, stream))
    args = (0x10, 5, 7, 3.5)
    truntime.run_compiled(kernel, (2, 3, 1), 99, args)  # through the launcher object's own __call__
    want = seen.pop()
    go = truntime.launcher(kernel)
    assert truntime._c_launch(kernel) is not None
    go((2, 3, 1), 99, args)
    assert seen.pop() == want
    chain = triton.knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # with a hook set, the launcher object is called and handed the hooks

        def hook(*a):
            return None

        chain.add(hook)
        try:
            go((2, 3, 1), 99, args)
        finally:
            chain.remove(hook)
        got = seen.pop()
        assert got[:5] == want[:5] and any(a is chain for a in got)
    assert not seen
    for odd in (dict(global_scratch_size=64), dict(profile_scratch_size=64), dict(gsan_enabled=True)):
        kernel_odd = SimpleNamespace(function=11, packed_metadata=(4, 1, 0), run=_launcher_object(seen, **odd))
        assert truntime._c_launch(kernel_odd) is None, odd  # the launcher object allocates the scratch
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    assert truntime._c_launch(kernel) is None


def test_every_kernel_is_compiled_with_fp_fusion_said_explicitly(monkeypatch):
    """triton 3.9 warns on every compile that leaves FMA contraction to its default (which turns off in 3.10):
    each GPU launch passes COMPILE_OPTIONS, and those options parse without the warning."""
    import warnings

    pytest.importorskip("triton.backends.nvidia.compiler")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    from attnlab.backends.triton import bwd_launch
    from attnlab.backends.triton import decode as tdecode

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CUDABackend(GPUTarget("cuda", 90, 32)).parse_options(
            dict(num_warps=4, num_stages=3, **tconfigs.COMPILE_OPTIONS)).enable_fp_fusion is True

    seen = {}

    class Stub:  # the forward kernel, as the JIT is called: kernel[grid](*args, **keywords)
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(kw)

    monkeypatch.setattr(tkernel, "attn_fwd_kernel", Stub())
    q = torch.randn(1, 2, 16, 16)
    prob = make_problem(q, q, q, causal=True)
    tlaunch.jit_launch(prob, torch.empty_like(q), None, tconfigs.Config(16, 16, 4, 2), interpret=False)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 16)
    launches = {"forward": seen,
                "preprocess": bwd_launch.preprocess_launch(prob, out, lse, out, lse, lse, False)[3],
                "dkdv": bwd_launch.dkdv_launch(prob, out, lse, lse, q, q, tconfigs.BwdConfig(16, 16, 4, 2), False)[3],
                "dq": bwd_launch.dq_launch(prob, out, lse, lse, q, tconfigs.BwdConfig(16, 16, 4, 2), False)[3],
                "decode": tdecode.DecodeConfig(64).options()}
    for name, kw in launches.items():
        assert kw.get("enable_fp_fusion") is True, name
