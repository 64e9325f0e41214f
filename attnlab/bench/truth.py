"""The inputs of a case (several sets, so that rotating among them defeats the L2) and the float64 truth
the first call is checked against (on a consistent slice for large cases)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.bench.suites import BenchCase
from attnlab.bench.timing import free_memory
from attnlab.masks import MaskSpec

# ---------------------------------------------------------------------------------------------------------
# Inputs, the checked slice, the truth
# ---------------------------------------------------------------------------------------------------------


@dataclass
class CaseInputs:
    """The tensors of one case: ``sets`` input sets (q, k, v) and the shared mask keywords."""

    case: BenchCase
    device: torch.device
    qs: list[torch.Tensor]
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]
    kw: dict[str, Any]
    spec: MaskSpec
    #: the upstream gradient of each set (backward cases only)
    douts: list[torch.Tensor] | None = None

    @property
    def sets(self) -> int:
        return len(self.qs)


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "L2_cache_size", 0) or 60 * 10**6)
    return 32 * 2**20


def n_sets_for(case: BenchCase, device: torch.device, max_sets: int = 8) -> int:
    """Input sets to rotate: together at least 4x the L2 (q, k, v and out; dout too for a backward case), at
    least 2, at most ``max_sets``."""
    per = ((3 if case.backward else 2) * case.B * case.Hq * case.Nq + 2 * case.B * case.hkv * case.nk) * case.D \
        * case.elem_size
    return int(min(max_sets, max(2, math.ceil(4 * l2_bytes(device) / max(1, per)))))


def make_case_inputs(case: BenchCase, device: torch.device | str, seed: int = 0, sets: int | None = None) -> CaseInputs:
    """Draw ``sets`` seeded N(0, 1) input sets on ``device`` (generated there: no host copy)."""
    device = torch.device(device)
    sets = n_sets_for(case, device) if sets is None else sets
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = case.torch_dtype
    qs, ks, vs = [], [], []
    for _ in range(sets):
        qs.append(torch.randn(case.B, case.Hq, case.Nq, case.D, device=device, dtype=dt, generator=gen))
        ks.append(torch.randn(case.B, case.hkv, case.nk, case.D, device=device, dtype=dt, generator=gen))
        vs.append(torch.randn(case.B, case.hkv, case.nk, case.D, device=device, dtype=dt, generator=gen))
    douts = None
    if case.backward:
        douts = [torch.randn(case.B, case.Hq, case.Nq, case.D, device=device, dtype=dt, generator=gen)
                 for _ in range(sets)]
    kw = case.keywords(device)
    spec = MaskSpec.build(case.B, case.Hq, case.Nq, case.nk, device=device, **case.mask_keywords(device))
    return CaseInputs(case, device, qs, ks, vs, kw, spec, douts)


#: Cases with at most this many scores (B*Hq*Nq*Nk) are checked whole; larger ones on a slice.
FULL_CHECK_SCORES = 2**26


def check_slice(case: BenchCase, full_scores: int = FULL_CHECK_SCORES) -> tuple[list[int], list[int], list[int]] | None:
    """(batch entries, query heads, kv heads) of the checked sub-problem, or None to check everything.

    Batch entries {0, B-1}; kv heads {0, Hkv-1} when each has at most 2 query heads, else {Hkv-1}; and all
    query heads of those kv heads (GQA stays consistent). From Nq*Nk >= 2^28 (N 16384) one batch entry
    (B-1) and one kv head (Hkv-1) only. Batch entries and heads are independent, so the slice of the
    output is the output of the sliced problem.
    """
    if case.B * case.Hq * case.Nq * case.nk <= full_scores:
        return None
    group = case.Hq // case.hkv
    if case.Nq * case.nk >= 2**28:
        bs, kvh = [case.B - 1], [case.hkv - 1]
    else:
        bs = sorted({0, case.B - 1})
        kvh = sorted({0, case.hkv - 1}) if group <= 2 else [case.hkv - 1]
    qh = [h * group + g for h in kvh for g in range(group)]
    return bs, qh, kvh


def slice_scope(sl: tuple[list[int], list[int], list[int]] | None) -> str:
    if sl is None:
        return "full"
    return f"slice b={sl[0]} hq={sl[1]}"


def take_slice(out: torch.Tensor, sl, kv: bool = False) -> torch.Tensor:
    """The checked part of an output [B, Hq, Nq, D] (dq too), or with ``kv`` of a key-side tensor
    [B, Hkv, Nk, D] (dk, dv)."""
    if sl is None:
        return out
    bs, qh, kvh = sl
    dev = out.device
    heads = kvh if kv else qh
    return out.index_select(0, torch.tensor(bs, device=dev)).index_select(1, torch.tensor(heads, device=dev))


@dataclass
class Truth:
    """Float64 reference (and, for half types, the textbook baseline) on the checked part of set 0; for a
    backward case also the gradients (dq, dk, dv) of both (:func:`grad_truth`)."""

    ref: torch.Tensor
    base: torch.Tensor | None
    scope: str
    sl: Any
    grads: tuple[torch.Tensor, ...] | None = None
    grad_base: tuple[torch.Tensor, ...] | None = None


def slice_inputs(inp: CaseInputs, sl) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(q, k, v, keywords) of set 0 restricted to the slice ``sl`` (lengths and an explicit mask too)."""
    q, k, v, kw = inp.qs[0], inp.ks[0], inp.vs[0], dict(inp.kw)
    if sl is None:
        return q, k, v, kw
    dev = inp.device
    bs, qh, kvh = (torch.tensor(x, device=dev) for x in sl)
    q = q.index_select(0, bs).index_select(1, qh)
    k = k.index_select(0, bs).index_select(1, kvh)
    v = v.index_select(0, bs).index_select(1, kvh)
    for key in ("kv_len", "q_len"):
        if key in kw:
            kw[key] = kw[key].index_select(0, bs)
    if "sinks" in kw:  # [Hq]
        kw["sinks"] = kw["sinks"].index_select(0, qh)
    if "alibi_slopes" in kw:  # [Hq] or [B, Hq]
        a = kw["alibi_slopes"]
        kw["alibi_slopes"] = a.index_select(0, qh) if a.dim() == 1 else a.index_select(0, bs).index_select(1, qh)
    m = kw.get("mask")
    if m is not None:  # broadcast to [B, Hq, Nq, Nk] from the right: batch is dim -4, heads dim -3
        if m.dim() >= 4 and m.shape[-4] > 1:
            m = m.index_select(m.dim() - 4, bs.to(m.device))
        if m.dim() >= 3 and m.shape[-3] > 1:
            m = m.index_select(m.dim() - 3, qh.to(m.device))
        kw["mask"] = m
    return q, k, v, kw


