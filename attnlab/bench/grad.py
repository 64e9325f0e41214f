"""The backward suite: one competitor through its public call, gradients checked first, then three timed
modes, one row each (``mode`` column; case names ``<case>_fwd``, ``<case>_fwdbwd``, ``<case>_bwd``).

* The inputs are leaves that require grad (views of the case's input sets); each set has its own upstream
  gradient ``dout``.
* Check: ``out = call(q, k, v)`` then ``torch.autograd.grad(out, (q, k, v), dout)`` on set 0. ``out`` is
  checked as in the forward suites; dq, dk, dv against the float64 gradients of the reference on the same
  slice (:func:`attnlab.textbook_backward.textbook_backward` in float64) with FlashAttention's rule for half types:
  ``max|g - g64| <= 2 * max|g_textbook - g64| + floor``, g_textbook being autograd of the textbook attention
  in the same dtype and floor the dtype's unit roundoff times max(1, max|g64|). float32: the abs/rel
  criterion. A row is timed only when the output and all three gradients passed.
* ``fwd``: the forward call with grad-requiring inputs (it saves what the backward needs), graph dropped.
* ``fwd+bwd``: the forward call, then ``torch.autograd.grad(out, (q, k, v), dout)``.
* ``bwd``: the backward alone: each set's forward is run once, its graph retained, and the timed call is
  ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``. Where a competitor refuses a retained
  graph, ``bwd`` is ``fwd+bwd`` minus ``fwd`` (medians; the notes say so).

FLOPs: the forward's useful FLOPs times 1, 3.5 and 2.5 (the backward is counted as 2.5x the forward).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attnlab.bench.competitors import Competitor
from attnlab.bench.runner import entered, failure, first_call, make_row, measure, prepare, rates, status_rows
from attnlab.bench.schema import MIB
from attnlab.bench.suites import BACKWARD_MODES, row_keys
from attnlab.bench.timing import Options
from attnlab.bench.truth import CaseInputs, Truth, take_slice

GRAD_NAMES = ("dq", "dk", "dv")


def check_grads(grads, truth: Truth, dtype: torch.dtype) -> tuple[bool, dict[str, Any], str]:
    """(passed, the row's check columns (the worst gradient), a note with each gradient's error)."""
    from attnlab.check import compare

    sl = truth.sl
    bases = truth.grad_base or (None, None, None)
    ok, worst, parts = True, None, []
    for name, g, g64, gb in zip(GRAD_NAMES, grads, truth.grads, bases):
        rep = compare(take_slice(g, sl, kv=name != "dq"), g64, dtype=dtype, base=None if gb is None else gb)
        passed = rep.passed if rep.baseline_passed is None else bool(rep.baseline_passed)
        ok &= passed
        parts.append(f"{name} {rep.max_abs:.2e}" + ("" if rep.base_max_abs is None else
                                                    f" (2x textbook {2 * rep.base_max_abs:.2e} + {rep.floor:.1e})")
                     + ("" if passed else " FAIL"))
        if worst is None or not passed or rep.max_abs > worst.max_abs:
            worst = rep
    cols = {"max_abs_err": worst.max_abs, "rel_l2": worst.rel_l2,
            "base_max_abs": "" if worst.base_max_abs is None else worst.base_max_abs}
    return ok, cols, "grads: " + ", ".join(parts)


def _leaves(inp: CaseInputs) -> tuple[CaseInputs, list[tuple[torch.Tensor, ...]]]:
    """The case's input sets as leaves that require grad (sharing storage), and those leaves per set."""
    leaves = [tuple(t.detach().requires_grad_() for t in qkv) for qkv in zip(inp.qs, inp.ks, inp.vs)]
    ginp = dataclasses.replace(inp, qs=[x[0] for x in leaves], ks=[x[1] for x in leaves], vs=[x[2] for x in leaves])
    return ginp, leaves


