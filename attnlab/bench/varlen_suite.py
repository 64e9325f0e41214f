"""The ``varlen`` suite: packed documents through :func:`attnlab.attention_varlen`, side by side with the rivals.

One packed batch: document lengths drawn log-uniformly in [64, 8192] (seed 0) until the total reaches 32,768
tokens, the last one truncated; causal within each document (bottom-right, the same as top-left here: a
document's query and key lengths are equal). Two cases: GQA 32/8 with D 128, and D 192 / Dv 128 without GQA.

Competitors, each on the same inputs, checked before they are timed:

* ``attnlab``: ``attention_varlen`` as a user calls it (backend ``auto``);
* ``flex``: compiled ``flex_attention`` (default mode) on the packed tensors as one sequence, with a document
  block mask (``create_block_mask``, built once, untimed);
* ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``: SDPA with ``is_causal`` on the padded equivalent
  [B, H, max_len, D] (a document's rows never see the padding keys under causal; padding rows are dropped
  from the check and get no upstream gradient), each SDPA kernel forced in turn;
* ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` where the installed torch has it.

Rows (``varlen.csv``): case, backend, mode (``fwd`` or ``bwd``: the backward alone, from a retained graph),
status, passed, ms (median), ms_min, reps, tflops (useful: allowed pairs only, 2 (D + Dv) FLOPs a pair
forward, 2 (3 D + 2 Dv) backward), peak_extra_mib, max_abs_err, notes. The forward is checked against the
float64 reference of each document, the gradients against float64 per document, each with the textbook's
error in the input dtype as the baseline (FlashAttention's rule, :func:`attnlab.check.compare`).

``python -m attnlab.bench.varlen_suite --out data/bench`` writes ``<out>/<gpu>/varlen.csv`` and ``varlen.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import itertools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

COLUMNS = ("case", "backend", "mode", "status", "passed", "ms", "ms_min", "reps", "tflops", "peak_extra_mib",
           "max_abs_err", "docs", "total_tokens", "allowed_pairs", "notes")


@dataclass(frozen=True)
class VarlenCase:
    name: str
    Hq: int
    Hkv: int
    D: int
    Dv: int
    dtype: torch.dtype = torch.bfloat16


CASES = (VarlenCase("gqa32_8_d128", 32, 8, 128, 128), VarlenCase("mla_d192_dv128", 32, 32, 192, 128))


def document_lengths(total: int = 32768, lo: int = 64, hi: int = 8192, seed: int = 0) -> list[int]:
    """Lengths drawn log-uniformly in [lo, hi] with ``seed`` until they reach ``total``; the last is truncated."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        out.append(min(round(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))), total - sum(out)))
    return out


def allowed_pairs(lengths: list[int]) -> int:
    """Causal pairs within each document, per head."""
    return sum(n * (n + 1) // 2 for n in lengths)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu: torch.Tensor  #: int32 prefix sums on the GPU (queries and keys alike)
    lengths: list[int]
    rows: torch.Tensor  #: [B, max_len] packed row of each padded slot (total for padding)

    @property
    def max_len(self) -> int:
        return max(self.lengths)


def make_inputs(case: VarlenCase, lengths: list[int], device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    draw = lambda h, d: torch.randn(total, h, d, generator=gen, device=device, dtype=case.dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    offs = torch.arange(max(lengths), device=device)
    lens = torch.tensor(lengths, device=device)
    rows = torch.where(offs[None] < lens[:, None], cu[:-1, None].long() + offs[None], total)
    return Inputs(draw(case.Hq, case.D), draw(case.Hkv, case.D), draw(case.Hkv, case.Dv), cu, lengths, rows)


def pad(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[total, H, D] -> [B, H, max_len, D] (padding slots 0)."""
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])[rows].transpose(1, 2)


def unpad(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """[B, H, max_len, D] -> [total, H, D] (padding slots dropped)."""
    flat = x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])
    keep = rows.reshape(-1) < total
    out = x.new_empty((total, x.shape[1], x.shape[-1]))
    out[rows.reshape(-1)[keep]] = flat[keep]
    return out


# ---------------------------------------------------------------------------------------------------------
# Competitors: each takes the inputs in a layout of its own (made before any timing) and gives them back packed
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Rival:
    """A competitor's call on inputs in its own layout, and the maps between that layout and the packed one."""

    call: Callable[..., torch.Tensor]
    own: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # packed [total, H, D] -> its own layout
    packed: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # its own layout -> packed


def _attnlab(inp: Inputs) -> Rival:
    import attnlab

    m = inp.max_len
    return Rival(lambda q, k, v: attnlab.attention_varlen(q, k, v, inp.cu, inp.cu, m, m, causal=True,
                                                          align="bottom_right"))


def _flex(inp: Inputs) -> Rival:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = inp.q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(inp.lengths), device=inp.q.device),
                                  torch.tensor(inp.lengths, device=inp.q.device))

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(document_causal, None, None, total, total, device=inp.q.device)
    compiled = torch.compile(flex_attention)
    gqa = inp.q.shape[1] != inp.k.shape[1]
    return Rival(lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa),
                 own=lambda x: x.transpose(0, 1).unsqueeze(0),  # [1, H, total, D], one long sequence
                 packed=lambda x: x[0].transpose(0, 1))


def _sdpa(backend_name: str) -> Callable[[Inputs], Rival]:
    def make(inp: Inputs) -> Rival:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]
        gqa = inp.q.shape[1] != inp.k.shape[1]

        def call(q, k, v):
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        return Rival(call, own=lambda x: pad(x, inp.rows), packed=lambda x: unpad(x, inp.rows, inp.q.shape[0]))

    return make


