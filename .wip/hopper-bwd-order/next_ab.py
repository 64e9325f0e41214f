"""The series' changes, the backward alone through the public call. (1) The Hopper backward's program orders side
by side (hopper_backward.ORDER 0, 1, 2) with the portable backward and sdpa-cudnn, at D 128 and (the series' new
head dim) D 64; order 0's gradients are checked against the portable ones first, then each other order's: dK and
dV bitwise those of order 0 (a program's sums do not depend on when it runs), dQ within 1e-2 of the largest entry
(its adds land in another order). (2) ALiBi: the Hopper backward beside the portable one (ATTNLAB_HOPPER=0 at the
backward) and compiled Flex with the same score_mod, after the Hopper gradients agree with the portable ones.
Usage on an sm_90 GPU: PYTHONPATH=. python3 .wip/hopper-bwd-order/next_ab.py OUT.json [rule|check]
(``rule``, ``check``: the rules' second and third looks, each case also timed as the product picks, ``product``)
"""

import json
import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab.backends.triton import hopper_backward as hb
from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.timing import interleaved_ms
from attnlab.problem import make_problem

RULE_GQA_ONLY = hb.GQA_ONLY_HEAD_DIMS  #: the product's

#: (B, Hq, Hkv, N, D, causal): the backward suite's dense rows, a short many-head one, and D 64 (the Hopper
#: backward's new head dim: order 0 against the portable backward below)
CASES = [(4, 16, 16, 4096, 128, True), (2, 32, 8, 4096, 128, True), (4, 16, 16, 4096, 128, False),
         (1, 16, 16, 16384, 128, True), (1, 16, 16, 16384, 128, False), (8, 16, 16, 1024, 128, True),
         (4, 16, 16, 4096, 64, True), (4, 16, 16, 4096, 64, False), (1, 64, 8, 8192, 64, True)]
#: The rules' second look (``rule`` as the second argument): the order's Nk bound either side of 8192, GQA at
#: long and full rows, D 64 with and without GQA
RULE_CASES = [(2, 16, 16, 8192, 128, True), (1, 16, 16, 8192, 128, False), (1, 32, 8, 16384, 128, True),
              (4, 32, 8, 4096, 128, False), (16, 16, 16, 2048, 128, True), (2, 32, 8, 4096, 64, True),
              (4, 16, 4, 4096, 64, False), (1, 16, 16, 16384, 64, True), (8, 16, 2, 2048, 64, True)]
#: The order rule by waves (``check``): where it picks 2, 1 or 0 on shapes it was not read from, and two it was
CHECK_CASES = [(4, 8, 1, 4096, 128, True), (2, 32, 4, 2048, 128, True), (1, 32, 8, 8192, 128, True),
               (4, 32, 8, 4096, 64, True), (2, 16, 16, 8192, 128, True), (8, 16, 2, 2048, 64, True)]


def case(B: int, Hq: int, Hkv: int, N: int, D: int, causal: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, causal=causal, backend="triton")

    def grads(order: int | None, mode: str = "sync", gqa_only: tuple = ()):
        def call():  # gqa_only=(): the Hopper pass takes D 64 without GQA too, to be compared
            hb.ORDER, hb.GQA_ONLY_HEAD_DIMS = order, gqa_only
            hopper.set_mode(mode)
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return call

    row = {"case": f"bf16 b{B} hq{Hq} hkv{Hkv} n{N} d{D} {'causal' if causal else 'full'}", "checks": {}}
    before = hb.launches
    first = grads(0)()
    portable = grads(0, "0")()
    row["order0_taken"] = hb.launches == before + 1
    row["order0_err_vs_portable"] = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                     for a, b in zip(first, portable)]
    product = grads(None, "sync", RULE_GQA_ONLY)()  # the product's rule: which order, or the portable kernels
    row["product_err_vs_portable"] = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                      for a, b in zip(product, portable)]
    prob = make_problem(q, k, v, causal=causal)
    row["product_takes"] = hb.unsupported(prob, dout) or f"order {hb.order(prob)}"
    for order in (1, 2):
        before = hb.launches
        dq, dk, dv = grads(order)()
        row["checks"][order] = {
            "hopper_taken": hb.launches == before + 1,
            "dk_dv_bitwise": bool(torch.equal(dk, first[1]) and torch.equal(dv, first[2])),
            "dq_err": ((dq.float() - first[0].float()).abs().max() / first[0].float().abs().max()).item()}
    errs = row["order0_err_vs_portable"] + row["product_err_vs_portable"]
    row["passed"] = row["order0_taken"] and max(errs) < 2e-2 and all(
        c["hopper_taken"] and c["dk_dv_bitwise"] and c["dq_err"] < 1e-2 for c in row["checks"].values())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o2 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)
    calls = {f"order-{o}": grads(o) for o in (0, 1, 2)}
    calls["product"] = grads(None, "sync", RULE_GQA_ONLY)
    calls["portable-bwd"] = grads(0, "0")
    calls["sdpa-cudnn-bwd"] = lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)
    if row["passed"]:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        cudnn = row["ms"]["sdpa-cudnn-bwd"]
        row["cudnn_ms_over"] = {name: cudnn / ms for name, ms in row["ms"].items()}
    hb.ORDER, hb.GQA_ONLY_HEAD_DIMS = None, RULE_GQA_ONLY
    hopper.set_mode("sync")
    return row


