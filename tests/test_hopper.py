"""The Hopper forward (attnlab.backends.triton.hopper_forward): which calls it takes, that it compiles for sm_90
with the installed triton (CPU), and on an sm_90 GPU that it computes the contract through the public call, in its
first calls and its fast calls, with gradients, in CUDA graphs and under torch.compile."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.backends.triton import background
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.check import compare
from attnlab.problem import make_problem


def _qkv(B=1, Hq=4, Hkv=2, Nq=200, Nk=200, D=64, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(B, Hq, Nq, D, dtype=dtype, device=device, generator=g),
            torch.randn(B, Hkv, Nk, D, dtype=dtype, device=device, generator=g),
            torch.randn(B, Hkv, Nk, D, dtype=dtype, device=device, generator=g))


# ---- which calls it takes (CPU: the device check stubbed) ----------------------------------------------------


@pytest.fixture
def on_sm90(monkeypatch):
    monkeypatch.setattr(hopper, "on_sm90", lambda t: True)
    monkeypatch.setattr(hopper, "_mode", "1")


def _why(q, k, v, **kw):
    prob = make_problem(q, k, v, **kw)
    return hopper.unsupported(prob, torch.empty_like(prob.q))


def test_takes_dense_causal_window_gqa_and_either_alignment(on_sm90):
    if isinstance(hopper._kernel_module(), str):
        pytest.skip(hopper._kernel_module())
    q, k, v = _qkv(Nq=100, Nk=300)
    assert _why(q, k, v) is None
    assert _why(q, k, v, causal=True, align="bottom_right") is None
    assert _why(q, k, v, window=(2048, 0), align="top_left") is None  # wider than PORTABLE_BANDS[64]
    assert _why(q, k, v, window=(None, 5), align="top_left") is None  # bounded on one side only
    assert _why(*_qkv(D=128, dtype=torch.float16)) is None


def test_narrow_bands_run_the_portable_kernel(on_sm90, monkeypatch):
    """A band bounded on both sides at most PORTABLE_BANDS[D] keys wide goes to the portable kernel (faster there);
    NARROW_TO_PORTABLE off hands it back to the Hopper kernel."""
    if isinstance(hopper._kernel_module(), str):
        pytest.skip(hopper._kernel_module())
    q, k, v = _qkv(D=64)
    assert "portable kernel" in _why(q, k, v, window=(127, 0))
    assert "portable kernel" in _why(q, k, v, window=(1000, 1047))  # 2048 keys
    assert _why(q, k, v, window=(1000, 1048)) is None  # 2049
    assert "portable kernel" in _why(q, k, v, window=(0, -10))  # an empty band
    wide = _qkv(D=128)
    assert "portable kernel" in _why(*wide, window=(127, 0)) and _why(*wide, window=(128, 0)) is None
    monkeypatch.setattr(hopper, "NARROW_TO_PORTABLE", False)
    assert _why(q, k, v, window=(127, 0)) is None


@pytest.mark.parametrize("kw, reason", [
    (dict(dtype=torch.float32), "float16 and bfloat16"),
    (dict(D=96), "D = Dv"),
    (dict(D=256), "D = Dv"),
])
def test_refuses_what_it_does_not_compute(on_sm90, kw, reason):
    assert reason in _why(*_qkv(**kw))


@pytest.mark.parametrize("extra, reason", [
    (dict(kv_len=[100, 50]), "kv_len"),
    (dict(mask=torch.ones(200, 200, dtype=torch.bool)), "explicit mask"),
    (dict(mask=torch.zeros(200, 200)), "bias"),
    (dict(sinks=torch.zeros(4)), "sinks"),
])
def test_refuses_masks_biases_and_sinks(on_sm90, extra, reason):
    q, k, v = _qkv(B=2)
    assert reason in _why(q, k, v, **extra)


def test_takes_lengths_and_the_score_modifiers(on_sm90):
    if isinstance(hopper._kernel_module(), str):
        pytest.skip(hopper._kernel_module())
    q, k, v = _qkv(B=2)
    assert _why(q, k, v, q_len=[200, 7], causal=True, align="bottom_right") is None
    assert _why(q, k, v, softcap=30.0, alibi_slopes=torch.rand(4)) is None


def test_refuses_what_tma_cannot_read(on_sm90):
    _, k, v = _qkv(D=64)
    strided = torch.randn(1, 4, 200, 128, dtype=torch.bfloat16)[..., ::2]  # D stride 2
    assert "TMA" in _why(strided, k, v)
    flat = torch.randn(4 * 200 * 64 + 8, dtype=torch.bfloat16)
    odd = flat[1:1 + 4 * 200 * 64].view(1, 4, 200, 64)  # aligned strides, the base 2 bytes off
    assert "TMA" in _why(odd, k, v)
    assert _why(flat[8:8 + 4 * 200 * 64].view(1, 4, 200, 64), k, v) is None or isinstance(hopper._kernel_module(), str)
    shared = torch.randn(1, 1, 200, 64, dtype=torch.bfloat16).expand(1, 2, 200, 64)  # one kv head broadcast: stride 0
    assert "TMA" in _why(_qkv(D=64)[0], shared, shared)


def test_light_descriptors_carry_every_field_the_launcher_reads():
    """A repeated launch hands the launcher :class:`_Desc` objects instead of TensorDescriptors: every field of the
    installed triton's descriptor but the block and layout (fixed by the compiled kernel) must be there, equal."""
    if isinstance(hopper._kernel_module(), str):
        pytest.skip(hopper._kernel_module())
    import dataclasses

    t = _qkv(D=128)[0]
    real = hopper.descriptor(t, [1, 1, hopper.BLOCK_M, 128])
    light = hopper.LightDescriptor(t)
    for f in dataclasses.fields(real):
        if f.name in ("block_shape", "layout"):
            continue
        a, b = getattr(light, f.name), getattr(real, f.name)
        if f.name == "base":
            assert a is b
        else:
            assert (list(a) == list(b)) if f.name in ("shape", "strides") else a == b, f.name