def _varlen_attn(inp: Inputs) -> Rival:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    m = inp.max_len
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:  # (left, right): -1 unbounded, right 0 is causal
        causal = {"window_size": [-1, 0]}
    else:
        raise TypeError(f"varlen_attn{inspect.signature(varlen_attn)}: no causal parameter known here")
    return Rival(lambda q, k, v: varlen_attn(q, k, v, inp.cu, inp.cu, m, m, **causal))


COMPETITORS: dict[str, Callable[[Inputs], Rival]] = {
    "attnlab": _attnlab, "flex": _flex, "sdpa-flash": _sdpa("flash"), "sdpa-cudnn": _sdpa("cudnn"),
    "sdpa-efficient": _sdpa("efficient"), "varlen_attn": _varlen_attn,
}


# ---------------------------------------------------------------------------------------------------------
# Truth, checks, timing
# ---------------------------------------------------------------------------------------------------------
def truth(inp: Inputs, dout: torch.Tensor) -> dict[str, Any]:
    """Per document: float64 out and gradients, and the textbook's in the input dtype (the baselines)."""
    from attnlab.backends.textbook import TextbookBackend
    from attnlab.problem import make_problem
    from attnlab.reference import reference_forward
    from attnlab.textbook_backward import textbook_backward

    cu = [0, *torch.tensor(inp.lengths).cumsum(0).tolist()]
    parts: dict[str, list] = {n: [] for n in ("out", "dq", "dk", "dv", "base_out", "base_dq", "base_dk", "base_dv")}
    for a, b in itertools.pairwise(cu):
        one = functools.partial(_document, rows=slice(a, b))
        prob = make_problem(one(inp.q), one(inp.k), one(inp.v), causal=True, layout="bnhd")
        do = one(dout).transpose(1, 2)
        o64, _ = reference_forward(prob)
        parts["out"].append(prob.to_layout(o64)[0])
        base, base_bhnd = prob.new_out()
        TextbookBackend().forward(prob, base_bhnd, None)
        parts["base_out"].append(base[0])
        for tag, dtype in (("", torch.float64), ("base_", inp.q.dtype)):
            grads = textbook_backward(prob, do, None, dtype=dtype)[:3]
            for n, g in zip(("dq", "dk", "dv"), grads):
                parts[tag + n].append(prob.to_layout(g)[0])
    return {n: torch.cat(x) for n, x in parts.items()}


