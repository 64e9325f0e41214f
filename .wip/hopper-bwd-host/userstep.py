"""A training step as a user runs it: forward + backward of attnlab.attention (default mode "1", every compile
settled first), the Hopper backward taking every window with GQA (``new``: ``PORTABLE_WINDOWS_BELOW`` emptied)
against the rule before windows reached it, no window's left edge (``old``), beside compiled Flex; and each one's
host time per call (the wall time to enqueue a call after a sync). ``PYTHONPATH=. python3
.wip/hopper-bwd-host/userstep.py OUT.json`` from the repository's root."""

import json
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attnlab
from attnlab import fast_calls
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.hopper_bwd_window_route import window_inputs
from attnlab.bench.timing import interleaved_ms

CASES = [(2, 64, 8, 4096, 64, 128, True), (2, 64, 8, 4096, 64, 128, False), (2, 64, 8, 4096, 128, 128, False),
         (2, 64, 8, 4096, 64, 1024, False), (2, 64, 8, 4096, 128, 1024, False)]
NEW = hb.unsupported
hb.PORTABLE_WINDOWS_BELOW = {}  # every window with GQA on the Gluon pass under NEW


def old_rule(prob, dout):
    """Main's rule: no window's left edge."""
    return "old" if prob.spec.left is not None else NEW(prob, dout)


def host_ms(fn) -> float:
    """Median wall time to enqueue one call after a sync."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(ts)[10]


def case(B, Hq, Hkv, N, D, W, sinks, flex) -> dict:
    q, k, v, dout, kw = window_inputs(B, Hq, Hkv, N, D, W, sinks)
    hopper.set_mode("sync")
    for rule in (NEW, old_rule):
        hb.unsupported = rule
        hb.forget_plans()
        for _ in range(3):
            torch.autograd.grad(attnlab.attention(q, k, v, **kw), (q, k, v), dout)
    hopper.set_mode("1")
    block = create_block_mask(lambda b, h, i, j: (j <= i) & (j > i - W), None, None, N, N, device="cuda")

    def call_of(label):
        if label == "flex":
            return lambda: torch.autograd.grad(flex(q, k, v, block_mask=block, enable_gqa=Hq != Hkv), (q, k, v), dout)
        hb.unsupported = NEW if label == "new" else old_rule
        fast_calls.clear()
        hb.forget_plans()  # (plans by launch key: decided again under this rule)
        return lambda: torch.autograd.grad(attnlab.attention(q, k, v, **kw), (q, k, v), dout)

    before = hb.launches
    labels = ["new", "old"] + ([] if sinks else ["flex"])
    ms = interleaved_ms(labels, call_of, 5)
    host = {label: host_ms(call_of(label)) for label in labels}
    return dict(case=f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} window{W}" + (" sinks" if sinks else ""), ms=ms,
                host_ms=host, hopper_bwd_launches=hb.launches - before)


def main(out: str) -> None:
    flex = torch.compile(flex_attention)
    rows = []
    try:
        for c in CASES:
            rows.append(case(*c, flex))
            print(rows[-1], flush=True)
    finally:
        hb.unsupported = NEW
    with open(out, "w") as f:
        json.dump(dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__), rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
