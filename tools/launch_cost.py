"""Host cost of a Triton launch by argument count (through Triton's launcher object, runtime.run_compiled, and
through its C launch function, runtime.launcher), of the allocations a call makes, and of the public call beside
F.sdpa on the same tensors, with fast calls made with and without the direct C launch and (decode) with the split
states held per stream or allocated per call (``ab``: only that part),
on the GPU it runs on: least of 5 rounds of 200 unsynchronized calls, the GPU kept busy."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import torch
import triton
from host_time import host_us

import attnlab
from attnlab import fast_calls as _calls
from attnlab.backends.triton import decode_launch as _decode
from attnlab.backends.triton import runtime as _runtime
from attnlab.backends.triton.runtime import launcher, run_compiled
from attnlab.bench.replay import decode_inputs


def _kernel_with(n: int):
    """A one-program kernel with one pointer, ``n`` int arguments and one constexpr (written to a module
    file: triton.jit reads a function's source)."""
    names = [f"a{i}" for i in range(n)]
    total = " + ".join(names) if names else "0"
    src = ("import triton\nimport triton.language as tl\n\n@triton.jit\n"
           f"def k(X, {''.join(a + ', ' for a in names)}C: tl.constexpr):\n"
           f"    tl.store(X, {total} + C)\n")
    path = os.path.join(tempfile.mkdtemp(), f"k{n}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"k{n}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.k


def launcher_cost() -> None:
    x = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = triton.runtime.driver.active.get_current_stream(0)
    for n in (0, 8, 16, 32, 48, 64, 80):
        fn = _kernel_with(n)
        ints = tuple(range(3, 3 + n))  # not 1 and not multiples of 16 mostly: plain int parameters
        kern = fn[(1, 1, 1)](x, *ints, C=7)
        full = (x.data_ptr(), *ints, 7)

        def go(kern=kern, full=full):
            run_compiled(kern, (1, 1, 1), stream, full)

        direct = launcher(kern)
        print(f"launch {n:2d} int args: launcher object {host_us(go):6.2f} us, direct "
              f"{host_us(lambda d=direct, f=full: d((1, 1, 1), stream, f)):6.2f} us", flush=True)


def alloc_cost() -> None:
    dev = torch.device("cuda", 0)
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    n = 32 * 64 * 130
    rows = {
        "torch.empty(n, dtype, device)": lambda: torch.empty(n, dtype=torch.float32, device=dev),
        "torch.empty(n, dtype, device=str)": lambda: torch.empty(n, dtype=torch.float32, device="cuda"),
        "q.new_empty(n, dtype)": lambda: q.new_empty(n, dtype=torch.float32),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.empty_like(q, contiguous)": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
        "torch.empty(q.shape, dtype, device)": lambda: torch.empty(q.shape, dtype=q.dtype, device=dev),
        "q.new_empty(q.shape)": lambda: q.new_empty(q.shape),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch._C._cuda_isCurrentStreamCapturing()": torch._C._cuda_isCurrentStreamCapturing,
        "torch.ops.aten.empty.memory_format": lambda: torch.ops.aten.empty.memory_format(
            [n], dtype=torch.float32, device=dev),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "current_stream(0)": lambda: triton.runtime.driver.active.get_current_stream(0),
        "q.data_ptr()": q.data_ptr,
    }
    for name, fn in rows.items():
        print(f"{name:40s} {host_us(fn):6.2f} us", flush=True)


def interleaved(fns: dict, rounds: int = 7, n: int = 200) -> dict:
    """host_us of each function, the least over ``rounds`` rounds that visit every function in turn (so a
    drifting host weighs on all of them alike)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], host_us(fn, n=n, rounds=1))
    return best


def _entry(q, k, v, direct: bool, **kw):
    """The fast call of ``attention(q, k, v, **kw)``'s signature, made with or without the direct C launch."""
    _runtime.DIRECT_LAUNCH = direct
    _calls.clear()
    attnlab.attention(q, k, v, **kw)  # the whole way, which makes the fast call
    attnlab.attention(q, k, v, **kw)
    key = next(iter(_calls._CALLS))
    return key, _calls._CALLS[key]


def ab_calls(label: str, q, k, v, **kw) -> None:
    """The public call (fast calls made with and without the direct C launch) beside F.sdpa on the same
    tensors, interleaved."""
    gqa = q.shape[1] != k.shape[1]
    causal = kw.get("causal", False)
    key, via_object = _entry(q, k, v, False, **kw)
    _, direct = _entry(q, k, v, True, **kw)
    table = _calls._CALLS

    def with_entry(entry, hold=True):
        def call():
            table[key] = entry
            _decode.HOLD_WORKSPACE = hold
            return attnlab.attention(q, k, v, **kw)
        return call

    fns = {
        "attention() direct launch": with_entry(direct),
        "attention() launcher object": with_entry(via_object),
        "attention() direct, states per call": with_entry(direct, hold=False),
        "F.sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                          enable_gqa=gqa),
    }
    for name, us in interleaved(fns).items():
        print(f"{label}: {name:36s} {us:6.2f} us", flush=True)
    _decode.HOLD_WORKSPACE = True


def ab_all() -> None:
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for B, H, N, D, causal in ((1, 8, 128, 64, True), (4, 16, 512, 64, True), (2, 16, 256, 128, False)):
        q, k, v = (torch.randn(B, H, N, D, **bf) for _ in range(3))
        ab_calls(f"prefill B{B} H{H} N{N} D{D} causal={causal}", q, k, v, causal=causal)
    for B, Hkv, Nk in ((1, 8, 32768), (8, 8, 8192), (8, 32, 8192), (1, 8, 131072)):
        q, k, v = decode_inputs(B, Hkv, Nk)
        ab_calls(f"decode B{B} Hkv{Hkv} Nk{Nk}", q, k, v)
        lens = torch.randint(Nk // 2, Nk + 1, (B,), device="cuda", dtype=torch.int32)
        ab_calls(f"decode B{B} Hkv{Hkv} Nk{Nk} kv_len", q, k, v, kv_len=lens)


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    if sys.argv[1:] != ["ab"]:
        launcher_cost()
        alloc_cost()
    ab_all()
