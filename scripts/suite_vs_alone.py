"""One decode case's public call timed as the suite times it and alone, to tell a slow input from a slow
context: the split count of its plan, the event-timed loop (median us) and CUDA-graph replay, on the case's
own two input sets and on freshly drawn tensors of the same shapes, then the same calls after a float64
reference of the case has run (as the suite's checker runs one first). Usage: suite_vs_alone.py B HKV NK."""

from __future__ import annotations

import sys

import torch
from call_probe import loop  # scripts/, beside this one
from decode_profile import graph_us

import attnlab
from attnlab.backends.triton import decode as td
from attnlab.bench.suites import BenchCase
from attnlab.bench.truth import make_case_inputs
from attnlab.problem import make_problem


def report(label: str, qs, ks, vs) -> None:
    call = lambda i: attnlab.attention(qs[i], ks[i], vs[i], backend="triton-decode")
    call(0)
    loop(call, len(qs), 300)
    med, wall = loop(call, len(qs))
    plan = td.gpu_plan(make_problem(qs[0], ks[0], vs[0]))
    print(f"{label}: S={plan.n_split} grid={plan.grid} loop {med:.1f} (wall {wall:.1f}) graph set0 "
          f"{graph_us(lambda: call(0)):.1f} set1 {graph_us(lambda: call(1 % len(qs))):.1f}", flush=True)


def main() -> int:
    B, Hkv, Nk = (int(x) for x in sys.argv[1:4])
    case = BenchCase("decode", "probe", B=B, Hq=32, Hkv=Hkv, Nq=1, Nk=Nk, D=128)
    inp = make_case_inputs(case, "cuda")
    report(f"B{B} Hkv{Hkv} Nk{Nk} case inputs", inp.qs, inp.ks, inp.vs)
    fresh = [torch.randn_like(t) for t in inp.ks], [torch.randn_like(t) for t in inp.vs]
    report(f"B{B} Hkv{Hkv} Nk{Nk} fresh k, v", inp.qs, *fresh)
    attnlab.reference(inp.qs[0], inp.ks[0], inp.vs[0])
    torch.cuda.synchronize()
    report(f"B{B} Hkv{Hkv} Nk{Nk} case inputs after a reference", inp.qs, inp.ks, inp.vs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
