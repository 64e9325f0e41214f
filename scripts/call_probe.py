"""Where a small call's time goes inside the benchmark harness, on a GPU.

Per (case, competitor), each prepared as the harness prepares it (two rotating input sets):

- ``harness``: the harness's own ``measure()`` twice (median ms as us / host us);
- ``loop``: 200 back-to-back calls with CUDA events around each, as the harness times them: the median event
  time and the host's wall time per iteration (events included), and the same loop with no call (the events'
  own host cost);
- ``queued``: that loop behind a long GPU sleep, so the host is far ahead: the GPU's time per call in stream
  order (launch gaps included, host excluded);
- ``idle start``: a synchronize before every call: the host's time up to its first launch plus the GPU time;
- ``host``: the least of 5 rounds of 200 unsynchronized calls (GPU kept busy), and the harness's own
  10-call host measurement five times;
- ``graph``: CUDA-graph replay (GPU time alone).

When the host's time per iteration exceeds the GPU's time per call, the GPU waits between calls and each
event pair also holds the host's time up to the call's first launch: the harness then reads about
``idle start``, not ``queued``. Prints one line per (case, competitor).
"""

from __future__ import annotations

import functools
import gc
import statistics
import sys
import time

import torch
from decode_profile import graph_us  # scripts/, beside this one
from host_time import host_us

from attnlab.bench.competitors import competitors as all_competitors
from attnlab.bench.runner import entered, measure
from attnlab.bench.suites import BenchCase
from attnlab.bench.timing import measure_host
from attnlab.bench.truth import make_case_inputs


def loop(call, sets: int, reps: int = 200, sleep_cycles: int = 0) -> tuple[float, float]:
    """(median event us per call, host wall us per iteration) of ``reps`` event-timed calls."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for r in range(reps):
        ev[r][0].record()
        call(r % sets)
        ev[r][1].record()
    wall = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev), wall


def idle_start(call, sets: int, reps: int = 30) -> float:
    """Median event us of calls each issued to an idle GPU."""
    ts = []
    for r in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(r % sets)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def probe(case: BenchCase, names: list[str]) -> None:
    inp = make_case_inputs(case, "cuda")
    dev = torch.device("cuda")
    comps = {c.name: c for c in all_competitors(names)}
    for n in names:
        p = comps[n].prepare(inp)
        with entered(p):
            call, sets = p.call, inp.sets
            call0 = functools.partial(call, 0)
            call0()
            torch.cuda.synchronize()
            res = []
            for _ in range(2):
                t, _ = measure(call, sets, dev, (30, 100.0, 3), [])
                res.append(f"{t['ms'] * 1e3:.1f}/{t['host_us']:.1f}")
            loop(call, sets, 300)  # warm-up
            ev_us, wall = loop(call, sets)
            _, ev_wall = loop(lambda i: None, sets)
            q_us, q_wall = loop(call, sets, 200, sleep_cycles=40_000_000)
            gc.disable()
            ev_us_nogc, wall_nogc = loop(call, sets)
            gc.enable()
            idle = idle_start(call, sets)
            plain = host_us(call0)
            h10 = [measure_host(call, sets, 10, dev)[0] for _ in range(5)]
            g = graph_us(call0)
        print(f"{case.name} {n:14s} harness {' '.join(res)} | loop {ev_us:.1f} wall {wall:.1f} (no gc {ev_us_nogc:.1f}"
              f" wall {wall_nogc:.1f}; events alone wall {ev_wall:.1f}) | queued {q_us:.1f} wall {q_wall:.1f} | "
              f"idle start {idle:.1f} | host {plain:.1f}, harness's 10-call {' '.join(f'{h:.0f}' for h in h10)} | "
              f"graph {g:.1f}", flush=True)
        del p, call, call0


def main() -> int:
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    dec = [("bf16_b1_hq32_hkv8_nk32768_d128", 1, 8, 32768), ("bf16_b16_hq32_hkv8_nk4096_d128", 16, 8, 4096),
           ("bf16_b8_hq32_hkv8_nk8192_d128", 8, 8, 8192), ("bf16_b1_hq32_hkv8_nk131072_d128", 1, 8, 131072)]
    for name, B, Hkv, Nk in dec:
        case = BenchCase("decode", name, B=B, Hq=32, Hkv=Hkv, Nq=1, Nk=Nk, D=128)
        probe(case, ["triton-decode", "sdpa-cudnn", "sdpa-flash"])
    lat = BenchCase("latency", "bf16_b1_h8_n128_d64_causal", B=1, Hq=8, Nq=128, D=64, causal=True)
    probe(lat, ["triton", "sdpa-flash", "sdpa-cudnn"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
