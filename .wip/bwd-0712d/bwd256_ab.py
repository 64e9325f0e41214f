# ruff: noqa
"""The portable backward at 256-wide head tiles (D 129-256): the product (its new first candidates) against the old
defaults and a few other pairs, each pair's gradients checked against the product's, the backward alone through
the public call interleaved with a rival (compiled Flex on the varlen suite's MLA case, SDPA's default pick on the
dense ones).  PYTHONPATH=. python3 gpurun/bwd256_ab.py OUT.json"""
import dataclasses, json, os, sys, time
import torch, triton
import torch.nn.functional as F
import attnlab
from attnlab.backends.triton import backward as bw
from attnlab.backends.triton.configs import BwdConfig as C
from attnlab.bench import varlen_suite as vs
from attnlab.bench.timing import interleaved_ms

OLD = (C(32, 64, 8, 1), C(64, 32, 8, 1))
PAIRS = {"old": OLD, "kv32_128_8_2+q128_32_8_1": (C(32, 128, 8, 2), C(128, 32, 8, 1)),
         "kv16_128_8_2+q128_64_8_1": (C(16, 128, 8, 2), C(128, 64, 8, 1)),
         "kv32_64_4_2+q128_64_8_1": (C(32, 64, 4, 2), C(128, 64, 8, 1))}
orig = (bw.configs_for, bw.dkdv_candidates, bw.dq_candidates)


def use(pair):
    if pair is None:
        bw.configs_for, bw.dkdv_candidates, bw.dq_candidates = orig
        return
    kv, qc = pair
    bw.configs_for = lambda prob, *a: (kv, qc)
    bw.dkdv_candidates = lambda *a, **k: [kv]
    bw.dq_candidates = lambda *a, **k: [qc]


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def mla():
    case = vs.CASES[1]
    inp = vs.make_inputs(case, vs.document_lengths(), torch.device("cuda"))
    m = inp.max_len
    leaves = [t.clone().requires_grad_() for t in (inp.q, inp.k, inp.v)]
    out = attnlab.attention_varlen(*leaves, inp.cu, inp.cu, m, m, causal=True, align="bottom_right")
    dout = torch.randn_like(out)
    rival = vs.COMPETITORS["flex"](inp)
    fl = [rival.own(t).detach().clone().requires_grad_() for t in (inp.q, inp.k, inp.v)]
    fout, fdout = rival.call(*fl), rival.own(dout)
    return "varlen mla d192 dv128 causal (32 heads, 32768 rows)", leaves, out, dout, "flex", \
        (lambda: [rival.packed(g) for g in torch.autograd.grad(fout, fl, fdout, retain_graph=True)])


def dense(B, H, N, D, Dv, causal, dtype):
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        v = torch.randn(B, H, N, Dv, device="cuda", dtype=dtype, generator=g)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = attnlab.attention(*leaves, causal=causal, backend="triton")
        dout = torch.randn_like(out)
        sl = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        so = F.scaled_dot_product_attention(*sl, is_causal=causal)
        return (f"{str(dtype)[6:]} b{B} h{H} n{N} d{D} dv{Dv} {'causal' if causal else 'full'}", leaves, out, dout,
                "sdpa", lambda: torch.autograd.grad(so, sl, dout, retain_graph=True))
    return make


CASES = [mla, dense(2, 16, 4096, 256, 256, True, torch.bfloat16), dense(4, 16, 2048, 192, 128, True, torch.bfloat16),
         dense(2, 8, 4096, 256, 256, False, torch.float16)][:int(os.environ.get("BWD256_CASES", "4"))]
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"), "pairs": {k: [dataclasses.astuple(c) for c in p]
                                                                        for k, p in PAIRS.items()},
       "command": "PYTHONPATH=. python3 gpurun/bwd256_ab.py OUT.json"}
rows = []
for make in CASES:
    name, leaves, out, dout, rival_name, rival = make()

    def grads(pair):
        def call():
            use(pair)
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)
        return call
    ref = grads(None)()
    row = {"case": name, "err_vs_product": {}}
    calls = {"product": grads(None)}
    for label, pair in PAIRS.items():
        try:
            row["err_vs_product"][label] = [rel(a, b) for a, b in zip(grads(pair)(), ref)]
            if max(row["err_vs_product"][label]) < 1e-2:
                calls[label] = grads(pair)
        except Exception as e:
            row["err_vs_product"][label] = repr(e)[:200]
    use(None)
    row["err_rival_vs_product"] = [rel(a, b) for a, b in zip(rival(), ref)]
    calls[rival_name] = rival
    ms = interleaved_ms(list(calls), lambda label: calls[label], 3, warmup=1, calls=4)
    row["ms"] = ms
    row["picked"] = {str(k[1:]): str(v) for k, v in {**bw._picked, **bw._tuned}.items()}
    row["rival_ms_over"] = {k: ms[rival_name] / v for k, v in ms.items()}
    use(None)
    rows.append(row)
    print(name, {k: round(v, 3) for k, v in row["rival_ms_over"].items()}, flush=True)
    json.dump({"environment": env, "rows": rows}, open(sys.argv[1], "w"), indent=1)
    del leaves, out, dout
    torch.cuda.empty_cache()
