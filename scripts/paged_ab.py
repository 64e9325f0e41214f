"""The paged cache against the contiguous one on one GPU, per decode-suite configuration and block size: the
working tree's kernel with its paged config, uncapped and with deeper pipelines, and optionally a split-kernel
variant module (``git show REV:attnlab/backends/triton/decode_kernels.py > scripts/_decode_kernels_REV.py``, of
the same signature) with the paged config.
GPU us by CUDA-graph replay, the sides alternated twice (best of each); err: max |paged out - dense out|
(none printed: bit for bit).

Usage: ``PYTHONPATH=.:scripts python3 scripts/paged_ab.py [MODULE]``."""

from __future__ import annotations

import importlib
import sys

import torch
from decode_profile import case_inputs, graph_us, paged_cache

from attnlab.backends.triton import decode as td
from attnlab.bench.suites import decode_suite

CURRENT = td.decode_split_kernel


def variants(module: str | None) -> list[tuple[str, object, td.DecodeConfig]]:
    """The tree's paged config, uncapped, and deeper pipelines at one and two programs per SM
    (block_n/warps/stages); with a variant module, its kernel with the tree's paged config too."""
    sides = [("tree default", CURRENT, td.default_config(torch.bfloat16, 128, paged=True)),
             ("tree 64/4/2 uncapped", CURRENT, td.DecodeConfig(64, 4, 2)),
             ("tree 128/4/3 1/SM", CURRENT, td.DEEP_CONFIG),
             ("tree 64/4/4 2/SM", CURRENT, td.DecodeConfig(64, 4, 4, per_sm=2))]
    if module:
        other = importlib.import_module(module).decode_split_kernel
        sides.append((f"{module.rsplit('_', 1)[-1]} default", other, sides[0][2]))
    return sides


def run(case, sides) -> None:
    prob, q, k, v, _ = case_inputs(case)
    dense, out = torch.empty_like(q), torch.empty_like(q)
    td.decode_split_kernel = CURRENT
    td._PLANS.clear()
    td.decode_forward(prob, dense, None)
    best = {"dense": graph_us(lambda: td.decode_forward(prob, out, None))}
    caches = {bs: paged_cache(prob, k, v, bs) for bs in (16, 64)}
    equal = {}
    for _ in range(2):
        for name, fn, cfg in sides:
            td.decode_split_kernel = fn
            for bs, pk in caches.items():
                td._PLANS.clear()
                td.decode_forward(prob, out, None, paged=pk, config=cfg)
                err = (out.float() - dense.float()).abs().max().item()
                equal[name, bs] = max(equal.get((name, bs), 0.0), err)
                us = graph_us(lambda pk=pk, cfg=cfg: td.decode_forward(prob, out, None, paged=pk, config=cfg))
                best[name, bs] = min(best.get((name, bs), float("inf")), us)
        td.decode_split_kernel = CURRENT
        td._PLANS.clear()
        best["dense"] = min(best["dense"], graph_us(lambda: td.decode_forward(prob, out, None)))
    cells = [f"dense {best['dense']:.1f}"]
    for name, _, _ in sides:
        for bs in caches:
            us = best[name, bs]
            err = equal[name, bs]
            cells.append(f"{name} p{bs} {us:.1f} ({us / best['dense']:.3f}){f' err {err:.0e}' if err else ''}")
    print(f"{case.name:36s} " + " | ".join(cells), flush=True)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    sides = variants(sys.argv[1] if len(sys.argv) > 1 else None)
    for case in decode_suite("cuda"):
        run(case, sides)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
