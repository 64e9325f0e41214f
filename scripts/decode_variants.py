"""Decode variants side by side on a GPU: registers, spills and shared memory of each compiled split kernel,
and GPU time by CUDA-graph replay for dense and paged caches, by config; the host cost of one Triton launch
and one torch.empty. A variant module
(a decode_kernels.py of another commit, ``git show REV:attnlab/backends/triton/decode_kernels.py >
scripts/_decode_kernels_REV.py``) replaces the split kernel by name.

Usage: ``PYTHONPATH=.:scripts python3 scripts/decode_variants.py [variant-module ...]``."""

from __future__ import annotations

import importlib
import sys

import torch

from attnlab.backends.triton import decode as td
from attnlab.problem import make_problem

sys.path.insert(0, "scripts")
from decode_profile import decode_inputs, graph_us, paged_cache
from host_time import host_us


def compiled_info() -> str:
    out = []
    for plan in td._PLANS.values():
        for split, _ in plan.kernels.values():
            for k in split.compiled.values():
                out.append(f"regs{k.n_regs} spills{k.n_spills} smem{k.metadata.shared}")
    return ",".join(sorted(set(out)))


CONFIGS = [None, td.DecodeConfig(64, 4, 2, 128), td.DecodeConfig(64, 4, 2, 96), td.DecodeConfig(64, 4, 2, 80)]


def run_variant(name: str, configs=CONFIGS) -> None:
    if name != "current":
        mod = importlib.import_module(name)
        td.decode_split_kernel = mod.decode_split_kernel
    for B, Hkv, Nk in [(1, 8, 32768), (8, 8, 8192), (8, 32, 8192), (1, 32, 131072)]:
        q, k, v = decode_inputs(B, Hkv, Nk)
        prob = make_problem(q, k, v)
        ref = torch.empty_like(q)
        out = torch.empty_like(q)
        td._PLANS.clear()
        td.decode_forward(prob, ref, None, splits=1)
        caches = {}
        for bs in (16, 64):
            caches[bs] = paged_cache(prob, k, v, bs)
        for cfg in configs:
            line = []
            for bs, pk in [(0, None), *caches.items()]:
                td._PLANS.clear()
                try:
                    us = graph_us(lambda pk=pk, cfg=cfg, p=prob, o=out:
                                  td.decode_forward(p, o, None, paged=pk, config=cfg))
                except Exception as e:
                    line.append(f"{f'paged{bs}' if bs else 'dense'} {type(e).__name__}")
                    continue
                plan = next(iter(td._PLANS.values()))
                err = (out.float() - ref.float()).abs().max().item()
                line.append(f"{f'paged{bs}' if bs else 'dense'} {us:.1f} S{plan.n_split} err{err:.0e} "
                            f"[{compiled_info()}]")
            mr = cfg.maxnreg if cfg else None
            print(f"{name:20s} maxnreg={mr} B{B} Hkv{Hkv} Nk{Nk}: {' | '.join(line)}", flush=True)


def launch_cost() -> None:
    """Host us of one split-kernel launch through the compiled launcher with fixed int arguments."""
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
    prob = make_problem(q, k, k)
    out = torch.empty_like(q)
    td._PLANS.clear()
    td.decode_forward(prob, out, None, splits=1)
    td.decode_forward(prob, out, None, splits=1)
    plan = next(iter(td._PLANS.values()))
    split, _ = plan.kernels[False]
    key, kern = next(iter(split.compiled.items()))
    seen = {}
    run = kern.run

    class Proxy:
        def __getattr__(self, name):
            return getattr(kern, name)

        def run(self, *a):
            seen["a"] = a
            return run(*a)
    split.compiled[key] = Proxy()
    fast = plan.fast_call(prob, out, None)
    fast(q, k, k, None, None, None, None)
    split.compiled[key] = kern
    fast = plan.fast_call(prob, out, None)
    a = seen["a"]
    dev = torch.device("cuda", 0)
    td.decode_forward(prob, out, None, splits=2)
    td.decode_forward(prob, out, None, splits=2)
    fast2 = td.gpu_plan(prob, None, 2).fast_call(prob, out, None)
    print(f"host us: fast call S=2 {host_us(lambda: fast2(q, k, k, None, None, None, None)):.2f}", flush=True)
    fast_us = host_us(lambda: fast(q, k, k, None, None, None, None))
    empty_us = host_us(lambda: torch.empty((1, 32, 1, 128), dtype=torch.bfloat16, device=dev))
    print(f"host us: launcher {host_us(lambda: run(*a)):.2f} ({len(a)} args)  fast call {fast_us:.2f}  torch.empty "
          f"{empty_us:.2f}  empty_like {host_us(lambda: torch.empty_like(q)):.2f}  q.new_empty "
          f"{host_us(lambda: q.new_empty((1, 32, 1, 128))):.2f}", flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    launch_cost()
    for name in sys.argv[1:] or ["current"]:
        run_variant(name)
