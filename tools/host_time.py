"""Host time per call and GPU time of small problems through attnlab.attention vs SDPA, side by side.

Host time: the wall time of N back-to-back calls without synchronizing, divided by N, while the GPU is kept
busy (so the CPU side is what is measured), the least of 5 rounds. Prints one line per (case, competitor),
then a profile of the public call's repeated (fast) path.

``--train``: instead, a gpt-oss-like training layer (B2 Hq64 Hkv8 N4096 D64 bf16, a 128-key window; q, k, v
require grad) with and without bf16 sinks, forward and forward + backward, in interleaved rounds: each call's time
(CUDA events over 30 back-to-back calls) and the host time of issuing them.

``--train-vs-flex OUT.json [TAG]``: that layer through attnlab (plain and with sinks) beside compiled Flex with the
same block mask, outputs and gradients checked against Flex's first; per mode (``fwd`` with grad-requiring inputs,
``bwd`` from a retained graph, which Flex refuses, ``fwd+bwd``) the event time over 30 back-to-back calls, the host
time (least of 3 walls of 20 calls queued behind a GPU sleep) and, in the first round, the kernels' time per call
(torch.profiler). Rounds: ``ROUNDS`` (2). Run old and new code in alternating processes to compare them
(``PYTHONPATH=<other checkout>``; ``attnlab_file`` in the JSON says which ran).
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import attnlab
from attnlab.paged import to_paged


def host_us(fn, n=200, rounds=5, warm=10, sleep=50_000_000):
    """The least over ``rounds`` of the wall time of ``n`` unsynchronized calls / n: a busy host (another
    process, a frequency change) only ever adds time, so the least is the call's own cost. ``sleep``: GPU cycles
    queued first, longer than the ``n`` calls take to issue."""
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep)  # keep the GPU busy: the loop below is bound by the host alone
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    torch.cuda.synchronize()
    return best


def gpu_us(fn, n=200):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def prefill(q, k, v, causal):
    return {
        "raw F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "attnlab triton": lambda: attnlab.attention(q, k, v, causal=causal, backend="triton"),
        "attnlab auto": lambda: attnlab.attention(q, k, v, causal=causal),
        "attnlab sdpa": lambda: attnlab.attention(q, k, v, causal=causal, backend="sdpa"),
    }


def decode(q, k, v, lens, caches):
    kc, vc, bt = caches
    return {
        "raw F.sdpa gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "attnlab auto": lambda: attnlab.attention(q, k, v),
        "attnlab auto kv_len": lambda: attnlab.attention(q, k, v, kv_len=lens),
        "attnlab auto paged16": lambda: attnlab.attention(q, kc, vc, block_table=bt, kv_len=lens),
    }


#: The gpt-oss-like training layer: B, Hq, Hkv, N, D and its window's left reach (a 128-key window).
LAYER = (2, 64, 8, 4096, 64, 127)


def _layer() -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad), an upstream gradient and bf16 sinks of :data:`LAYER`, seeded."""
    B, Hq, Hkv, N, D, _ = LAYER
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    sinks = (2 * torch.randn(Hq, device="cuda", generator=g)).to(torch.bfloat16)
    return q, k, v, dout, sinks


def train_window(rounds: int = 3, n: int = 30) -> None:
    """The ``--train`` A/B (module docstring)."""
    q, k, v, dout, sinks = _layer()

    def fwd(with_sinks: bool):
        return attnlab.attention(q, k, v, window=(LAYER[-1], 0), sinks=sinks if with_sinks else None)

    def fwd_bwd(with_sinks: bool):
        return torch.autograd.grad(fwd(with_sinks), (q, k, v), dout)

    for r in range(rounds):
        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            for with_sinks in (False, True):
                call = functools.partial(fn, with_sinks)
                for _ in range(5):
                    call()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t = time.perf_counter()
                start.record()
                for _ in range(n):
                    call()
                end.record()
                host = (time.perf_counter() - t) / n * 1e6
                torch.cuda.synchronize()
                print(f"round {r} {name} sinks={with_sinks}: {start.elapsed_time(end) / n * 1e3:.0f} us per call, "
                      f"host {host:.0f} us", flush=True)


