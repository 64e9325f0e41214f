"""Hopper routes for the forward, measured side by side on one GPU (issue: the Hopper path).

What it compares, on bf16 D128 (and one D64) problems, each timed over interleaved rounds with Triton's
``do_bench`` (L2 cleared before each call), every output first checked against the float64 reference:

* ``sdpa-cudnn`` and ``sdpa-flash``: the rivals, through ``torch.nn.functional.scaled_dot_product_attention``;
* ``triton``: ``attnlab.attention(backend="triton")`` as a user calls it (the shipped table's config);
* ``triton cfg=...``: the same public call with its config forced to one of a wider space (bigger tiles, deeper
  pipelines) than the shipped candidates, to see whether configs alone close the gap;
* ``tma cfg=... ws=...``: a route kernel (:func:`_tma_fwd`, here only) that loads Q, K and V through host-made
  TMA tensor descriptors and optionally asks triton for warp specialization of its key loop. It computes only
  dense and causal (Nq = Nk, N a multiple of the tiles), enough to say whether the route is worth carrying the
  whole contract.

Usage on the GPU: ``PYTHONPATH=. python tools/hopper_routes.py OUT.json [--ws]``; ``--interpret`` checks the route
kernel through Triton's interpreter on the CPU (small shapes). ``--profile [full|causal]`` runs one attnlab and
one cuDNN forward (B4 H16 N4096 D128 bf16; both masks when neither is named: full first) between
cudaProfilerStart and Stop, all warmed up first, for Nsight Compute. attnlab's call is the public one in the
Hopper kernel's sync mode, so on sm_90 the profiled kernel is the Gluon one. The profile the Hopper issue asks
for (tensor-pipe activity, occupancy, stall reasons per issued instruction), read by
:func:`attnlab.lessons.hopper.profile`:

    M="regex:sm__pipe_tensor_op_[gh]mma_cycles_active.avg.pct.*"
    M="$M,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section ComputeWorkloadAnalysis --metrics "$M" --csv --page details python tools/hopper_routes.py --profile

(ncu 2025.3 takes ``--metrics`` once: the regular expressions go in one comma-separated list.)
``--profile-backward`` does the same for one backward alone of each (``torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True)``, causal): attnlab's four kernels (preprocess, dQ's zeroing, the pass, dQ's conversion), then
cuDNN's three.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _tma_keys(q, desc_k, desc_v, kvh, lo, hi, i0, m_i, l_i, acc, qk_scale, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, D: tl.constexpr, DIAG: tl.constexpr, WS: tl.constexpr):
    """The online softmax over key tiles [lo, hi) (multiples of BLOCK_N): s = q k^T in base 2, the causal
    predicate on diagonal tiles only."""
    rows = i0 + tl.arange(0, BLOCK_M)
    for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([kvh, n0, 0]).reshape(BLOCK_N, D)
        s = tl.dot(q, tl.trans(k))
        if DIAG:
            keys = n0 + tl.arange(0, BLOCK_N)
            s = tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([kvh, n0, 0]).reshape(BLOCK_N, D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tma_fwd(desc_q, desc_k, desc_v, desc_o, N, H, group, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             D: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr):
    """One program per (row tile, batch x head), longest row tiles first; Q, K, V and O are [B*H, N, D] through
    TMA descriptors ([1, BLOCK, D] boxes)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    kvh = bh // group  # [B*H] heads grouped onto [B*Hkv] (H a multiple of group)
    i0 = pid_m * BLOCK_M
    q = desc_q.load([bh, i0, 0]).reshape(BLOCK_M, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        m_i, l_i, acc = _tma_keys(q, desc_k, desc_v, kvh, 0, i0, i0, m_i, l_i, acc, qk_scale, BLOCK_M, BLOCK_N, D,
                                  False, WS)
        m_i, l_i, acc = _tma_keys(q, desc_k, desc_v, kvh, i0, i0 + BLOCK_M, i0, m_i, l_i, acc, qk_scale, BLOCK_M,
                                  BLOCK_N, D, True, False)
    else:
        m_i, l_i, acc = _tma_keys(q, desc_k, desc_v, kvh, 0, N, i0, m_i, l_i, acc, qk_scale, BLOCK_M, BLOCK_N, D,
                                  False, WS)
    out = acc / l_i[:, None]
    desc_o.store([bh, i0, 0], out.to(desc_o.dtype).reshape(1, BLOCK_M, D))


def tma_attention(q, k, v, causal: bool, cfg: tuple[int, int, int, int], ws: bool) -> torch.Tensor:
    """The route kernel on contiguous [B, H, N, D] q and [B, Hkv, N, D] k, v."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, warps, stages = cfg
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    if N % bm or N % bn or bm % bn:
        raise ValueError(f"the route kernel needs N ({N}) a multiple of its tiles ({bm}, {bn})")
    o = torch.empty_like(q)

    def desc(t, rows):
        t3 = t.reshape(-1, t.shape[2], D)
        return TensorDescriptor(t3, list(t3.shape), list(t3.stride()), [1, rows, D])

    grid = (N // bm, B * H)
    _tma_fwd[grid](desc(q, bm), desc(k, bn), desc(v, bn), desc(o, bm), N, H, H // Hkv, LOG2E / math.sqrt(D),
                   BLOCK_M=bm, BLOCK_N=bn, D=D, CAUSAL=causal, WS=ws, num_warps=warps, num_stages=stages)
    return o


# ---- the public call with a forced config ---------------------------------------------------------------

@contextlib.contextmanager
def forced_config(cfg):
    """Inside, ``attnlab.attention(backend="triton")`` plans its forward with ``cfg`` (a Config) alone: the
    candidate space is patched to ``[cfg]``, so that the shipped table's entry (not in it) is passed over, and
    every cached plan, choice and fast call is forgotten on the way in and out."""
    from attnlab import fast_calls
    from attnlab.backends.triton import configs, forward

    def forget():
        configs._picked.clear()
        configs._tuned.clear()
        forward.forget_plans()
        fast_calls.clear()

    original = configs.candidates
    configs.candidates = lambda dtype, block_d: [cfg]
    forget()
    try:
        with configs.shipped_only():
            yield
    finally:
        configs.candidates = original
        forget()


CASES = [  # name, B, Hq, Hkv, N, D, causal
    ("B4 H16 N4096 D128 full", 4, 16, 16, 4096, 128, False),
    ("B4 H16 N4096 D128 causal", 4, 16, 16, 4096, 128, True),
    ("B2 H32/8 N4096 D128 causal", 2, 32, 8, 4096, 128, True),
    ("B1 H16 N16384 D128 causal", 1, 16, 16, 16384, 128, True),
    ("B4 H16 N4096 D64 full", 4, 16, 16, 4096, 64, False),
]
TRITON_CFGS = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 4, 3),
               (64, 128, 4, 3)]
TMA_CFGS = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 4, 2)]


def _flops(B, H, N, D, causal):
    return 4 * B * H * N * N * D / (2 if causal else 1)


def run(path: str, ws: bool, rounds: int = 3) -> None:
    """Every route on every case; ``ws``: the warp-specialized route kernels instead of the others (a separate
    process: a compiler crash there must not lose the rest)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import attnlab
    from attnlab.backends.triton.configs import Config
    from attnlab.bench.timing import round_orders

    def sdpa(which):
        def call(q, k, v, causal):
            with sdpa_kernel(which):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                        enable_gqa=q.shape[1] != k.shape[1])
        return call

    def public(q, k, v, causal):
        return attnlab.attention(q, k, v, causal=causal, backend="triton")

    routes = {"sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
              "triton": public}
    held = {}  # route -> a function returning the context it runs in
    for cfg in [] if ws else TRITON_CFGS:
        routes[f"triton cfg={cfg}"] = public
        held[f"triton cfg={cfg}"] = lambda cfg=cfg: forced_config(Config(*cfg))
    for cfg in TMA_CFGS:
        routes[f"tma cfg={cfg} ws={ws}"] = lambda q, k, v, c, cfg=cfg: tma_attention(q, k, v, c, cfg, ws)

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT", "unknown")}
    rows = []
    for name, B, Hq, Hkv, N, D, causal in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        ref, _ = attnlab.reference(q, k, v, causal=causal)
        ok = {}
        for route, fn in routes.items():
            t0 = time.perf_counter()
            try:
                with held.get(route, contextlib.nullcontext)():
                    got = fn(q, k, v, causal)
                torch.cuda.synchronize()
                err = attnlab.check.compare(got, ref)
                ok[route] = (err.passed, None if err.passed else str(err)[:300])
            except Exception as e:  # a route that does not compile or run is a result too
                ok[route] = (False, f"{type(e).__name__}: {str(e)[:300]}")
            ok[route] += (time.perf_counter() - t0,)
            print(name, route, ok[route][:2], flush=True)
        del ref
        times: dict[str, list[float]] = {r: [] for r in routes if ok[r][0]}
        for order in round_orders(list(times), rounds):
            for route in order:
                fn = routes[route]
                with held.get(route, contextlib.nullcontext)():
                    fn(q, k, v, causal)  # plans (a forced config's plan is made anew in its context)
                    times[route].append(do_bench(lambda fn=fn, a=(q, k, v, causal): fn(*a), warmup=10,
                                                 rep=40, return_mode="median"))
        flops = _flops(B, Hq, N, D, causal)
        for route in routes:
            ms = sorted(times[route])[len(times[route]) // 2] if route in times else None
            rows.append({"case": name, "route": route, "passed": ok[route][0], "error": ok[route][1],
                         "first_call_s": round(ok[route][2], 3), "ms": ms,
                         "tflops": None if ms is None else round(flops / ms / 1e9, 1)})
        base = {r["route"]: r["ms"] for r in rows if r["case"] == name}
        for r in rows:
            if r["case"] == name and r["ms"] is not None and base.get("sdpa-cudnn"):
                r["vs_cudnn"] = round(base["sdpa-cudnn"] / r["ms"], 3)
                print(f"{name:32s} {r['route']:34s} {r['ms']:.3f} ms {r['tflops']:6.1f} TFLOP/s "
                      f"{r['vs_cudnn']:.3f}x cudnn", flush=True)
        with open(path, "w") as f:  # after every case: a crash later keeps what was measured
            json.dump({"environment": env, "rows": rows}, f, indent=1)


def interpret_check() -> None:
    """The route kernel through the interpreter, against torch's math on small shapes."""
    g = torch.Generator().manual_seed(0)
    for causal in (False, True):
        q = torch.randn(1, 4, 64, 32, generator=g).to(torch.float16)
        k = torch.randn(1, 2, 64, 32, generator=g).to(torch.float16)
        v = torch.randn(1, 2, 64, 32, generator=g).to(torch.float16)
        got = tma_attention(q, k, v, causal, (32, 16, 4, 2), False).float()
        kk, vv = (t.float().repeat_interleave(2, 1) for t in (k, v))
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), kk, vv, is_causal=causal)
        print("causal" if causal else "full", float((got - want).abs().max()))