def _document(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of a packed [total, H, D] tensor as a [1, n, H, D] batch."""
    return x[rows].unsqueeze(0)


def check(got: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, dtype: torch.dtype):
    from attnlab.check import compare

    rep = compare(got, ref, dtype=dtype, base=base)
    return bool(rep.baseline_passed if rep.baseline_passed is not None else rep.passed), rep.max_abs


def timed(call: Callable[[], Any], device: torch.device, reps: int = 20, warmup: int = 3) -> tuple[float, float, int]:
    from attnlab.bench.timing import median, time_calls

    for _ in range(warmup):
        call()
    times = time_calls(lambda i: call(), 1, reps, device)
    return median(times), min(times), reps


def run_case(case: VarlenCase, names: list[str], device: torch.device, log) -> list[dict[str, Any]]:
    """Every competitor on ``case``'s packed batch: a forward row and a backward row each."""
    from attnlab.bench.timing import free_memory

    lengths = document_lengths()
    inp = make_inputs(case, lengths, device)
    gen = torch.Generator(device=device).manual_seed(1)
    dout = torch.randn(inp.q.shape[0], case.Hq, case.Dv, generator=gen, device=device, dtype=case.dtype)
    t = truth(inp, dout)
    pairs = allowed_pairs(lengths) * case.Hq
    flops = {"fwd": 2 * (case.D + case.Dv) * pairs, "bwd": 2 * (3 * case.D + 2 * case.Dv) * pairs}
    common = {"case": case.name, "docs": len(lengths), "total_tokens": sum(lengths), "allowed_pairs": pairs}
    rows = []
    for name in names:
        base_row = {**common, "backend": name}
        try:
            rival = COMPETITORS[name](inp)
            own = [rival.own(x) for x in (inp.q, inp.k, inp.v)]
            with torch.no_grad():
                out = rival.packed(rival.call(*own))
        except Exception as e:  # a rival that does not take this problem: recorded, not raised
            for mode in ("fwd", "bwd"):
                rows.append({**base_row, "mode": mode, "status": "error", "passed": False,
                             "notes": f"{type(e).__name__}: {str(e)[:300]}"})
            log(f"{case.name} {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        ok, err = check(out, t["out"], t["base_out"], case.dtype)
        del out
        rows.append(_forward_row(rival, own, ok, err, flops["fwd"], base_row, device))
        log(f"{case.name} {name} fwd: {rows[-1].get('ms', '-')} ms ok={ok} err={err:.2e}")
        rows.append(_backward_row(rival, own, dout, t, case.dtype, flops["bwd"], base_row, device))
        log(f"{case.name} {name} bwd: {rows[-1].get('ms', '-')} ms {rows[-1]['notes']}")
        free_memory(device)
    return rows


def _forward_row(rival: Rival, own: list, ok: bool, err: float, flops: int, row: dict, device) -> dict[str, Any]:
    """The forward's row: checked already (``ok``, ``err``), timed only when it passed."""
    from attnlab.bench.timing import measure_peak

    row = {**row, "mode": "fwd", "passed": ok, "max_abs_err": err, "status": "ok" if ok else "failed", "notes": ""}
    if ok:
        with torch.no_grad():
            row["ms"], row["ms_min"], row["reps"] = timed(lambda: rival.call(*own), device)
            _, row["peak_extra_mib"] = measure_peak(lambda i: rival.call(*own), 0, device)
        row["tflops"] = flops / row["ms"] / 1e9
    return row


def _backward_row(rival: Rival, own: list, dout: torch.Tensor, t: dict, dtype: torch.dtype, flops: int, row: dict,
                  device) -> dict[str, Any]:
    """The backward alone: the gradients of one retained forward graph (in the rival's own layout, the padding
    rows of a padded one getting no upstream gradient), checked, then timed if they passed."""
    from attnlab.bench.timing import measure_peak

    leaves = [x.detach().requires_grad_() for x in own]
    dout = rival.own(dout)
    row = {**row, "mode": "bwd"}
    try:
        out = rival.call(*leaves)
        grads = [rival.packed(g) for g in torch.autograd.grad(out, leaves, dout, retain_graph=True)]
    except Exception as e:  # a rival without this backward: recorded, not raised
        return {**row, "status": "error", "passed": False, "notes": f"{type(e).__name__}: {str(e)[:300]}"}
    checks = [check(g, t[n], t["base_" + n], dtype) for n, g in zip(("dq", "dk", "dv"), grads)]
    del grads
    ok = all(c[0] for c in checks)
    row.update(passed=ok, max_abs_err=max(c[1] for c in checks), status="ok" if ok else "failed",
               notes="grads: " + ", ".join(f"{n} {c[1]:.2e}{'' if c[0] else ' FAIL'}"
                                           for n, c in zip(("dq", "dk", "dv"), checks)))
    if ok:
        def step():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

        row["ms"], row["ms_min"], row["reps"] = timed(step, device)
        _, row["peak_extra_mib"] = measure_peak(lambda i: step(), 0, device)
        row["tflops"] = flops / row["ms"] / 1e9
    return row


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: (f"{r[c]:.6g}" if isinstance(r.get(c), float) else r.get(c, "")) for c in COLUMNS})


def main(argv: list[str] | None = None) -> int:
    from attnlab.bench.results import environment, gpu_slug

    p = argparse.ArgumentParser(prog="python -m attnlab.bench.varlen_suite", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/bench", help="folder; results go to <out>/<gpu>/varlen.csv")
    p.add_argument("--backends", nargs="+", default=list(COMPETITORS), choices=list(COMPETITORS))
    p.add_argument("--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the varlen suite runs on a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    env = environment("cuda", ["varlen", *(argv if argv is not None else sys.argv[1:])])
    env["command"] = "python -m attnlab.bench.varlen_suite " + " ".join(argv if argv is not None else sys.argv[1:])
    folder = Path(args.out) / gpu_slug(env.get("gpu", "cpu"))
    env["lengths"] = document_lengths()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "varlen.json").write_text(json.dumps(env, indent=1, default=str) + "\n")  # first: a cut run keeps it
    rows: list[dict[str, Any]] = []
    for case in CASES:
        if case.name in args.cases:
            with contextlib.suppress(KeyboardInterrupt):
                rows += run_case(case, args.backends, device, lambda s: print(s, flush=True))
            write(folder / "varlen.csv", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
