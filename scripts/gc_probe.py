"""Why a host-bound call reads slower in the harness than its host time: Python's garbage collector.

Per latency case and competitor (prepared as the harness prepares it), 1000 back-to-back event-timed calls,
as the harness times them, with the collector on and off: the median event time per call, the collections
per 1000 calls by generation and the milliseconds they took (gc.callbacks), and the GPU time per call by
CUDA-graph replay. Prints one line per (case, competitor).
"""

from __future__ import annotations

import functools
import gc
import sys
import time

import torch
from call_probe import loop  # scripts/, beside this one
from decode_profile import graph_us

from attnlab.bench.competitors import competitors as all_competitors
from attnlab.bench.runner import entered
from attnlab.bench.suites import SUITES
from attnlab.bench.truth import make_case_inputs

_stats = {"n": [0, 0, 0], "t": 0.0, "t0": 0.0}


def _cb(phase, info):
    if phase == "start":
        _stats["t0"] = time.perf_counter()
    else:
        _stats["n"][info["generation"]] += 1
        _stats["t"] += time.perf_counter() - _stats["t0"]


def main() -> int:
    names = sys.argv[1:] or ["triton", "auto", "sdpa-flash", "sdpa-cudnn"]
    print(torch.__version__, torch.cuda.get_device_name(), sys.version.split()[0], gc.get_threshold(), flush=True)
    gc.callbacks.append(_cb)
    dev_cases = SUITES["latency"].cases("cuda")
    for case in dev_cases:
        inp = make_case_inputs(case, "cuda")
        comps = {c.name: c for c in all_competitors(names)}
        for n in names:
            try:
                p = comps[n].prepare(inp)
            except Exception as e:  # unsupported
                print(f"{case.name} {n:12s} skipped: {type(e).__name__}", flush=True)
                continue
            with entered(p):
                call, sets = p.call, inp.sets
                for i in range(50):
                    call(i % sets)
                torch.cuda.synchronize()
                gc.collect()
                _stats.update(n=[0, 0, 0], t=0.0)
                on_us, on_wall = loop(call, sets, 1000)
                counts, gc_ms = list(_stats["n"]), _stats["t"] * 1e3
                gc.collect()
                gc.disable()
                off_us, off_wall = loop(call, sets, 1000)
                gc.enable()
                g = graph_us(functools.partial(call, 0))
            print(f"{case.name:36s} {n:12s} gc on {on_us:6.1f} us (wall {on_wall:6.1f}) collections/1000 {counts} "
                  f"{gc_ms:6.1f} ms | gc off {off_us:6.1f} us (wall {off_wall:6.1f}) | graph {g:5.1f}", flush=True)
            del p, call
    return 0


if __name__ == "__main__":
    sys.exit(main())
