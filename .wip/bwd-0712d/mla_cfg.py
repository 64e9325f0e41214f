# ruff: noqa
"""The varlen suite's MLA case (packed documents, D 192 / Dv 128, bf16): the portable backward's configs at 256-wide
head tiles, each pair's gradients checked against the default pair's, then the backward alone through the public
call, interleaved with compiled Flex's.  PYTHONPATH=. python3 gpurun/mla_cfg.py OUT.json"""
import dataclasses, json, os, sys, time
import torch, triton
import attnlab
from attnlab.backends.triton import backward as bw
from attnlab.backends.triton.configs import BwdConfig as C
from attnlab.bench import varlen_suite as vs
from attnlab.bench.timing import interleaved_ms

case = vs.CASES[1]
assert case.name == "mla_d192_dv128"
dev = torch.device("cpu" if os.environ.get("MLA_CPU") else "cuda")
inp = vs.make_inputs(case, [5, 7] if os.environ.get("MLA_CPU") else vs.document_lengths(), dev)
m = inp.max_len
leaves = [t.clone().requires_grad_() for t in (inp.q, inp.k, inp.v)]
out = attnlab.attention_varlen(*leaves, inp.cu, inp.cu, m, m, causal=True, align="bottom_right")
dout = torch.randn_like(out)

orig = (bw.configs_for, bw.dkdv_candidates, bw.dq_candidates)
KV0, Q0 = C(32, 64, 8, 1), C(64, 32, 8, 1)
KVS = [KV0, C(32, 64, 8, 2), C(64, 64, 8, 1), C(64, 64, 8, 2), C(32, 128, 8, 1), C(32, 128, 8, 2), C(16, 128, 8, 2),
       C(32, 64, 4, 2), C(64, 128, 8, 1)]
QS = [Q0, C(64, 32, 8, 2), C(64, 64, 8, 1), C(64, 64, 8, 2), C(128, 32, 8, 1), C(128, 64, 8, 1), C(32, 64, 4, 2)]
PAIRS = [(kv, Q0) for kv in KVS] + [(KV0, qc) for qc in QS[1:]]
if os.environ.get("MLA_PAIRS"):
    PAIRS = [PAIRS[int(i)] for i in os.environ["MLA_PAIRS"].split(",")]


def use(kv, qc):
    bw.configs_for = lambda prob, *a: (kv, qc)
    bw.dkdv_candidates = lambda *a, **k: [kv]
    bw.dq_candidates = lambda *a, **k: [qc]


def grads(pair):
    def call():
        use(*pair)
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return call


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


env = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
       "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"), "case": case.name, "documents": len(inp.lengths),
       "total": int(inp.q.shape[0]), "command": "PYTHONPATH=. python3 gpurun/mla_cfg.py OUT.json"}
ref = grads((KV0, Q0))()
rows, ok = [], {}
for pair in PAIRS:
    name = "kv%d_%d_%d_%d q%d_%d_%d_%d" % (*dataclasses.astuple(pair[0]), *dataclasses.astuple(pair[1]))
    t0 = time.time()
    try:
        got = grads(pair)()
        err = [rel(a, b) for a, b in zip(got, ref)]
        row = {"pair": name, "err_vs_default": err, "passed": max(err) < 1e-2}
    except Exception as e:  # does not fit (shared memory) or fails to compile
        row = {"pair": name, "error": repr(e)[:300], "passed": False}
    row["first_s"] = time.time() - t0
    rows.append(row)
    if row["passed"]:
        ok[name] = pair
    print(row, flush=True)

if dev.type == "cpu":
    print(rows); sys.exit(0)
rival = vs.COMPETITORS["flex"](inp)
fl = [rival.own(t).detach().clone().requires_grad_() for t in (inp.q, inp.k, inp.v)]
fout = rival.call(*fl)
fdout = rival.own(dout)
calls = {name: grads(pair) for name, pair in ok.items()}
calls["flex"] = lambda: torch.autograd.grad(fout, fl, fdout, retain_graph=True)
fg = calls["flex"]()
env["flex_err_vs_default"] = [rel(rival.packed(a), b) for a, b in zip(fg, ref)]
ms = interleaved_ms(list(calls), lambda label: calls[label], 3, warmup=1, calls=4)
for r in rows:
    if r["pair"] in ms:
        r["ms"] = ms[r["pair"]]
        r["flex_ms_over"] = ms["flex"] / ms[r["pair"]]
env["flex_ms"] = ms["flex"]
bw.configs_for, bw.dkdv_candidates, bw.dq_candidates = orig
for r in rows:
    print(r["pair"], r.get("ms"), round(r.get("flex_ms_over", 0), 3))
print("flex", ms["flex"], env["flex_err_vs_default"])
json.dump({"environment": env, "rows": rows}, open(sys.argv[1], "w"), indent=1)