def test_band_widths_are_clamped_to_the_same_band():
    q, k, _ = _qkv(Nq=100, Nk=300)
    assert hopper.clamped_width(None, q, k) is None
    assert hopper.clamped_width(50, q, k) == 50 and hopper.clamped_width(-7, q, k) == -7
    assert hopper.clamped_width(2**40, q, k) == 400 and hopper.clamped_width(-(2**40), q, k) == -400


@pytest.mark.parametrize("given, mode", [("0", "0"), ("off", "0"), ("False", "0"), ("1", "1"), ("on", "1"),
                                         ("sync", "sync"), (" SYNC ", "sync")])
def test_the_environment_switch_and_its_spellings(monkeypatch, given, mode):
    monkeypatch.setenv("ATTNLAB_HOPPER", given)
    assert hopper._from_environment() == mode


def test_an_unknown_environment_value_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv("ATTNLAB_HOPPER", "maybe")
    with pytest.warns(UserWarning, match="ATTNLAB_HOPPER='maybe'"):
        assert hopper._from_environment() == "1"


def test_off_sm90_and_switched_off_it_takes_nothing(monkeypatch):
    q, k, v = _qkv()
    assert "sm_90" in _why(q, k, v)  # a CPU tensor
    monkeypatch.setattr(hopper, "on_sm90", lambda t: True)
    prev = hopper.set_mode("0")
    try:
        assert "ATTNLAB_HOPPER=0" in _why(q, k, v)
    finally:
        hopper.set_mode(prev)
    with pytest.raises(ValueError, match="ATTNLAB_HOPPER must be one of"):
        hopper.set_mode("on")


