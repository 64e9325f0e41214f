"""Where a small call's time goes, on a GPU: the harness's measurement of the public call against SDPA's
(several times, interleaved), the same calls timed plainly, by CUDA-graph replay and kernel by kernel
(torch.profiler), and the host cost of each step of attnlab's repeated-call path. Prints a report."""

from __future__ import annotations

import statistics
import sys
import warnings

import torch
from decode_profile import graph_us  # scripts/, beside this one
from host_time import host_us

import attnlab
from attnlab import calls as _calls
from attnlab.bench.competitors import competitors as all_competitors
from attnlab.bench.runner import entered, measure
from attnlab.bench.suites import BenchCase
from attnlab.bench.truth import make_case_inputs


def kernels(fn, n=20):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in p.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            t = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
            out.append(f"{e.key[:60]} x{e.count // n} {t:.1f}us")
    return "; ".join(out)


def event_loop(fn, reps=100):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for r in range(reps):
        ev[r][0].record()
        fn(r)
        ev[r][1].record()
    torch.cuda.synchronize()
    ts = [a.elapsed_time(b) * 1e3 for a, b in ev]
    return statistics.median(ts)


def harness(case: BenchCase, names):
    inp = make_case_inputs(case, "cuda")
    dev = torch.device("cuda")
    comps = {c.name: c for c in all_competitors(names)}
    preps = {n: comps[n].prepare(inp) for n in names}
    for n, p in preps.items():
        ctx = entered(p)  # as the harness enters it: once, around every call
        ctx.__enter__()
        p.call(0)
        torch.cuda.synchronize()
        res = []
        for _ in range(3):
            t, _ = measure(p.call, inp.sets, dev, (100, 20.0, 10), [])
            res.append(f"{t['ms'] * 1e3:.1f}/{t['host_us']:.1f}")
        call0 = lambda p=p: p.call(0)
        rot = [0]

        def call_rot(p=p, rot=rot):
            rot[0] = (rot[0] + 1) % inp.sets
            p.call(rot[0])
        with warnings.catch_warnings(record=True):  # as the harness times its calls
            warnings.simplefilter("always")
            recorded = host_us(call_rot)
        print(f"{case.name} {n:15s} harness ms/host(us) x3: {' '.join(res)} | host plain {host_us(call0):.1f} "
              f"rotating {host_us(call_rot):.1f} recorded {recorded:.1f} | event loop "
              f"median {event_loop(lambda r, p=p: p.call(r % inp.sets)):.1f} | graph {graph_us(call0):.1f} | "
              f"{kernels(call0)}", flush=True)
        ctx.__exit__(None, None, None)


def breakdown(q, k, v, **kw):
    """Host cost of each step of the repeated-call path."""
    attnlab.attention(q, k, v, **kw)
    sig = lambda: _calls.signature(q, k, v, kw.get("kv_len"), None, None, kw.get("block_table"),
                                   kw.get("causal", False), None, None, None, "bhnd", "auto", False)
    key = sig()
    entry = _calls.lookup(key)
    parts = {
        "attention()": lambda: attnlab.attention(q, k, v, **kw),
        "signature": sig,
        "lookup": lambda: _calls.lookup(key),
        "entry(...)": lambda: entry(q, k, v, kw.get("kv_len"), None, None, kw.get("block_table")),
        "torch.empty out": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "current_device": torch.cuda.current_device,
        "is_grad_enabled": torch.is_grad_enabled,
        "is_compiling": torch.compiler.is_compiling,
        "is_capturing": torch.cuda.is_current_stream_capturing,
        "data_ptr x8": lambda: [q.data_ptr() for _ in range(8)],
        "q.stride()": q.stride,
        "q.shape": lambda: q.shape,
    }
    return "  ".join(f"{name} {host_us(fn):.2f}" for name, fn in parts.items())


def main() -> int:
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    lat = [BenchCase("latency", "bf16_b1_h8_n128_d64_causal", B=1, Hq=8, Nq=128, D=64, causal=True),
           BenchCase("latency", "bf16_b4_h16_n512_d64_causal", B=4, Hq=16, Nq=512, D=64, causal=True),
           BenchCase("latency", "bf16_b2_h16_n256_d128_full", B=2, Hq=16, Nq=256, D=128)]
    for case in lat:
        harness(case, ["triton", "triton-kernel", "sdpa-flash", "sdpa-cudnn"])
    dec = BenchCase("decode", "bf16_b1_hq32_hkv8_nk32768_d128", B=1, Hq=32, Hkv=8, Nq=1, Nk=32768, D=128)
    harness(dec, ["triton-decode", "auto-paged16", "sdpa-cudnn", "sdpa-flash"])
    q = torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
    print("breakdown prefill B1 H8 N128 causal (us):", breakdown(q, q, q, causal=True), flush=True)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16)
    print("breakdown decode B1 Hkv8 Nk32k (us):", breakdown(q, k, k), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
