"""The direct driver launch (attnlab.backends.triton.driver_launch) on CPU: a fake compiled kernel and a fake
driver that reads back what cuLaunchKernel would receive, so the parameter packing is checked byte for byte.
The real launches are checked on the GPU (tests/test_public_call_gpu.py compares them with Triton's)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")

from attnlab.backends.triton import driver_launch as dl  # noqa: E402

SIGNATURE = {"X": "*bf16", "n": "i32", "big": "i64", "s": "fp32", "C": "constexpr", "Y": "*fp32", "u": "u64"}
READ = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint64]


def _kernel(**meta):
    base = dict(num_warps=4, shared=1024, global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                launch_pdl=False, launch_cooperative_grid=False)
    return SimpleNamespace(src=SimpleNamespace(signature=dict(SIGNATURE)), metadata=SimpleNamespace(**{**base, **meta}),
                           function=0xABC)


class FakeDriver:
    """Stands in for libcuda: one current context, and launches recorded with their parameter values."""

    def __init__(self, context=0x77, error=0):
        self.ctx, self.error, self.launches = context, error, []

    def current(self, ptr):
        ptr.contents.value = self.ctx
        return 0

    def launch(self, f, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        ptrs = [args[i] for i in range(len(READ) + 2)]
        values = [kind.from_address(p).value for kind, p in zip(READ, ptrs)]
        scratch = [ctypes.c_uint64.from_address(p).value for p in ptrs[len(READ):]]
        self.launches.append(dict(f=f, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, stream=stream,
                                  values=values, scratch=scratch, extra=extra))
        return self.error

    def context(self):
        return self.ctx

    def message(self, code):
        return f"error {code}"


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(dl, "_DRIVER", drv)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    return drv


ARGS = (0, 5, 2**40 + 3, 0.5, 7, 0, 2**63 + 11)  # X, n, big, s, C (constexpr), Y, u


def test_a_launch_passes_every_parameter_in_signature_order(fake):
    d = dl.direct_launch(_kernel(), (2, 3, 1), ARGS, changing=(0, 5))
    assert d is not None
    assert d(99, 0x1000, 0x2000) is True
    assert d(98, 0x3000, 0x4000) is True  # only the changing slots move
    first, second = fake.launches
    assert first["f"] == 0xABC and first["grid"] == (2, 3, 1) and first["block"] == (128, 1, 1)
    assert first["smem"] == 1024 and first["stream"] == 99 and first["extra"] is None
    assert first["values"] == [0x1000, 5, 2**40 + 3, 0.5, 0x2000, 2**63 + 11]
    assert first["scratch"] == [0, 0]  # the global and profile scratch pointers, null
    assert second["values"] == [0x3000, 5, 2**40 + 3, 0.5, 0x4000, 2**63 + 11] and second["stream"] == 98


def test_a_changing_int_parameter_is_written_in_its_own_width(fake):
    d = dl.direct_launch(_kernel(), (1, 1, 1), ARGS, changing=(0, 1, 5))
    d(1, 0x10, -9, 0x20)
    assert fake.launches[0]["values"][:2] == [0x10, -9] and fake.launches[0]["values"][4] == 0x20


def test_another_threads_context_declines_the_launch(fake):
    d = dl.direct_launch(_kernel(), (1, 1, 1), ARGS, changing=(0, 5))
    fake.ctx = 0x78
    assert d(1, 0x10, 0x20) is False and fake.launches == []


def test_a_driver_error_is_raised(fake):
    d = dl.direct_launch(_kernel(), (1, 1, 1), ARGS, changing=(0, 5))
    fake.error = 700
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: error 700"):
        d(1, 0x10, 0x20)


@pytest.mark.parametrize("why", ["fixed pointer", "scratch", "profile", "cluster", "pdl", "unknown type", "old triton",
                                 "arity", "empty grid", "switched off"])
def test_what_it_does_not_mirror_keeps_tritons_launcher(fake, monkeypatch, why):
    kernel, grid, changing = _kernel(), (1, 1, 1), (0, 5)
    if why == "fixed pointer":
        changing = (0,)
    elif why == "scratch":
        kernel = _kernel(global_scratch_size=64)
    elif why == "profile":
        kernel = _kernel(profile_scratch_size=64)
    elif why == "cluster":
        kernel = _kernel(num_ctas=2)
    elif why == "pdl":
        kernel = _kernel(launch_pdl=True)
    elif why == "unknown type":
        kernel.src.signature["s"] = "bf16"
    elif why == "old triton":
        monkeypatch.setattr(triton, "__version__", "3.5.1")
    elif why == "arity":
        kernel.src.signature["extra"] = "i32"
    elif why == "empty grid":
        grid = (0, 1, 1)
    elif why == "switched off":
        monkeypatch.setattr(dl, "DIRECT_LAUNCH", False)
    assert dl.direct_launch(kernel, grid, ARGS, changing) is None
    assert dl.direct_launch(_kernel(), (1, 1, 1), ARGS, (0, 5)) is not None or why in ("old triton", "switched off")


def test_idle_hooks_sees_a_launch_hook():
    runtime = triton.knobs.runtime
    assert dl.idle_hooks(runtime)

    def hook(*args):
        return None

    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert not dl.idle_hooks(runtime)
        finally:
            chain.remove(hook)
    assert dl.idle_hooks(SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    assert not dl.idle_hooks(SimpleNamespace(launch_enter_hook=hook, launch_exit_hook=None))
    assert dl.idle_hooks(runtime)
