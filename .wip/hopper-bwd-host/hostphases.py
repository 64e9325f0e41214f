"""Where a training step's host time goes: the wall time of each backward phase inside steps (no profiler), the
Gluon route for every window with GQA (``new``) against no window's left edge (``old``), each twice and once more with a
short GIL switch interval; then whether a launch waits on a busy GPU, and the Hopper backward's function
attributes. ``PYTHONPATH=. python3 .wip/hopper-bwd-host/hostphases.py OUT.json`` from the root."""

import functools
import json
import sys
import time

import torch

import attnlab
from attnlab import fast_calls
from attnlab.backends.triton import backward as bw
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.hopper_bwd_window_route import window_inputs
from attnlab.bench.timing import mean_gpu_ms
from attnlab.problem import make_problem

NEW = hb.unsupported
hb.PORTABLE_WINDOWS_BELOW = {}  # every window with GQA on the Gluon pass under NEW
PHASES: dict[str, list[float]] = {}


def old_rule(prob, dout):
    """Main's rule: no window's left edge."""
    return "old" if prob.spec.left is not None else NEW(prob, dout)


def use(rule) -> None:
    """Take ``rule`` for the Hopper backward from the next call on (plans and fast calls decided again)."""
    hb.unsupported = rule
    hb.forget_plans()
    fast_calls.clear()


def timed(module, name: str) -> None:
    """Record each call's wall time of ``module.name`` in PHASES."""
    f = getattr(module, name)

    @functools.wraps(f)
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        PHASES.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
        return r

    setattr(module, name, wrapped)


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return dict(median=round(xs[len(xs) // 2], 1), p90=round(xs[int(len(xs) * 0.9)], 1), max=round(xs[-1], 1))


def host_us(fn, n: int = 40) -> list[float]:
    """Wall time to enqueue each of ``n`` calls, each after a sync."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return ts


def inputs(D: int, W: int, sinks: bool):
    """The gpt-oss-like layer's shapes (B2 Hq64 Hkv8 N4096) at head dim ``D`` and window width ``W``."""
    return window_inputs(2, 64, 8, 4096, D, W, sinks)


def case(D: int, W: int, sinks: bool) -> dict:
    q, k, v, dout, kw = inputs(D, W, sinks)
    hopper.set_mode("sync")
    for rule in (NEW, old_rule):
        use(rule)
        for _ in range(3):
            torch.autograd.grad(attnlab.attention(q, k, v, **kw), (q, k, v), dout)
    hopper.set_mode("1")

    def step():
        return torch.autograd.grad(attnlab.attention(q, k, v, **kw), (q, k, v), dout)

    rows = {}
    for label, rule, interval in (("new", NEW, None), ("old", old_rule, None), ("new2", NEW, None),
                                  ("old2", old_rule, None), ("new_si", NEW, 2e-4), ("old_si", old_rule, 2e-4)):
        use(rule)
        PHASES.clear()
        before = sys.getswitchinterval()
        if interval:
            sys.setswitchinterval(interval)
        row = dict(host_us=quantiles(host_us(step)), phases_us={k: quantiles(v) for k, v in PHASES.items()})
        row["back_to_back_ms"] = round(mean_gpu_ms(step, 20), 4)
        sys.setswitchinterval(before)
        rows[label] = row
    use(NEW)
    return rows


def busy_launches() -> dict:
    """Host time of a Hopper backward launch, a forward call and a torch op, on an idle GPU and behind 2M cycles
    of ``torch.cuda._sleep``: a launch that waits on the GPU takes the sleep's time."""
    q, k, v, dout, kw = inputs(64, 128, False)
    q, k, v = (t.detach() for t in (q, k, v))
    prob = make_problem(q, k, v, **kw)
    lse2 = torch.zeros(prob.B, prob.Hq, prob.Nq, device="cuda")
    delta = torch.zeros_like(lse2)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    acc = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    out = {}
    for label, fn in (("hopper_backward_run", lambda: hb.run(prob, dout, delta, lse2, dk, dv, acc)),
                      ("forward_call", lambda: attnlab.attention(q, k, v, **kw)), ("torch_add", lambda: q.add(1))):
        for cycles in (0, 2_000_000):
            ts = []
            for _ in range(10):
                torch.cuda.synchronize()
                if cycles:
                    torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            out[f"{label} sleep{cycles}"] = quantiles(ts)["median"]
    t0 = time.perf_counter()
    torch.cuda._sleep(2_000_000)
    torch.cuda.synchronize()
    out["sleep_alone_us"] = round((time.perf_counter() - t0) * 1e6, 1)
    return out


def main(path: str) -> None:
    res = dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__))
    for name in ("gradients", "_decide", "_minus_dlse", "_sinks_result"):
        timed(bw, name)
    timed(bw.hopper_backward, "run")
    for name in ("launch_preprocess", "launch_dkdv", "launch_fitting"):
        timed(bw.bl, name)
    res["bf16 b2 hq64 hkv8 n4096 d64 window128"] = case(64, 128, False)
    res["busy_gpu_launch_us"] = busy_launches()
    print(json.dumps(res, indent=1))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
