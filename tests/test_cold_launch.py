"""First launches without Triton's C glue (attnlab.backends.triton.cold_launch): the parameter packing, the compile
that never builds Triton's driver module, the hand-over to Triton's launcher, and on a GPU, first calls that agree
bit for bit with the launches after them."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from attnlab.backends.triton import cold_launch, runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_parameter_types_skip_constexprs_and_end_with_the_two_scratch_pointers():
    sig = {"Q": "*bf16", "N": "i32", "STRIDE": "i64", "scale": "fp32", "BLOCK": "constexpr", "flag": "i1",
           "one": "constexpr"}
    types = cold_launch.parameter_types(sig)
    assert types == [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_int8,
                     ctypes.c_void_p, ctypes.c_void_p]


@pytest.mark.parametrize("ty", ["fp16", "bf16", "nvTmaDesc", "tensordesc<bf16[64, 64]>", ("i32", "i32")])
def test_parameter_types_refuse_what_the_driver_launch_does_not_pack(ty):
    assert cold_launch.parameter_types({"a": "*fp32", "b": ty}) is None


def test_runtime_values_take_addresses_and_drop_constexprs():
    t = torch.zeros(4)
    sig = {"X": "*fp32", "N": "i32", "B": "constexpr", "s": "fp32"}
    assert cold_launch.runtime_values(sig, (t, 7, 64, 0.5)) == [t.data_ptr(), 7, 0.5]
    with pytest.raises(ValueError):  # one value per parameter, or it is not this kernel's call
        cold_launch.runtime_values(sig, (t, 7, 64))


def test_pack_points_at_each_value_and_nulls_the_scratch():
    types = cold_launch.parameter_types({"X": "*fp32", "N": "i32", "M": "i64", "s": "fp32"})
    params, keep = cold_launch.pack(types, [0xDEAD0, -3, 2**40, 0.25])
    got = [ctypes.cast(params[i], ctypes.POINTER(ty)).contents.value for i, ty in enumerate(types)]
    assert got == [0xDEAD0, -3, 2**40, 0.25, None, None]
    assert len(keep) == 6


def test_the_cold_path_is_gated_by_version_and_switch(monkeypatch):
    monkeypatch.setattr(cold_launch, "_libcuda", lambda: object())
    monkeypatch.setattr(cold_launch, "_version", lambda: (3, 6))
    assert cold_launch.usable()
    monkeypatch.setattr(cold_launch, "ENABLED", False)
    assert not cold_launch.usable()
    monkeypatch.setattr(cold_launch, "ENABLED", True)
    for version in [(3, 4), (3, 7), (3, 9), None]:
        monkeypatch.setattr(cold_launch, "_version", lambda v=version: v)
        assert not cold_launch.usable()


class _FakeCold:
    def __init__(self) -> None:
        self.ready, self.calls = False, []

    def launch(self, grid, stream, values) -> None:
        self.calls.append((grid, stream, list(values)))


def test_a_cold_kernel_launches_cold_until_its_triton_launcher_is_ready(monkeypatch):
    cold = _FakeCold()
    kernel = SimpleNamespace(attnlab_cold=cold, src=SimpleNamespace(signature={"X": "*fp32", "B": "constexpr"}))
    warm_calls = []
    monkeypatch.setattr(runtime, "_warm_launcher", lambda k: lambda g, s, a: warm_calls.append((g, s, a)))
    go = runtime.launcher(kernel)
    go((1, 1, 1), 5, (123, 64))
    assert cold.calls == [((1, 1, 1), 5, [123])] and warm_calls == []
    runtime.run_compiled(kernel, (2, 1, 1), 6, (456, 64))
    assert cold.calls[-1] == ((2, 1, 1), 6, [456])
    cold.ready = True
    go((3, 1, 1), 7, (789, 64))
    assert warm_calls == [((3, 1, 1), 7, (789, 64))] and len(cold.calls) == 2


_OFFLINE = """
import json, os, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from attnlab.backends.triton import cold_launch, configs, forward
from attnlab.backends.triton.configs import Config
from attnlab.problem import make_problem