def profile(masks: tuple[bool, ...]) -> None:
    """Per mask (False: full, True: causal), one warmed-up forward of attnlab's public ``triton`` call and one
    of cuDNN's, alone in the profiled region in that order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnlab
    from attnlab.backends.triton import hopper_forward

    hopper_forward.set_mode("sync")  # compile the Hopper kernel on its first call (never the portable one)

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

    def ours(causal):
        return attnlab.attention(q, k, v, causal=causal, backend="triton")

    def cudnn(causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    _profiled([fn for causal in masks for fn in (lambda c=causal: ours(c), lambda c=causal: cudnn(c))])


def _profiled(calls: list) -> None:
    """Each of ``calls`` three times to warm up, then once each, in order, alone between cudaProfilerStart and
    Stop (ncu ``--profile-from-start off`` records only those)."""
    for _ in range(3):
        for call in calls:
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile_backward() -> None:
    """One warmed-up backward alone of attnlab's public ``triton`` call and one of cuDNN's (causal), alone in the
    profiled region in that order; on sm_90 attnlab's is the Hopper backward (compiled on its first call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnlab
    from attnlab.backends.triton import hopper_forward

    hopper_forward.set_mode("sync")

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ours = attnlab.attention(q, k, v, causal=True, backend="triton")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    _profiled([lambda o=out: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True) for out in (ours, theirs)])


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        interpret_check()
    elif "--profile-backward" in sys.argv:
        profile_backward()
    elif "--profile" in sys.argv:
        named = tuple(m for m, word in ((False, "full"), (True, "causal")) if word in sys.argv)
        profile(named or (False, True))
    else:
        run(sys.argv[1], "--ws" in sys.argv)
