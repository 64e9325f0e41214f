"""Check and time the split-KV decode path (attnlab/backends/triton/decode.py) on one CUDA GPU, in one call.

    PYTHONPATH=. python3 scripts/decode_gpu_check.py [--tests] [--sweep]

1. (--tests) the CPU tests of the decode path under this machine's triton (the interpreter);
2. correctness on the GPU, float32 / float16 / bfloat16, against the float64 reference (attnlab.check);
3. timing, bf16 D128 Nq1: the decode path (dense, paged with block 16 and 64) against sdpa-cudnn and
   sdpa-flash (``torch.nn.attention.sdpa_kernel``), each output checked against the reference before it is
   timed (``triton.testing.do_bench``, median, the L2 cleared before each call; and "graph": CUDA-graph
   replay, ``do_bench_cudagraph``, no L2 clear, no host time); GB/s of K/V read =
   2 * B * Hkv * Nk * D * 2 bytes / time. ``--sweep`` also times other tile configs and split counts.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import warnings

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from attnlab.backends.triton import decode as td
from attnlab.cases import Case, make_inputs
from attnlab.check import _lse_atol, compare, strict_fp32
from attnlab.problem import make_problem
from attnlab.reference import reference_forward

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DEV = "cuda"

CHECK_CASES = [
    Case("gqa_nq1_ragged", B=3, Hq=32, Hkv=8, Nq=1, Nk=4099, D=128, kv_len=(4099, 1000, 0)),
    Case("speculative_causal_br", B=3, Hq=8, Hkv=2, Nq=5, Nk=2000, D=64, causal=True, align="bottom_right",
         kv_len=(2000, 3, 700)),
    Case("nq16_mqa_window_d256", B=2, Hq=8, Hkv=1, Nq=16, Nk=1500, D=256, window=(300, 0), align="bottom_right"),
    Case("bias_d24", B=2, Hq=6, Hkv=6, Nq=3, Nk=777, D=24, mask="bias_b1qk"),
    Case("bool_d1_false_row", B=2, Hq=4, Hkv=2, Nq=4, Nk=300, D=1, mask="bool_full"),
    Case("bnhd_transposed_causal_tl_q_len", B=2, Hq=4, Hkv=2, Nq=4, Nk=513, D=128, layout="bnhd",
         view="transposed", causal=True, align="top_left", q_len=(4, 2)),
    Case("strided_d40_gqa", B=2, Hq=8, Hkv=2, Nq=2, Nk=1000, D=40, view="strided_d", kv_len=(1000, 64)),
]

TIME_CASES = [(1, 32, 8, 32768), (8, 32, 8, 8192), (1, 32, 32, 131072), (16, 32, 8, 4096)]


def _result(prob, out, lse) -> tuple[bool, str]:
    ref, ref_lse = reference_forward(prob)
    rep = compare(out, ref, dtype=prob.dtype)
    ok = rep.passed and not torch.isnan(out).any().item()
    msg = f"max_abs={rep.max_abs:.2e}"
    if lse is not None:
        lrep = compare(lse, ref_lse, dtype=F32, atol=_lse_atol(prob.dtype), rtol=0.0)
        ok = ok and lrep.passed and bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))
        msg += f" lse_max_abs={lrep.max_abs:.2e}"
    return ok, msg


def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, seed: int = 0):
    """The dense [B, Hkv, Nk, D] k, v as caches [num_blocks, block_size, Hkv, D] in shuffled block order."""
    B, Hkv, Nk, D = k.shape
    mb = Nk // block_size
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(B * mb, generator=gen).to(k.device)

    def cache(x):
        blocks = x.reshape(B, Hkv, mb, block_size, D).permute(0, 2, 3, 1, 4).reshape(B * mb, block_size, Hkv, D)
        out = torch.empty_like(blocks)
        out[perm] = blocks
        return out

    return cache(k), cache(v), perm.view(B, mb).to(torch.int32)


def run_tests() -> None:
    print("== CPU tests of the decode path (interpreter, this triton) ==", flush=True)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_decode.py"],
                       capture_output=True, text=True)
    print("\n".join((r.stdout + r.stderr).strip().splitlines()[-5:]), flush=True)


def run_checks() -> int:
    print("== GPU correctness against the float64 reference ==", flush=True)
    failed = 0
    for dt in (BF16, F16, F32):
        for i, case in enumerate(CHECK_CASES):
            for splits in (None, 1) if i < 1 else (None,):
                q, k, v, kw = make_inputs(case, dtype=dt, device=DEV, seed=11 + i)
                prob = make_problem(q, k, v, **kw)
                out = torch.full((prob.B, prob.Hq, prob.Nq, prob.D), float("nan"), dtype=dt, device=DEV)
                lse = torch.full((prob.B, prob.Hq, prob.Nq), float("nan"), device=DEV)
                try:
                    td.decode_forward(prob, out, lse, splits=splits)  # the JIT launch
                    ok, msg = _result(prob, out, lse)
                    out.fill_(float("nan"))
                    lse.fill_(float("nan"))
                    td.decode_forward(prob, out, lse, splits=splits)  # the plan's direct launch
                    ok2, msg2 = _result(prob, out, lse)
                    ok, msg = ok and ok2, f"{msg} | again: {msg2}"
                except Exception as e:
                    ok, msg = False, f"{type(e).__name__}: {str(e)[:300]}"
                failed += not ok
                print(f"{'PASS' if ok else 'FAIL'} {case.name:34s} {str(dt)[6:]:9s} splits={splits} {msg}", flush=True)
        for bs in (16, 64):
            case = Case("paged", B=3, Hq=32, Hkv=8, Nq=2, Nk=4096, D=128, causal=True, align="bottom_right",
                        kv_len=(4096, 1000, 17))
            q, k, v, kw = make_inputs(case, dtype=dt, device=DEV, seed=5)
            prob = make_problem(q, k, v, **kw)
            kc, vc, bt = paged_copy(k, v, bs)
            dense, out = torch.empty_like(q), torch.empty_like(q)
            lse_d, lse = (torch.empty(3, 32, 2, device=DEV) for _ in range(2))
            try:
                td.decode_forward(prob, dense, lse_d)
                td.decode_forward(prob, out, lse, k_cache=kc, v_cache=vc, block_table=bt)
                out.fill_(float("nan"))
                td.decode_forward(prob, out, lse, k_cache=kc, v_cache=vc, block_table=bt)
                ok, msg = _result(prob, out, lse)
                same = torch.equal(out, dense) and torch.equal(lse, lse_d)
                msg += f" bitwise_equal_to_dense={same}"
                ok = ok and same
            except Exception as e:
                ok, msg = False, f"{type(e).__name__}: {str(e)[:300]}"
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} paged_block{bs:<23d} {str(dt)[6:]:9s} splits=None {msg}", flush=True)
    print(f"-- {failed} failed", flush=True)
    return failed


def _sdpa(kind: str, q, k, v, group: int):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, kind)

    def call(kk, vv, gqa):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa) if gqa else \
                F.scaled_dot_product_attention(q, kk, vv)

    note = "enable_gqa"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call(k, v, group > 1)
        kk, vv, gqa = k, v, group > 1
    except RuntimeError as e:
        if group == 1:
            raise
        note = f"K/V repeated (enable_gqa refused: {str(e).splitlines()[0][:80]})"
        kk, vv, gqa = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False
    return (lambda: call(kk, vv, gqa)), note


def _time(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def run_timing(sweep: bool) -> None:
    print("== timing, bf16 D128 Nq1 (median ms; GB/s of K/V read) ==", flush=True)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for B, Hq, Hkv, Nk in TIME_CASES:
        time_case(B, Hq, Hkv, Nk, sm, sweep)
        torch.cuda.empty_cache()


def time_case(B: int, Hq: int, Hkv: int, Nk: int, sm: int, sweep: bool, D: int = 128, graphs: bool = True) -> None:
    torch.manual_seed(0)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=BF16)
    k = torch.randn(B, Hkv, Nk, D, device=DEV, dtype=BF16)
    v = torch.randn(B, Hkv, Nk, D, device=DEV, dtype=BF16)
    gbytes = 2 * B * Hkv * Nk * D * 2 / 1e9
    prob = make_problem(q, k, v)
    ref = reference_forward(prob)[0]
    out = torch.empty_like(q)
    cfg = td.default_config(BF16, D)
    splits = td.num_splits(prob, cfg, sm)
    rows = []

    def entry(label, fn, result, note=""):
        try:
            fn()
            result().fill_(float("nan"))
            fn()  # checked after the second call: for the decode path, the plan's direct launch
            torch.cuda.synchronize()
            rep = compare(result(), ref, dtype=BF16)
            if not rep.passed:
                rows.append((label, None, f"WRONG {rep}"))
                return
            graph = do_bench_cudagraph(fn, rep=20, return_mode="median") if graphs else None
            rows.append((label, _time(fn), f"{note} graph {graph * 1e3:.1f} us" if graph else note))
        except Exception as e:
            rows.append((label, None, f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"))

    def ours(**kw):
        return lambda: td.decode_forward(prob, out, None, **kw)

    entry("triton-decode", ours(), lambda: out,
          f"splits={splits} {cfg} ws={td.workspace_bytes(prob, splits) / 2**20:.2f} MiB")
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)  # the same values stored [B, Nk, Hkv, D]
    vt = v.transpose(1, 2).contiguous().transpose(1, 2)
    prob_t = make_problem(q, kt, vt)
    entry("triton-decode, k/v bnhd", lambda p=prob_t: td.decode_forward(p, out, None), lambda: out)
    del kt, vt, prob_t
    saved = td.decode_merge_kernel
    td.decode_merge_kernel = _NoMerge()
    try:
        fresh = make_problem(q, k, v)  # a new plan, built while the merge is stubbed out
        rows.append(("  (split kernel alone)", _time(lambda: td.decode_forward(fresh, out, None)),
                     "merge skipped: output not checked"))
    finally:
        td.decode_merge_kernel = saved
    for bs in (16, 64):
        kc, vc, bt = paged_copy(k, v, bs)
        entry(f"triton-decode paged{bs}", ours(k_cache=kc, v_cache=vc, block_table=bt), lambda: out)
        del kc, vc
    for label, kind in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION")):
        try:
            fn, note = _sdpa(kind, q, k, v, Hq // Hkv)
        except Exception as e:
            rows.append((label, None, f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"))
            continue
        res = {}
        entry(label, lambda fn=fn, res=res: res.__setitem__("o", fn()), lambda res=res: res["o"], note)
    if sweep:
        for bn in (64, 128):
            for nw, ns in ((4, 2), (4, 3)):
                c = td.DecodeConfig(bn, nw, ns)
                entry(f"  sweep {bn}/{nw}/{ns} s{td.num_splits(prob, c, sm)}", ours(config=c), lambda: out)
        for f in (0.5, 2.0):
            s = max(1, min(td.MAX_SPLITS, round(splits * f)))
            entry(f"  sweep default splits={s}", ours(splits=s), lambda: out)
    print(f"-- B{B} Hq{Hq} Hkv{Hkv} Nk{Nk}: {gbytes * 1e3:.0f} MB of K/V", flush=True)
    for label, ms, note in rows:
        fig = f"{ms * 1e3:9.1f} us {gbytes * 1e3 / ms:8.0f} GB/s" if ms is not None else f"{'-':>23s}"
        print(f"   {label:30s} {fig}  {note}", flush=True)


class _NoMerge:
    """Stands in for the merge kernel to time the split kernel alone."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    a = ap.parse_args()
    p = torch.cuda.get_device_properties(0)
    print(f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; "
          f"triton {triton.__version__}; {p.name}, {p.multi_processor_count} SMs", flush=True)
    if a.tests:
        run_tests()
    failed = 0
    with strict_fp32():
        if not a.no_check:
            failed = run_checks()
        if not a.no_time:
            run_timing(a.sweep)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