g = torch.Generator().manual_seed(int(sys.argv[1]))
q = torch.randn(1, 2, 33, 64, generator=g).to(torch.bfloat16)
prob = make_problem(q, q.clone(), q.clone(), causal=True)
cfg = Config(block_m=64, block_n=64, num_warps=4, num_stages=2)
head, mid, tail, constants = forward._arguments(prob, cfg, False, False)
args = forward._bind(head, mid, tail, torch.empty_like(q), None)
kw = dict(constants, num_warps=4, num_stages=2, **configs.COMPILE_OPTIONS)
target = GPUTarget("cuda", 90, 32)
compiled, values = cold_launch.compile_only(forward._k.attn_fwd_kernel, args, kw, 0, target=target)
again, _ = cold_launch.compile_only(forward._k.attn_fwd_kernel, args, kw, 0, target=target)
sig = compiled.src.signature
print(json.dumps(dict(
    driver_made=driver._active is not None, same=again is compiled, name=compiled.name,
    n_types=len(cold_launch.parameter_types(sig)), n_values=len(cold_launch.runtime_values(sig, values)),
    n_params=len(forward._k.attn_fwd_kernel.params), n_bound=len(values),
    eligible=cold_launch._eligible(compiled) is not None, cubin=len(compiled.kernel))))
"""


def test_the_compile_never_builds_tritons_driver_module():
    """In a new process (nothing built before): the forward kernel compiles for sm_90 through the JIT's binder,
    Triton's driver object is never made, and the kernel's parameters are its runtime values plus two scratch
    pointers."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    from triton.runtime import jit

    if not hasattr(jit, "compute_cache_key"):  # triton 3.4: first launches go through its JIT
        pytest.skip(f"triton {triton.__version__}'s JIT has no compute_cache_key, which the cold path's compile uses")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_OFFLINE), "3"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["driver_made"] is False
    assert got["same"] is True and got["name"] == "attn_fwd_kernel" and got["cubin"] > 1000
    assert got["n_bound"] == got["n_params"]
    assert got["n_types"] == got["n_values"] + 2 and got["eligible"] is True


_GPU_FIRST_CALLS = """
import json, os, sys, tempfile
for var in ("TRITON_CACHE_DIR", "ATTNLAB_CACHE_DIR", "CUPY_CACHE_DIR"):
    os.environ[var] = tempfile.mkdtemp()
import torch
import attnlab
from attnlab.backends.triton import background, cold_launch, forward, runtime
from triton.runtime import driver

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(int(sys.argv[1]))
q = torch.randn(2, 4, 301, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
k = torch.randn(2, 2, 301, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
v = torch.randn(2, 2, 301, 64, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
do = torch.randn(2, 4, 301, 64, device=dev, dtype=torch.bfloat16, generator=g)
report = dict(usable=cold_launch.usable())
with torch.no_grad():
    first = attnlab.attention(q, k, v, causal=True, backend="triton")
    torch.cuda.synchronize()
kernels = [kn for p in forward._PLANS.values() for kn in p.kernels.values()]
report["forward_cold"] = [cold_launch.cold_kernel(kn) is not None for kn in kernels]
with torch.no_grad():
    second = attnlab.attention(q, k, v, causal=True, backend="triton")
out = attnlab.attention(q, k, v, causal=True, backend="triton")
dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
qd = q.detach()[:, :, :1].contiguous()
kd, vd = (torch.randn(2, 2, 4096, 64, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
with torch.no_grad():  # long enough for several splits: the split kernel, then the merge
    dec_first = attnlab.attention(qd, kd, vd, causal=True, align="bottom_right", backend="triton-decode")
torch.cuda.synchronize()
from attnlab.backends.triton import decode
decode_kernels = [c for p in decode._PLANS.values() for pair in p.kernels.values() for kn in pair
                  for c in kn.compiled.values()]
report["decode_cold"] = [(bool(c.metadata.launch_pdl), cold_launch.cold_kernel(c) is not None)
                         for c in decode_kernels]
background.settle()
report["ready"] = all(cold_launch.cold_kernel(kn).ready for kn in kernels)
report["driver_made"] = driver._active is not None
with torch.no_grad():
    third = attnlab.attention(q, k, v, causal=True, backend="triton")
    dec_again = attnlab.attention(qd, kd, vd, causal=True, align="bottom_right", backend="triton-decode")
out2 = attnlab.attention(q, k, v, causal=True, backend="triton")
dq2, dk2, dv2 = torch.autograd.grad(out2, (q, k, v), do)
torch.cuda.synchronize()
ref = attnlab.reference(q.detach(), k.detach(), v.detach(), causal=True)[0]
ref_dec = attnlab.reference(qd, kd, vd, causal=True, align="bottom_right")[0]
report["hopper"] = torch.cuda.get_device_capability()[0] >= 9
report["compiled"] = {f.__name__: runtime.compiled_count(f) for f in (forward._k.attn_fwd_kernel,)}
report.update(
    same_fwd=bool(torch.equal(first, second) and torch.equal(first, third) and torch.equal(out, out2)),
    same_bwd=bool(torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)),
    same_decode=bool(torch.equal(dec_first, dec_again)),
    fwd_err=float((first.double() - ref.double()).abs().max()),
    decode_err=float((dec_first.double() - ref_dec.double()).abs().max()),
    finite=bool(torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()))
print(json.dumps(report))
"""


