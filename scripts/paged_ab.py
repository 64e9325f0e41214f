"""The paged cache's block-table reads, A/B on one GPU: a split-kernel variant module (``git show
REV:attnlab/backends/triton/decode_kernels.py > scripts/_decode_kernels_REV.py``) against the working tree's
kernel, each with its paged configs, beside the dense cache, per decode-suite configuration and block size.
GPU us by CUDA-graph replay, the two sides alternated twice (best of each); every paged output is compared
with the dense one bit for bit.

Usage: ``PYTHONPATH=.:scripts python3 scripts/paged_ab.py MODULE``."""

from __future__ import annotations

import importlib
import sys

import torch
from decode_profile import graph_us, paged_cache

from attnlab.backends.triton import decode as td
from attnlab.bench.suites import decode_suite
from attnlab.problem import make_problem

CURRENT = td._decode_split_kernel


def variants(module: str) -> list[tuple[str, object, td.DecodeConfig]]:
    other = importlib.import_module(module)._decode_split_kernel
    return [(f"{module[-7:]} 64/4/2/128", other, td.DecodeConfig(64, 4, 2, 128)),
            ("tree 64/4/3/128", CURRENT, td.DecodeConfig(64, 4, 3, 128)),
            ("tree 64/4/3/none", CURRENT, td.DecodeConfig(64, 4, 3)),
            ("tree 64/4/2/128", CURRENT, td.DecodeConfig(64, 4, 2, 128))]


def run(case, sides) -> None:
    B, Hkv, Nk = case.B, case.Hkv, case.Nk
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, case.Hq, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kw = {} if case.kv_len is None else {"kv_len": torch.tensor(case.kv_len, device="cuda", dtype=torch.int32)}
    prob = make_problem(q, k, v, **kw)
    dense, out = torch.empty_like(q), torch.empty_like(q)
    td._decode_split_kernel = CURRENT
    td._PLANS.clear()
    td.decode_forward(prob, dense, None)
    best = {"dense": graph_us(lambda: td.decode_forward(prob, out, None))}
    caches = {bs: paged_cache(prob, k, v, bs) for bs in (16, 64)}
    equal = {}
    for _ in range(2):
        for name, fn, cfg in sides:
            td._decode_split_kernel = fn
            for bs, pk in caches.items():
                td._PLANS.clear()
                td.decode_forward(prob, out, None, paged=pk, config=cfg)
                equal[name, bs] = equal.get((name, bs), True) and torch.equal(out, dense)
                us = graph_us(lambda pk=pk, cfg=cfg: td.decode_forward(prob, out, None, paged=pk, config=cfg))
                best[name, bs] = min(best.get((name, bs), float("inf")), us)
        td._decode_split_kernel = CURRENT
        td._PLANS.clear()
        best["dense"] = min(best["dense"], graph_us(lambda: td.decode_forward(prob, out, None)))
    cells = [f"dense {best['dense']:.1f}"]
    for name, _, _ in sides:
        for bs in caches:
            us = best[name, bs]
            cells.append(f"{name} p{bs} {us:.1f} ({us / best['dense']:.3f}){'' if equal[name, bs] else ' DIFFERS'}")
    print(f"{case.name:36s} " + " | ".join(cells), flush=True)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    sides = variants(sys.argv[1])
    for case in decode_suite("cuda"):
        run(case, sides)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
