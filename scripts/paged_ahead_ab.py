"""A/B of the paged decode reading block ids one key tile ahead (td.BLOCKS_AHEAD) against each tile reading
its own first, beside the dense cache, in one run: GPU time per call by CUDA-graph replay of the public call,
the best of two alternating runs each; outputs compared bit for bit with the dense cache's. bf16 Hq32 D128 Nq1.
The last line says which is faster over all paged rows (geometric mean) as ``ahead_wins=0|1``, for the
recording script to pass on as ATTNLAB_DECODE_BLOCKS_AHEAD.

Usage on the GPU machine: ``PYTHONPATH=.:scripts python3 scripts/paged_ahead_ab.py``.
"""

from __future__ import annotations

import math
import sys

import torch
from decode_profile import decode_inputs, graph_us

import attnlab
from attnlab import calls
from attnlab.backends.triton import decode as td
from attnlab.paged import to_paged


def main() -> int:
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    log_ratio, equal = [], True
    for B, Hkv, Nk in [(16, 8, 4096), (8, 8, 8192), (8, 32, 8192), (1, 8, 32768), (8, 8, 32768)]:
        q, k, v = decode_inputs(B, Hkv, Nk)
        dense = attnlab.attention(q, k, v)
        line = [f"dense {graph_us(lambda q=q, k=k, v=v: attnlab.attention(q, k, v)):6.1f}"]
        for bs in (16, 64):
            kc, vc, bt = to_paged(k, v, bs)
            best = {}
            for ahead in (False, True, False, True):
                td.BLOCKS_AHEAD = ahead
                td._PLANS.clear()
                calls.clear()

                def paged(q=q, kc=kc, vc=vc, bt=bt):
                    return attnlab.attention(q, kc, vc, block_table=bt)

                equal &= torch.equal(paged(), dense)
                us = graph_us(paged)
                best[ahead] = min(best.get(ahead, math.inf), us)
            log_ratio.append(math.log(best[True] / best[False]))
            line.append(f"paged{bs} in-tile {best[False]:6.1f} ahead {best[True]:6.1f}")
        print(f"B{B} Hkv{Hkv} Nk{Nk}: {' | '.join(line)}", flush=True)
        del q, k, v, kc, vc
        torch.cuda.empty_cache()
    gm = math.exp(sum(log_ratio) / len(log_ratio))
    print(f"ahead/in-tile geometric mean {gm:.3f}; all paged outputs equal to dense: {equal}")
    print(f"ahead_wins={int(gm < 1.0 and equal)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