def _kernel_us(fn, n: int = 10) -> tuple[float, dict[str, float]]:
    """GPU kernel time per call of ``fn`` (torch.profiler), and the eight longest kernels'."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:90]] = per.get(e.name[:90], 0.0) + e.device_time / n
    return sum(per.values()), dict(sorted(per.items(), key=lambda x: -x[1])[:8])


def train_vs_flex(path: str, tag: str, rounds: int) -> None:
    """The ``--train-vs-flex`` comparison (module docstring)."""
    import json
    import os

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, Hq, Hkv, N, D, W = LAYER
    q, k, v, dout, sinks = _layer()
    block_mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= W), None, None, N, N, device="cuda")
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    calls = {"attnlab": lambda: attnlab.attention(q, k, v, window=(W, 0)),
             "attnlab+sinks": lambda: attnlab.attention(q, k, v, window=(W, 0), sinks=sinks),
             "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True, scale=D ** -0.5)}
    with torch.no_grad():
        fwd_err = (calls["attnlab"]().float() - calls["flex"]().float()).abs().max().item()
    ours, theirs = (torch.autograd.grad(calls[n](), (q, k, v), dout) for n in ("attnlab", "flex"))
    grad_rel = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(ours, theirs)]

    def modes(name: str) -> dict:
        fn, held = calls[name], calls[name]()
        got = {"fwd": fn, "bwd": lambda: torch.autograd.grad(held, (q, k, v), dout, retain_graph=True),
               "fwd+bwd": lambda: torch.autograd.grad(fn(), (q, k, v), dout)}
        if name == "flex":  # compiled Flex refuses a retained graph (donated buffers)
            del got["bwd"]
        return got

    rows = []
    for r in range(rounds):
        for name in calls:
            for mode, fn in modes(name).items():
                row = {"round": r, "competitor": name, "mode": mode, "event_us": gpu_us(fn, 30),
                       "host_us": host_us(fn, 20, 3, warm=0, sleep=200_000_000)}
                if r == 0:
                    row["kernel_us"], row["kernels"] = _kernel_us(fn)
                rows.append(row)
                print(tag, r, name, mode, {k: round(x, 1) for k, x in row.items() if isinstance(x, float)}, flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "attnlab_file": attnlab.__file__,
           "commit": os.environ.get("ATTNLAB_COMMIT"), "tag": tag, "shape": [B, Hq, Hkv, N, D], "window": [W, 0],
           "fwd_max_abs_vs_flex": fwd_err, "grad_rel_vs_flex": grad_rel}
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


def main() -> int:
    if "--train-vs-flex" in sys.argv[1:]:
        at = sys.argv.index("--train-vs-flex")
        args = sys.argv[at + 1:]
        if not args:
            print("usage: python tools/host_time.py --train-vs-flex OUT.json [TAG]", file=sys.stderr)
            return 2
        import os

        train_vs_flex(args[0], args[1] if len(args) > 1 else "run", int(os.environ.get("ROUNDS", "2")))
        return 0
    if "--train" in sys.argv[1:]:
        train_window()
        return 0
    torch.manual_seed(0)
    for B, H, N, D, causal in [(1, 8, 128, 64, True), (4, 16, 512, 64, False), (2, 32, 256, 128, True)]:
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, fn in prefill(q, k, v, causal).items():
            print(f"B{B} H{H} N{N} D{D} causal={causal} {name:22s} host {host_us(fn):7.1f} us  "
                  f"gpu {gpu_us(fn):7.1f} us", flush=True)
    for B, Hkv, Nk in [(1, 8, 32768), (8, 8, 8192)]:
        q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, Nk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((B,), Nk, device="cuda", dtype=torch.int32)
        for name, fn in decode(q, k, v, lens, to_paged(k, v, 16)).items():
            print(f"decode B{B} Hq32 Hkv{Hkv} Nk{Nk} {name:22s} host {host_us(fn):7.1f} us  "
                  f"gpu {gpu_us(fn):7.1f} us", flush=True)
    q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn = lambda: attnlab.attention(q, k, v, causal=True)
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