#: (B, H, N, causal) of the scoremod suite's ALiBi rows
ALIBI_CASES = [(4, 16, 4096, False), (4, 16, 4096, True)]


def alibi_case(B: int, H: int, N: int, causal: bool) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, H, N, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(B, H, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda")
    hopper.set_mode("sync")
    out = attnlab.attention(q, k, v, causal=causal, alibi_slopes=slopes, backend="triton")

    rule = hb.unsupported

    def lifted(prob, d):  # the rule's refusal of ALiBi on full rows lifted, to time what it refuses
        why = rule(prob, d)
        return None if why and why.startswith("ALiBi under") else why

    def grads(mode: str, product: bool = False):
        def call():
            hopper.set_mode(mode)
            hb.unsupported = rule if product else lifted
            try:
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            finally:
                hb.unsupported = rule
        return call

    before = hb.launches
    mine = grads("sync")()
    taken = hb.launches == before + 1
    ref = grads("0")()
    err = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(mine, ref)]

    def alibi(score, b, h, i, j):
        return score - slopes[h] * (i - j).abs()

    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, N, N) if causal else None
    o2 = torch.compile(flex_attention)(q, k, v, score_mod=alibi, block_mask=mask)
    flex_gap = ((o2.float() - out.float()).abs().max() / out.float().abs().max()).item()  # the same function?
    calls = {"hopper-bwd": grads("sync"), "product": grads("sync", True), "portable-bwd": grads("0"),
             "flex-bwd": lambda: torch.autograd.grad(o2, (q, k, v), dout, retain_graph=True)}
    row = {"case": f"alibi bf16 b{B} h{H} n{N} d128 {'causal' if causal else 'full'}", "hopper_taken": taken,
           "err_vs_portable": err, "flex_out_gap": flex_gap, "passed": taken and max(err) < 2e-2 and flex_gap < 2e-2}
    if row["passed"]:
        row["ms"] = interleaved_ms(list(calls), lambda label: calls[label], 5, warmup=2, calls=10)
        flex = row["ms"]["flex-bwd"]
        row["flex_ms_over"] = {name: flex / ms for name, ms in row["ms"].items()}
    hopper.set_mode("sync")
    return row


def main(path: str, mode: str = "") -> None:
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"),
           "command": "PYTHONPATH=. python3 .wip/hopper-bwd-order/next_ab.py OUT.json"}
    rows = []
    todo = {"rule": [*((case, c) for c in RULE_CASES), (alibi_case, ALIBI_CASES[0])],
            "check": [(case, c) for c in CHECK_CASES]}.get(mode) or [*((case, c) for c in CASES),
                                                                   *((alibi_case, c) for c in ALIBI_CASES)]
    for fn, c in todo:
        rows.append(fn(*c))
        print(json.dumps(rows[-1]), flush=True)
        with open(path, "w") as f:  # after every row: a call cut by its time limit keeps what it measured
            json.dump({"environment": env, "rows": rows}, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], (sys.argv[2:] or [""])[0])