@pytest.fixture
def fake_compiles(monkeypatch):
    """The compile machinery with its GPU parts stubbed: (the submitted work, the futures handed back)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    submitted, futures = [], []

    def ahead(*work, **how):
        submitted.append((work, how))
        futures.append(Future())
        return futures[-1]

    monkeypatch.setattr(hopper, "_kernel_module", lambda: SimpleNamespace(attn_fwd_hopper=object()))
    monkeypatch.setattr(hopper, "_problem_args", lambda prob, out, lse: ((1, 1, 1), (), {}))
    monkeypatch.setattr(background, "ahead", ahead)
    monkeypatch.setattr(hopper, "_compiles", {})
    monkeypatch.setattr(hopper, "_seen", set())
    return submitted, futures


def test_a_variants_first_call_starts_nothing_and_its_second_the_compile(on_sm90, fake_compiles):
    submitted, futures = fake_compiles
    prob = make_problem(*_qkv())
    out = torch.empty_like(prob.q)
    assert not hopper._ready(prob, out, None) and not submitted  # first call: the portable kernel alone
    assert not hopper._ready(prob, out, None) and len(submitted) == 1  # second: the compile starts
    assert submitted[0][1] == {"jit": True}  # into the JIT's cache: the cold path does not launch it
    assert not hopper._ready(prob, out, None) and len(submitted) == 1  # in flight: not started twice
    assert not hopper._compiled(hopper._variant(prob, None))
    futures[0].set_result(None)
    assert hopper._compiled(hopper._variant(prob, None)) and hopper._ready(prob, out, None)
    lse = torch.empty(1, 4, 200)  # another variant (with lse), whose compile fails: it stays portable
    hopper._ready(prob, out, lse)
    hopper._ready(prob, out, lse)
    assert not hopper.failed(prob, lse)
    futures[1].set_exception(RuntimeError("no such instruction"))
    assert not hopper._ready(prob, out, lse)
    assert "no such instruction" in hopper._compiles[hopper._variant(prob, lse)]
    assert hopper.failed(prob, lse) and not hopper.failed(prob, None)
    assert len(submitted) == 2


def test_sync_mode_compiles_on_the_first_call_and_waits(on_sm90, fake_compiles, monkeypatch):
    submitted, futures = fake_compiles
    monkeypatch.setattr(hopper, "_mode", "sync")
    prob = make_problem(*_qkv(D=128))
    out = torch.empty_like(prob.q)
    import threading

    threading.Timer(0.05, lambda: futures[0].set_result(None)).start()  # the compile finishes a little later
    assert hopper._ready(prob, out, None) and len(submitted) == 1


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("band", [dict(), dict(left=None, right=0), dict(left=100, right=0)])
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("extras", ["none", "lengths+mods"])
def test_compiles_for_sm90_with_the_installed_triton(D, band, pingpong, extras, monkeypatch):
    """The kernel compiles for sm_90 (no GPU needed): a Gluon API change in a new triton shows here first."""
    if isinstance(hopper._kernel_module(), str):
        pytest.skip(hopper._kernel_module())
    from triton.backends.compiler import GPUTarget

    from attnlab.backends.triton.cold_launch import compile_only

    monkeypatch.setattr(hopper, "PERSISTENT", True)
    monkeypatch.setattr(hopper, "PINGPONG", pingpong)
    q, k, v = _qkv(D=D, Nq=300, Nk=500)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 300)
    ex = hopper.NO_EXTRAS
    if extras != "none":  # kv_len, q_len, the soft cap and ALiBi
        ex = hopper.Extras(torch.tensor([500], dtype=torch.int32), torch.tensor([250], dtype=torch.int32),
                           torch.rand(1, 4), (4, 1), 30.0 * hopper.LOG2E)
    _, args, kw = hopper._launch_args(q, k, v, out, lse, 0.1, band.get("left"), band.get("right"), True, ex)
    assert kw["PINGPONG"] is pingpong
    assert kw["enable_fp_fusion"] is True  # stated, not left to triton's default (which triton 3.10 turns off)
    assert kw["PERSISTENT"] == (not band and extras == "none")  # looping programs only for items of equal cost
    compiled = compile_only(hopper._kernel_module().attn_fwd_hopper, args, kw, 0, target=GPUTarget("cuda", 90, 32))[0]
    assert compiled.metadata.num_warps == 12  # two consumer warpgroups and the loader's
    assert compiled.metadata.shared <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    spills, serialized = ptxas_report(ptx)
    assert spills == 0, "the Hopper kernel spills registers"
    assert not serialized, "ptxas serializes the kernel's warpgroup MMAs (too few registers in a partition)"


_AFTER_AN_INTERPRETED_CALL = """
import torch
import attnlab
from triton.backends.compiler import GPUTarget
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.backends.triton.cold_launch import compile_only