@pytest.mark.gpu
def test_first_calls_launch_cold_and_agree_bit_for_bit_with_tritons_launcher():
    """A new process with empty caches: the forward's first launch takes the cold path; the forward, backward and
    decode first calls equal, bit for bit, the calls made after Triton's launchers are built; the forward is
    within bf16 rounding of the float64 reference."""
    # the portable kernel's launch routes: the Hopper forward (compiled in the background, so later calls would
    # run another kernel) is off here; tests/test_hopper.py covers it
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNLAB_HOPPER="0")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_GPU_FIRST_CALLS), "11"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if not got["usable"]:
        pytest.skip(f"the cold path does not apply to triton {triton.__version__}")
    assert got["forward_cold"] and all(got["forward_cold"])
    # the decode's split kernel and its merge, the merge a programmatic dependent launch on Hopper: all cold
    assert len(got["decode_cold"]) == 2 and all(cold for _, cold in got["decode_cold"])
    assert any(pdl for pdl, _ in got["decode_cold"]) == got["hopper"]
    assert got["ready"] and got["driver_made"]
    assert got["same_fwd"] and got["same_bwd"] and got["same_decode"] and got["finite"]
    assert got["fwd_err"] < 2e-2 and got["decode_err"] < 2e-2
    # one variant without lse and one with (the call that needs a gradient): nothing compiled twice
    assert got["compiled"] == {"attn_fwd_kernel": 2}


def test_the_pdl_launch_config_has_cuda_hs_layout():
    """``CUlaunchConfig`` and ``CUlaunchAttribute`` as cuda.h lays them out on x86-64 (sizes and offsets), with
    one attribute: programmatic stream serialization allowed."""
    import ctypes

    assert ctypes.sizeof(cold_launch.LaunchAttribute) == 72 and cold_launch.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(cold_launch.LaunchConfig) == 56
    assert [getattr(cold_launch.LaunchConfig, f).offset for f in ("hStream", "attrs", "numAttrs")] == [32, 40, 48]
    config, _attr = cold_launch.pdl_config((5, 3, 2), 256, 4096, 77)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY) == (5, 3, 2, 256, 1)
    assert (config.sharedMemBytes, config.hStream, config.numAttrs) == (4096, 77, 1)
    assert config.attrs.contents.id == 6 and list(config.attrs.contents.value)[:2] == [1, 0]


def test_values_rebuilt_for_a_direct_launch_are_the_binders():
    """A direct launch rebuilds every parameter's value from the arguments and keywords
    (:func:`runtime.bound_values`): the same values, in the same order, as Triton's binder gives them (the
    backward's three launches here)."""
    from triton.backends.compiler import GPUTarget

    from attnlab.backends.triton import bwd_launch, runtime
    from attnlab.backends.triton.configs import BwdConfig
    from attnlab.problem import make_problem

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g) for _ in range(3))
    prob = make_problem(q, k, v, causal=True, sinks=torch.randn(3, generator=g))
    o, rows = torch.empty_like(q), torch.empty(2, 3, 40)
    cfg = BwdConfig(16, 16, 1, 1)
    for fn, _, args, kw in (bwd_launch.preprocess_launch(prob, o, rows, o, rows, rows, False),
                            bwd_launch.preprocess_launch(prob, o, rows, o, rows, rows, False, torch.empty(12)),
                            bwd_launch.dkdv_launch(prob, o, rows, rows, torch.empty_like(k), torch.empty_like(v), cfg,
                                                  False),
                            bwd_launch.dq_launch(prob, o, rows, rows, torch.empty_like(q), cfg, False)):
        bound, _, _ = cold_launch._binding(fn, GPUTarget("cuda", 90, 32)).binder(*args, **kw)
        assert tuple(bound.values()) == runtime.bound_values(args, kw, runtime.later_parameters(fn, len(args)))
