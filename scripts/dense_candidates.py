"""The forward's autotune candidates on the long dense cases, each timed longer than autotune times them, and
the config autotune picks, three times in a row (is the pick stable?). GPU time by do_bench medians (L2
cleared before each call), bf16/fp16, D128. Stdout only.

Usage on the GPU machine: ``PYTHONPATH=. python3 scripts/dense_candidates.py``.
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from attnlab.backends.triton import configs as tc
from attnlab.backends.triton import launch as tl
from attnlab.backends.triton.launch import _Plan
from attnlab.problem import make_problem


def main() -> int:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for dtype in (torch.bfloat16, torch.float16):
        for B, H, N, causal in ((1, 16, 16384, False), (1, 16, 16384, True), (4, 16, 4096, False)):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, N, 128, device="cuda", dtype=dtype, generator=g) for _ in range(3))
            prob = make_problem(q, k, v, causal=causal)
            out = torch.empty_like(q)
            line = []
            for cfg in tc.candidates(dtype, 128):
                plan = _Plan(prob, cfg)
                try:
                    ms = do_bench(lambda plan=plan, prob=prob, out=out: plan.launch(prob, out, None), warmup=25,
                                  rep=300, return_mode="median")
                except Exception as e:  # does not fit
                    line.append(f"{cfg}: {type(e).__name__}")
                    continue
                line.append(f"({cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}) {ms:.3f}")
            picks = []
            for _ in range(3):
                c = tl.autotune(prob, out, None)
                picks.append(f"({c.block_m},{c.block_n},{c.num_warps},{c.num_stages})")
            print(f"{str(dtype)[6:]} B{B} H{H} N{N} D128 {'causal' if causal else 'full'}: {' | '.join(line)} "
                  f"|| autotune picks {' '.join(picks)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