q = torch.randn(1, 2, 40, 64)
attnlab.attention(q, q, q, backend="triton", causal=True)  # Triton's interpreter, on CPU tensors
q, k = torch.randn(1, 4, 300, 64, dtype=torch.bfloat16), torch.randn(1, 2, 500, 64, dtype=torch.bfloat16)
out = torch.empty_like(q)
_, args, kw = hopper._launch_args(q, k, k, out, None, 0.1, None, 0, True)
compile_only(hopper._kernel_module().attn_fwd_hopper, args, kw, 0, target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_compiles_after_an_interpreted_call_in_the_same_process(tmp_path):
    """An interpreted launch imports Gluon while triton.language's functions are swapped for the interpreter's;
    Gluon imported then kept the stand-ins and no Gluon kernel compiled afterwards in that process (triton 3.9).
    A fresh process and an empty Triton cache, so that no cached kernel hides the compile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if isinstance(hopper._kernel_module(), str):
        pytest.skip(hopper._kernel_module())
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", _AFTER_AN_INTERPRETED_CALL], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


def ptxas_report(ptx: str) -> tuple[int, bool]:
    """Bytes of spill stores ptxas reports for ``ptx`` on sm_90a (the ptxas triton compiled it with), and whether
    it warns that it serialized the warpgroup MMAs (C7512: a partition's registers are too few for them in flight;
    the kernel runs, slower)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = f"{d}/k.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", f"{d}/k.cubin"], capture_output=True,
                             text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    found = re.findall(r"(\d+) bytes spill stores", res.stderr + res.stdout)
    assert found, res.stderr[-2000:]
    return sum(int(x) for x in found), "C7512" in res.stderr + res.stdout


def test_programs_loop_over_work_items_only_without_a_band(monkeypatch):
    """Without a band every item costs the same: at most one program per SM loops over them; under a band (or with
    PERSISTENT off) one program per item, which the hardware balances. Items: row tiles of 128 x B x Hq."""
    monkeypatch.setattr(hopper, "PERSISTENT", True)
    q = torch.empty(3, 5, 300, 64)
    assert hopper._items(q) == 3 * 3 * 5
    assert hopper._persistent(uneven=False) and not hopper._persistent(uneven=True)
    assert hopper._grid(q, False) == (45, 1, 1)
    monkeypatch.setattr(hopper, "PERSISTENT", False)
    assert not hopper._persistent(uneven=False)


# ---- on an sm_90 GPU ------------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs an sm_90 GPU")