def make_truth(inp: CaseInputs, full_scores: int = FULL_CHECK_SCORES) -> Truth:
    """Reference (float64, chunked, on the inputs' device) and baseline on set 0, sliced as :func:`check_slice`."""
    from attnlab.api import attention
    from attnlab.reference import reference

    case, dev = inp.case, inp.device
    sl = check_slice(case, full_scores)
    q, k, v, kw = slice_inputs(inp, sl)
    ref, _ = reference(q, k, v, **kw)
    base, scope = None, slice_scope(sl)
    if case.torch_dtype != torch.float32:
        try:
            base = attention(q, k, v, backend="torch", **kw)
        except torch.cuda.OutOfMemoryError:
            scope += " (no baseline criterion: the textbook baseline ran out of memory)"
            free_memory(dev)
    truth = Truth(ref=ref, base=base, scope=scope, sl=sl)
    if case.backward:
        truth.grads, truth.grad_base = grad_truth(inp, sl)
    return truth


def textbook(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
    """The textbook attention in the inputs' dtype, differentiable; rows with no allowed key give 0. Score
    modifiers as the contract has them: softcap and ALiBi in the scores, a sink as one more key of value 0."""
    from attnlab.problem import make_problem
    from attnlab.reference import masked_scores

    prob = make_problem(q, k, v, **kw)
    B, Hq, Hkv, Nq, Nk, D = prob.B, prob.Hq, prob.Hkv, prob.Nq, prob.Nk, prob.D
    s = masked_scores(prob, 0, Nq, prob.dtype)
    empty = (s == float("-inf")).all(dim=-1, keepdim=True)
    if prob.mods.sinks is not None:  # the sink's column keeps every row's softmax finite
        sink = prob.mods.sinks.detach().to(s.dtype).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :Nk]
    else:
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    o = torch.matmul(p.reshape(B, Hkv, Hq // Hkv, Nq, Nk), prob.v.unsqueeze(2))
    return o.reshape(B, Hq, Nq, D)


def grad_truth(inp: CaseInputs, sl) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None]:
    """(float64 dq, dk, dv of the reference; the same-dtype textbook's, or None for float32 or after an OOM)
    on the slice ``sl`` of set 0, for set 0's dout."""
    from attnlab.problem import make_problem
    from attnlab.textbook_backward import textbook_backward

    q, k, v, kw = slice_inputs(inp, sl)
    dout = take_slice(inp.douts[0], sl)
    with torch.no_grad():
        dq, dk, dv, *_ = textbook_backward(make_problem(q, k, v, **kw), dout, None, dtype=torch.float64)
    base = None
    if q.dtype != torch.float32:
        try:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            base = torch.autograd.grad(textbook(*leaves, kw), leaves, dout)
        except torch.cuda.OutOfMemoryError:
            free_memory(inp.device)
    return (dq, dk, dv), base