def run_backward(comp: Competitor, inp: CaseInputs, truth: Truth, opts: Options, counts: dict[str, Any],
                 timing: tuple[int, float, int]) -> list[dict[str, Any]]:
    """Check, then time fwd, fwd+bwd and bwd of one competitor on one backward case: three rows."""
    from attnlab.check import compare

    case, dev = inp.case, inp.device
    base: dict[str, Any] = {"sets": inp.sets, "check_scope": truth.scope}
    ginp, leaves = _leaves(inp)
    douts = inp.douts
    prep, why = prepare(comp, ginp, dev)
    if prep is None:
        return status_rows(case, comp, opts, counts, **why, **base)
    with entered(prep):  # e.g. SDPA restricted to one kernel: entered once, not per timed call
        notes = list(prep.notes)

        def fwdbwd(i: int):
            return torch.autograd.grad(prep.call(i), leaves[i], douts[i])

        # 1. the checked call: forward (poisoned output for attnlab) and backward on set 0
        try:
            out, grads, first_s, fallback = first_call(prep, dev, lambda o: torch.autograd.grad(o, leaves[0], douts[0]))
            if comp.name == "flex" and first_s > 1.0:
                notes.append(f"first call (compile, fwd and bwd) {first_s:.1f} s")
            got = out.detach()
            if prep.zero_rows is not None and bool(prep.zero_rows.any()):
                got = got.masked_fill(prep.zero_rows, 0.0)
            rep = compare(take_slice(got, truth.sl), truth.ref, dtype=case.torch_dtype, base=truth.base)
            grads_ok, gcols, gnote = check_grads(grads, truth, case.torch_dtype)
            del out, got, grads
        except Exception as e:
            return status_rows(case, comp, opts, counts, **failure(comp, case, e, dev, "first call", notes), **base)
        notes.append(gnote)
        base["setup_mib"] = prep.setup_bytes / MIB
        fcols = {"max_abs_err": rep.max_abs, "rel_l2": rep.rel_l2,
                 "base_max_abs": "" if rep.base_max_abs is None else rep.base_max_abs}
        passed = bool(rep.passed) and grads_ok
        if fallback or not passed:
            status = "fallback" if fallback else "failed"
            extra = fallback[:1] if fallback else ([] if rep.passed else [f"out: {rep!r}"])
            out_rows = status_rows(case, comp, opts, counts, status=status, passed=passed,
                                   notes="; ".join(notes + extra), **base)
            for r in out_rows:
                r.update(fcols if r["mode"] == "fwd" else gcols)
            return out_rows
        # 2. each mode: memory, warm-up, timed calls, host time
        rows, timed = [], {}
        for (name, mode), (_, _, mult) in zip(row_keys(case), BACKWARD_MODES):
            c = dict(counts, flops=counts["flops"] * mult, bytes=counts["bytes"] if mode == "fwd" else "")
            mnotes = list(notes)
            kw = dict(case=name, mode=mode, passed=True, **base, **(fcols if mode == "fwd" else gcols))
            outs: list[torch.Tensor] = []
            try:
                if mode == "fwd":
                    call = prep.call
                elif mode == "fwd+bwd":
                    call = fwdbwd
                else:
                    outs = [prep.call(i) for i in range(inp.sets)]  # the retained graphs the timed calls reuse

                    def call(i: int, outs=outs):
                        return torch.autograd.grad(outs[i], leaves[i], douts[i], retain_graph=True)

                got, bad = measure(call, inp.sets, dev, timing, mnotes, prep.mark, prep.after_timing, prep.cold)
                outs.clear()
            except Exception as e:
                outs.clear()
                sub = _subtracted(timed) if mode == "bwd" else None
                if sub is not None:
                    mnotes.append(f"bwd = fwd+bwd - fwd (medians; a retained graph was refused: {str(e)[:120]})")
                    rows.append(make_row(case, comp, opts, c, status="ok", **sub, **rates(c, sub["ms"]),
                                     **{**kw, "notes": "; ".join(mnotes)}))
                    continue
                rows.append(make_row(case, comp, opts, c, **{**kw, **failure(comp, case, e, dev, f"{mode} timed calls",
                                                                         mnotes)}))
                continue
            if bad:
                rows.append(make_row(case, comp, opts, c, status="fallback",
                                     **{**kw, "notes": "; ".join([*mnotes, bad])}))
                continue
            timed[mode] = got
            rows.append(make_row(case, comp, opts, c, status="ok", **got, **rates(c, got["ms"]),
                             **{**kw, "notes": "; ".join(mnotes)}))
        return rows


def _subtracted(timed: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """bwd's timing columns as fwd+bwd minus fwd, when both were timed."""
    if "fwd" not in timed or "fwd+bwd" not in timed:
        return None
    a, b = timed["fwd+bwd"], timed["fwd"]
    return {"ms": max(a["ms"] - b["ms"], 1e-6), "ms_min": "", "ms_iqr": "", "reps": min(a["reps"], b["reps"]),
            "peak_extra_mib": a["peak_extra_mib"], "host_us": max(a["host_us"] - b["host_us"], 0.0)}