CASES = {
    "full": dict(shape=dict(Nq=1000, Nk=1000, D=128), kw=dict()),
    "causal": dict(shape=dict(Nq=1000, Nk=1000, D=128), kw=dict(causal=True)),
    "causal_br_short_q": dict(shape=dict(Nq=333, Nk=777, D=64), kw=dict(causal=True, align="bottom_right")),
    "causal_br_long_q": dict(shape=dict(Nq=777, Nk=333, D=64), kw=dict(causal=True, align="bottom_right")),
    "causal_tl_long_q": dict(shape=dict(Nq=777, Nk=333, D=128), kw=dict(causal=True, align="top_left")),
    "window": dict(shape=dict(Nq=1500, Nk=1500, D=128), kw=dict(window=(200, 0))),
    "window_both_br": dict(shape=dict(Nq=513, Nk=1025, D=64), kw=dict(window=(100, 50), align="bottom_right")),
    "window_wide_d64": dict(shape=dict(Nq=3000, Nk=3000, D=64), kw=dict(window=(1500, 700))),  # 2201 keys
    "one_key": dict(shape=dict(Nq=64, Nk=1, D=128), kw=dict()),
    "fp16_causal": dict(shape=dict(Nq=300, Nk=300, D=128, dtype=torch.float16), kw=dict(causal=True)),
    "window_empty_rows": dict(shape=dict(Nq=300, Nk=300, D=64), kw=dict(window=(None, -50))),
    "q_len_causal_br": dict(shape=dict(Nq=700, Nk=900, D=128),
                            kw=dict(q_len=[333, 0], causal=True, align="bottom_right")),
    "q_len_window": dict(shape=dict(Nq=600, Nk=600, D=128), kw=dict(q_len=[17, 600], window=(100, 20))),
    "softcap": dict(shape=dict(Nq=400, Nk=500, D=128), kw=dict(softcap=20.0)),
    "alibi_causal": dict(shape=dict(Nq=500, Nk=500, D=64), kw=dict(alibi="slopes", causal=True)),
    "all_extras": dict(shape=dict(Nq=450, Nk=700, D=128),
                       kw=dict(q_len=[450, 120], softcap=30.0, alibi="slopes", causal=True, align="bottom_right")),
}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", list(CASES))
def test_the_public_call_runs_the_hopper_kernel_and_meets_the_contract(case, monkeypatch):
    monkeypatch.setattr(hopper, "NARROW_TO_PORTABLE", False)  # the narrow bands too: the kernel's own band code
    spec = CASES[case]
    q, k, v = _qkv(B=2, Hq=8, Hkv=2, device="cuda", seed=3, **spec["shape"])
    kw = dict(spec["kw"])
    if kw.get("alibi") == "slopes":  # each head's slope, as ALiBi's geometric series
        del kw["alibi"]
        kw["alibi_slopes"] = 2.0 ** (-torch.arange(1, 9, dtype=torch.float32, device="cuda"))
    for name in ("kv_len", "q_len"):
        if name in kw:
            kw[name] = torch.tensor(kw[name], dtype=torch.int32, device="cuda")
    prev, before = hopper.set_mode("sync"), hopper.launches
    try:
        out, lse = attnlab.attention(q, k, v, backend="triton", return_lse=True, **kw)
    finally:
        hopper.set_mode(prev)
    assert hopper.launches == before + 1, "the call did not run the Hopper kernel"
    ref, ref_lse = attnlab.reference(q, k, v, **kw)
    assert compare(out, ref).passed, compare(out, ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    live = torch.isfinite(ref_lse)
    assert (lse[live] - ref_lse[live]).abs().max().item() < 1e-4
    assert not torch.isnan(out).any()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True, align="bottom_right")], ids=["full", "causal"])
def test_the_schedules_give_one_output(D, kw, monkeypatch):
    """More work items than SMs (B8 Hq16 N1000: 1024 items), GQA, Nq != Nk: with persistent programs (each runs
    several items without a band) and with the consumers' ping-pong, each on and off, the output and lse are
    equal bit for bit (the same sums in the same order) and pass the checker."""
    from attnlab import fast_calls

    q, k, v = _qkv(B=8, Hq=16, Hkv=4, Nq=1000, Nk=1100, D=D, device="cuda", seed=11)
    assert hopper._grid(q, True)[0] < hopper._items(q)
    prev, got = hopper.set_mode("sync"), {}
    try:
        for setting in ((True, True), (True, False), (False, True), (False, False)):
            monkeypatch.setattr(hopper, "PERSISTENT", setting[0])
            monkeypatch.setattr(hopper, "PINGPONG", setting[1])
            fast_calls.clear()
            before = hopper.launches
            got[setting] = attnlab.attention(q, k, v, backend="triton", return_lse=True, **kw)
            assert hopper.launches == before + 1
    finally:
        hopper.set_mode(prev)
    out, lse = got[(True, True)]
    for other, other_lse in got.values():
        assert torch.equal(out, other) and torch.equal(lse, other_lse)
    ref, ref_lse = attnlab.reference(q[:2], k[:2], v[:2], **kw)
    assert compare(out[:2], ref).passed, compare(out[:2], ref)
    live = torch.isfinite(ref_lse)
    assert (lse[:2][live] - ref_lse[live]).abs().max().item() < 1e-4


