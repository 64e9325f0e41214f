"""Decode on one GPU, per decode-suite configuration: GPU time by CUDA-graph replay (host excluded) of SDPA's
cuDNN and flash kernels, attnlab's public call, the paged caches and a
contiguous cache in the [B, Nk, Hkv, D] layout (the layout a paged block holds), a few split-kernel configs;
and the kernels torch.profiler sees per call with their GPU times. Every timed variant's output is compared
with the one-split packed output of the same input first. One call, stdout.

Usage: ``PYTHONPATH=.:scripts python3 scripts/decode_probe.py [--quick]``."""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from decode_profile import case_inputs, graph_us  # scripts/, beside this one
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab.backends.triton import decode as td
from attnlab.bench.suites import decode_suite
from attnlab.paged import to_paged

SWEEP = [td.DecodeConfig(64, 4, 3), td.DecodeConfig(32, 4, 3), td.DecodeConfig(128, 4, 2),
         td.DecodeConfig(64, 8, 2)]


def kernels(fn, calls: int = 10) -> str:
    """The GPU kernels of one call of ``fn`` and their mean GPU us, as torch.profiler sees them."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    tot = defaultdict(float)
    n = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] += e.device_time
            n[e.name] += 1
    return "; ".join(f"{name[:48]} x{n[name] / calls:g} {tot[name] / n[name]:.1f}us" for name in tot)


def probe(case, quick: bool) -> None:
    B, Hkv, Nk, D = case.B, case.Hkv, case.Nk, case.D
    prob, q, k, v, kv_len = case_inputs(case)
    kw = {} if kv_len is None else {"kv_len": kv_len}
    gb = (2 * B * Hkv * D * 2 * (Nk if case.kv_len is None else sum(case.kv_len) / B)) / 1e9
    ref = torch.empty_like(q)
    td._PLANS.clear()
    td.decode_forward(prob, ref, None, splits=1)
    label = f"{case.name:36s}"

    def line(name, fn, out=None):
        try:
            got = fn()
            err = "" if out is None and got is None else \
                f" err {((got if got is not None else out).float() - ref.float()).abs().max().item():.1e}"
            us = graph_us(fn)
        except Exception as e:  # report and go on
            print(label, f"{name:28s} {type(e).__name__}: {str(e)[:100]}", flush=True)
            return None
        print(label, f"{name:28s} {us:8.1f} us {gb / (us * 1e-6) / 1e3:5.2f} TB/s{err}", flush=True)
        return us

    if case.kv_len is None:
        for name, kind in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            def sd(kind=kind):
                with sdpa_kernel(kind):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            line(name, sd)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            print(label, "cudnn kernels:", kernels(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    else:
        mask = (torch.arange(Nk, device="cuda")[None, :] < kv_len[:, None])[:, None, None, :]
        def sd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        line("sdpa-cudnn (bool mask)", sd)
    line("attnlab auto", lambda: attnlab.attention(q, k, v, **kw))
    plan = next(p for key, p in td._PLANS.items() if key[1:] == (None, None, None))
    print(label, f"auto plan: S={plan.n_split} cfg={plan.cfg} grid={plan.grid}",
          "| kernels:", kernels(lambda: attnlab.attention(q, k, v, **kw)), flush=True)
    out = torch.empty_like(q)
    kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))  # [B, Nk, Hkv, D] underneath
    line("attnlab auto, k/v bnhd", lambda: attnlab.attention(q, kt, vt, **kw))
    for bs in (16, 64):
        kc, vc, bt = to_paged(k, v, bs)
        line(f"attnlab paged{bs}", lambda kc=kc, vc=vc, bt=bt: attnlab.attention(q, kc, vc, block_table=bt, **kw))
        if not quick:
            pk = td.paged_kv(kc, vc, bt, B=B, Hkv=Hkv, D=D, Nk=Nk, dtype=q.dtype, device=q.device, block_size=None,
                             kv_len=kv_len)
            for cfg in (td.DecodeConfig(64, 4, 3), td.DecodeConfig(64, 4, 3, 128), td.DecodeConfig(64, 4, 2)):
                line(f"  paged{bs} {cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}/{cfg.maxnreg}",
                     lambda cfg=cfg, pk=pk: td.decode_forward(prob, out, None, paged=pk, config=cfg), out)
    if quick:
        return
    for cfg in SWEEP:
        line(f"  {cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}", lambda cfg=cfg: td.decode_forward(
            prob, out, None, config=cfg), out)
        print(label, f"     S={td.gpu_plan(prob, cfg).n_split}", flush=True)


def main() -> int:
    quick = "--quick" in sys.argv
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for case in decode_suite("cuda"):
        probe(case, quick)
        td._PLANS.clear()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