@pytest.mark.gpu
@needs_sm90
def test_a_narrow_band_runs_the_portable_kernel_and_meets_the_contract(monkeypatch):
    """gpt-oss's layer shape in small: a 128-key window at D 64 takes the portable kernel, in sync mode too, the
    whole way and as a fast call."""
    from attnlab import fast_calls

    monkeypatch.setattr(hopper, "fast_call", lambda *a: pytest.fail("a Hopper fast call for a narrow band"))

    q, k, v = _qkv(B=2, Hq=8, Hkv=2, Nq=700, Nk=700, D=64, device="cuda", seed=5)
    prev, before = hopper.set_mode("sync"), hopper.launches
    try:
        fast_calls.clear()
        out = attnlab.attention(q, k, v, window=(127, 0), backend="triton")
        out_fast = attnlab.attention(q, k, v, window=(127, 0), backend="triton")  # the fast call
    finally:
        hopper.set_mode(prev)
    assert hopper.launches == before
    ref = attnlab.reference(q, k, v, window=(127, 0))[0]
    assert compare(out, ref).passed and torch.equal(out, out_fast), compare(out, ref)


@pytest.mark.gpu
@needs_sm90
def test_padding_rows_are_zero_whatever_the_values_hold():
    """Rows past q_len attend no key: out exactly 0 and lse -inf, also when a value they were multiplied by 0
    with is Inf (the contract's NaN rule: only rows that attend a key see what it holds)."""
    q, k, v = _qkv(B=2, Hq=4, Hkv=4, Nq=300, Nk=300, D=128, device="cuda", seed=13)
    v[0, :, 5] = float("inf")
    ql = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
    prev, before = hopper.set_mode("sync"), hopper.launches
    try:
        out, lse = attnlab.attention(q, k, v, q_len=ql, backend="triton", return_lse=True)
    finally:
        hopper.set_mode(prev)
    assert hopper.launches == before + 1
    assert (out[0, :, 100:] == 0).all() and torch.isneginf(lse[0, :, 100:]).all()
    assert torch.isfinite(out[1]).all()


@pytest.mark.gpu
@needs_sm90
def test_fast_calls_take_each_calls_lengths_and_slopes():
    """The fast call of a signature with q_len and ALiBi launches with the lengths and slopes of the call it
    serves, not of the call that made it."""
    from attnlab import fast_calls

    q, k, v = _qkv(B=2, Hq=4, Hkv=4, Nq=300, Nk=500, D=128, device="cuda", seed=12)
    prev = hopper.set_mode("sync")
    try:
        fast_calls.clear()
        outs = []
        for ql, slope in (([300, 300], 0.5), ([290, 31], 0.125)):
            kw = dict(q_len=torch.tensor(ql, dtype=torch.int32, device="cuda"),
                      alibi_slopes=torch.full((4,), slope, device="cuda"), causal=True, align="bottom_right")
            before = hopper.launches
            outs.append((attnlab.attention(q, k, v, backend="triton", return_lse=True, **kw), kw))
        assert len(fast_calls._CALLS) == 1 and hopper.launches == before  # the second call was the fast call
    finally:
        hopper.set_mode(prev)
    for (out, lse), kw in outs:
        ref, ref_lse = attnlab.reference(q, k, v, **kw)
        assert compare(out, ref).passed, compare(out, ref)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


@pytest.mark.gpu
@needs_sm90
def test_strided_views_and_the_bnhd_layout():
    g = torch.Generator(device="cuda").manual_seed(5)
    big = torch.randn(2, 300, 3, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (big[:, :, i] for i in range(3))  # [B, N, H, D] views of one packed tensor
    prev, before = hopper.set_mode("sync"), hopper.launches
    try:
        out = attnlab.attention(q, k, v, layout="bnhd", causal=True, backend="triton")
    finally:
        hopper.set_mode(prev)
    assert hopper.launches == before + 1
    assert compare(out, attnlab.reference(q, k, v, layout="bnhd", causal=True)[0]).passed


@pytest.mark.gpu
@needs_sm90
def test_fast_calls_in_the_bnhd_layout():
    """The second call of a signature is its fast call: [B, N, H, D] tensors go to the kernel as views."""
    from attnlab import fast_calls

    g = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = (torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    prev = hopper.set_mode("sync")
    try:
        fast_calls.clear()
        first = attnlab.attention(q, k, v, layout="bnhd", causal=True, backend="triton", return_lse=True)
        assert len(fast_calls._CALLS) == 1
        q2 = torch.randn_like(q)
        second = attnlab.attention(q2, k, v, layout="bnhd", causal=True, backend="triton", return_lse=True)
    finally:
        hopper.set_mode(prev)
    for (out, lse), qq in ((first, q), (second, q2)):
        ref, ref_lse = attnlab.reference(qq, k, v, layout="bnhd", causal=True)
        assert out.shape == qq.shape and compare(out, ref).passed
        assert (lse - ref_lse).abs().max().item() < 1e-4


@pytest.mark.gpu
@needs_sm90
def test_background_mode_runs_the_portable_kernel_until_the_compile_is_done(monkeypatch):
    """Default mode: the first two calls of a new variant run the portable kernel (the second starts the compile);
    once the compile is done, calls (the whole way and fast calls) run the Hopper kernel; all pass the checker."""
    from attnlab import fast_calls

    monkeypatch.setattr(hopper, "NARROW_TO_PORTABLE", False)  # its band (308 keys at D 64) is a narrow one

    q, k, v = _qkv(B=1, Hq=4, Hkv=4, Nq=700, Nk=900, D=64, device="cuda", seed=9)
    kw = dict(window=(300, 7), align="bottom_right")  # a variant no other test compiles
    prev = hopper.set_mode("1")
    try:
        prob = make_problem(q, k, v, **kw)
        for lse in (None, q):  # forget the variant, with and without lse
            hopper._compiles.pop(hopper._variant(prob, lse), None)
            hopper._seen.discard(hopper._variant(prob, lse))
        fast_calls.clear()
        before = hopper.launches
        first = attnlab.attention(q, k, v, backend="triton", **kw)
        attnlab.attention(q, k, v, backend="triton", **kw)  # the second call starts the compile
        assert hopper.launches == before  # the portable kernel ran both
        background.drain()
        second = attnlab.attention(q, k, v, backend="triton", **kw)  # the fast call, now the Hopper kernel
        fast_calls.clear()
        third = attnlab.attention(q, k, v, backend="triton", **kw)  # the whole way
        assert hopper.launches == before + 1
    finally:
        hopper.set_mode(prev)
    ref = attnlab.reference(q, k, v, **kw)[0]
    for out in (first, second, third):
        assert compare(out, ref).passed
    assert torch.equal(second, third)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("kw", [dict(causal=True), dict()])
def test_gradients_after_the_hopper_forward(kw):
    q, k, v = _qkv(B=2, Hq=8, Hkv=2, Nq=300, Nk=300, D=128, device="cuda", seed=4)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    prev, before = hopper.set_mode("sync"), hopper.launches
    try:
        attnlab.attention(*leaves, backend="triton", **kw).backward(dout)
    finally:
        hopper.set_mode(prev)
    assert hopper.launches == before + 1
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    attnlab.reference(*ref, **kw)[0].backward(dout.double())
    for name, a, r in zip("qkv", leaves, ref):
        err = (a.grad.double() - r.grad).abs().max().item()
        assert err <= 2e-2 * r.grad.abs().max().item(), f"d{name}: {err:.3g}"


@pytest.mark.gpu
@needs_sm90
def test_graph_capture_and_compile_fullgraph():
    from attnlab.bench.replay import capture

    q, k, v = _qkv(B=2, Hq=8, Hkv=8, Nq=512, Nk=512, D=128, device="cuda", seed=6)
    prev, before = hopper.set_mode("sync"), hopper.launches
    try:
        graph, out = capture(lambda: attnlab.attention(q, k, v, causal=True, backend="triton"))
        assert hopper.launches > before, "the captured call did not run the Hopper kernel"
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        want = attnlab.attention(q, k, v, causal=True, backend="triton")
        assert torch.equal(out, want)

        def f(q, k, v):
            return attnlab.attention(q, k, v, causal=True, backend="triton")

        torch._dynamo.reset()
        assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), want)
    finally:
        hopper.set_mode(prev)
