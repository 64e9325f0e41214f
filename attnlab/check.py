"""The checker: how far an output is from the float64 reference, and whether that is close enough.

Two criteria, both reported (docs/contract.md, "The checker and its tolerances"):

* **abs/rel**: every element satisfies ``|out - ref| <= atol + rtol * |ref|``, with per-dtype defaults
  (:data:`TOLERANCES`).
* **baseline** (the FlashAttention test convention): ``max|out - ref| <= 2 * max|base - ref| + floor``,
  where ``base`` is the textbook PyTorch computation in the same dtype and ``floor`` is the rounding noise
  of the output dtype (its unit roundoff times ``max|ref|``). Judged only when a baseline is given.

``passed`` means: no NaN anywhere the reference has none, infinities where the reference has the same
ones, and both criteria hold. NaN never passes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

#: (atol, rtol) per output dtype for the abs/rel criterion. float32 assumes IEEE arithmetic (TF32 off).
#: The half-type values cover a kernel that rounds P to the input dtype before P@V, as FlashAttention
#: does, and the textbook PyTorch version, which also rounds the scores; notebook 07 derives them.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (4e-2, 4e-2),
    # float8_e4m3fn inputs (bfloat16 out): exact inputs, P rounded to e4m3 (unit roundoff 2^-4), so an element
    # errs by at most 2^-4 * sum_j p_j |v_j|; the abs/rel criterion is a sanity bound, the baseline the sharp one
    torch.float8_e4m3fn: (2.0**-3, 2.0**-4),
}

#: Unit roundoff of each dtype: the floor of the baseline criterion is this times max|ref|.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float8_e4m3fn: 2.0**-8,  # the bfloat16 output's
}


@dataclass
class Report:
    """How ``out`` compares with ``ref``; ``passed`` applies both criteria (module docstring)."""

    max_abs: float
    max_rel: float
    rel_l2: float
    worst: tuple[int, ...] | None  #: index of the element with the largest abs/rel violation ratio
    nan_count: int
    inf_count: int
    atol: float
    rtol: float
    abs_rel_passed: bool
    base_max_abs: float | None = None  #: max|base - ref|, when a baseline was given
    floor: float | None = None
    baseline_passed: bool | None = None
    passed: bool = False
    dtype: str = ""

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        parts = [
            f"{verdict} [{self.dtype}] max_abs={self.max_abs:.3e} max_rel={self.max_rel:.3e} rel_l2={self.rel_l2:.3e}",
            f"worst at {self.worst}" if self.worst is not None else "",
            f"abs/rel (atol={self.atol:g}, rtol={self.rtol:g}): {'ok' if self.abs_rel_passed else 'FAIL'}",
        ]
        if self.baseline_passed is not None:
            parts.append(
                f"baseline (<= 2*{self.base_max_abs:.3e} + {self.floor:.1e}): "
                f"{'ok' if self.baseline_passed else 'FAIL'}"
            )
        if self.nan_count or self.inf_count:
            parts.append(f"nan={self.nan_count} inf={self.inf_count}")
        return "Report(" + "; ".join(p for p in parts if p) + ")"


def _abs_err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in float64, 0 where both hold the same infinity, NaN where either is NaN."""
    o, r = out.to(torch.float64), ref.to(torch.float64)
    same_inf = torch.isinf(o) & (o == r)
    return torch.where(same_inf, torch.zeros_like(o), (o - r).abs())


def compare(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    base: torch.Tensor | None = None,
    floor: float | None = None,
) -> Report:
    """Compare ``out`` with the float64 ``ref`` (same shape). ``dtype`` picks default tolerances
    (``out``'s dtype by default); ``base`` enables the baseline criterion."""
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        raise TypeError("compare takes two tensors (out, ref)")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out and ref must have the same shape; got {list(out.shape)} and {list(ref.shape)}")
    dtype = dtype or out.dtype
    if dtype not in TOLERANCES:
        raise TypeError(f"no default tolerance for {dtype}; pass atol and rtol")
    d_atol, d_rtol = TOLERANCES[dtype]
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    ref64 = ref.to(torch.float64).cpu()
    out64 = out.to(torch.float64).cpu()
    err = _abs_err(out64, ref64)
    nan_count = int(torch.isnan(out64).sum())
    inf_count = int(torch.isinf(out64).sum())
    bad_nan = bool(torch.isnan(err).any())
    err0 = torch.nan_to_num(err, nan=float("inf"))
    finite_ref = torch.where(torch.isfinite(ref64), ref64, torch.zeros_like(ref64))
    allowed = atol + rtol * finite_ref.abs()
    n = err.numel()
    if n:
        ratio = err0 / allowed
        worst_flat = int(torch.argmax(torch.nan_to_num(ratio, nan=float("inf"))))
        worst = tuple(int(x) for x in torch.unravel_index(torch.tensor(worst_flat), err.shape))
        max_abs = float(err0.max())
        rel = err0 / finite_ref.abs().clamp_min(atol)
        max_rel = float(rel.max())
        diff = torch.where(torch.isfinite(err), out64 - ref64, torch.zeros_like(err))
        denom = float(torch.linalg.vector_norm(finite_ref))
        rel_l2 = float(torch.linalg.vector_norm(diff)) / denom if denom > 0 else float(torch.linalg.vector_norm(diff))
        if bad_nan:
            rel_l2 = float("nan")
        abs_rel_ok = not bad_nan and bool((err0 <= allowed).all())
    else:
        worst, max_abs, max_rel, rel_l2, abs_rel_ok = None, 0.0, 0.0, 0.0, True
    rep = Report(
        max_abs=max_abs, max_rel=max_rel, rel_l2=rel_l2, worst=worst, nan_count=nan_count,
        inf_count=inf_count, atol=atol, rtol=rtol, abs_rel_passed=abs_rel_ok, dtype=str(dtype).replace("torch.", ""),
    )
    if base is not None:
        if tuple(base.shape) != tuple(ref.shape):
            raise ValueError(f"base must have ref's shape {list(ref.shape)}; got {list(base.shape)}")
        berr = torch.nan_to_num(_abs_err(base.cpu(), ref64), nan=float("inf"))
        rep.base_max_abs = float(berr.max()) if n else 0.0
        ref_max = float(finite_ref.abs().max()) if n else 0.0
        rep.floor = UNIT_ROUNDOFF.get(dtype, 0.0) * max(ref_max, 1.0) if floor is None else floor
        rep.baseline_passed = not bad_nan and max_abs <= 2 * rep.base_max_abs + rep.floor
    rep.passed = rep.abs_rel_passed and rep.baseline_passed is not False
    return rep


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """Turn TF32 off for matmuls and convolutions, and restore the previous settings afterwards.

    Newer torch has ``fp32_precision`` settings (and refuses to mix them with the legacy flags); older
    torch has ``allow_tf32`` flags and ``set_float32_matmul_precision``. Whichever this torch has is used.
    """
    cudnn = torch.backends.cudnn
    knobs = [torch.backends.cuda.matmul, cudnn, getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)]
    knobs = [k for k in knobs if k is not None]
    if all(hasattr(k, "fp32_precision") for k in knobs[:2]):
        settings = [(k, "fp32_precision", "ieee") for k in knobs if hasattr(k, "fp32_precision")]
    else:
        settings = [(torch.backends.cuda.matmul, "allow_tf32", False), (cudnn, "allow_tf32", False)]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in settings]
    old_prec = None if settings[0][1] == "fp32_precision" else torch.get_float32_matmul_precision()
    try:
        for obj, attr, value in settings:
            setattr(obj, attr, value)
        if old_prec is not None:
            torch.set_float32_matmul_precision("highest")
        yield
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)
        if old_prec is not None:
            torch.set_float32_matmul_precision(old_prec)


def tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls may use TF32 under the current settings."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        return m.fp32_precision == "tf32"
    return bool(m.allow_tf32)


def verify(
    backends: Iterable[str] | None = None,
    cases: Sequence | None = None,
    *,
    device: str | torch.device | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    seed: int | None = None,
    progress: bool = False,
):
    """Run every backend on every case, compare with the reference, and return a pandas DataFrame.

    One row per (backend, case, dtype): the case's shape and masks, max_abs, rel_l2, the lse error, both
    criteria, passed, and the error message when the backend raised. ``seed`` None draws fresh inputs
    (the seed used is in the ``seed`` column, to reproduce a failure). ``backends`` defaults to every
    available one except the reference; ``cases`` to :func:`attnlab.cases.default_cases`.
    """
    import pandas as pd

    from attnlab import backends as _backends
    from attnlab.api import poison_outputs
    from attnlab.cases import default_cases, make_inputs, takes_dtype
    from attnlab.problem import FP8

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if backends is None:
        backends = [n for n, a in _backends.status().items() if a.available and n != "reference"]
    backends = list(backends)
    for b in backends:
        if b not in _backends.names():
            raise ValueError(f"unknown backend {b!r}; choose from {_backends.names()}")
    cases = list(default_cases() if cases is None else cases)
    dtypes = list(dtypes) if dtypes is not None else [torch.float32, torch.float16, torch.bfloat16]
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    rows = []
    jobs = [(c, dt) for c in cases for dt in dtypes if takes_dtype(c, dt) or (dt == FP8 and c.seqs is not None)]
    it: Iterable = jobs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(jobs, desc="verify")
    with strict_fp32(), poison_outputs():
        for idx, (case, dt) in enumerate(it):
            case_seed = seed + idx
            if not takes_dtype(case, dt):  # FP8 asked of a packed case: every backend skips it, and says why
                rows += [{"backend": b, **case.describe(), "dtype": str(dt).replace("torch.", ""), "seed": case_seed,
                          "status": "skipped", "passed": None,
                          "error": "attention_varlen takes no float8_e4m3fn inputs"} for b in backends]
                continue
            q, k, v, kw = make_inputs(case, dtype=dt, device=dev, seed=case_seed)
            ref, ref_lse = run_reference(q, k, v, kw)
            base = None
            if dt != torch.float32:
                base = run_attention(q, k, v, kw, backend="torch")
            for b in backends:
                row = {"backend": b, **case.describe(), "dtype": str(dt).replace("torch.", ""), "seed": case_seed}
                t0 = time.perf_counter()
                try:
                    why = _not_taken(b, q, k, v, kw)
                    if why is not None:  # a backend that does not take this problem: skipped, not failed
                        row.update(status="skipped", passed=None, error=why)
                        rows.append(row)
                        continue
                    out, lse = run_attention(q, k, v, kw, backend=b, return_lse=True)
                except Exception as e:  # recorded, not raised: the table shows every failure
                    row.update(status="error", passed=False, error=f"{type(e).__name__}: {e}")
                    rows.append(row)
                    continue
                rep = compare(out, ref, dtype=dt, base=base)
                lrep = compare(lse, ref_lse, dtype=torch.float32, atol=_lse_atol(dt), rtol=0.0)
                row.update(
                    max_abs=rep.max_abs, rel_l2=rep.rel_l2, base_max_abs=rep.base_max_abs,
                    abs_rel_ok=rep.abs_rel_passed, baseline_ok=rep.baseline_passed, lse_max_abs=lrep.max_abs,
                    nan=rep.nan_count, passed=bool(rep.passed and lrep.passed), error="",
                    status="ok" if rep.passed and lrep.passed else "failed",
                    seconds=time.perf_counter() - t0,
                )
                rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs["seed"] = seed
    return df


def _lse_atol(dtype: torch.dtype) -> float:
    """lse is float32 from float32 scores: its error is that of the scores, so scaled to the input dtype."""
    return {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float8_e4m3fn: 1e-2}.get(dtype, 1e-4)


def _not_taken(name: str, q, k, v, kw) -> str | None:
    """Why backend ``name`` does not take this problem (its ``unsupported`` reason), or None. ``auto`` takes
    every problem."""
    from attnlab import backends as _backends

    if name == "auto":
        return None
    return _backends.why_not(_backends.registry()[name], problem_of(q, k, v, kw))


def _packed(kw: dict) -> bool:
    return "cu_seqlens_q" in kw


def run_attention(q, k, v, kw: dict, **extra):
    """:func:`attnlab.attention` of a case's inputs (:func:`attnlab.cases.make_inputs`), or
    :func:`attnlab.attention_varlen` for a packed case; ``extra``: backend, return_lse."""
    from attnlab.api import attention
    from attnlab.varlen import attention_varlen

    if _packed(kw):
        names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
        rest = {n: x for n, x in kw.items() if n not in names}
        return attention_varlen(q, k, v, *(kw[n] for n in names), **rest, **extra)
    return attention(q, k, v, **kw, **extra)


def run_reference(q, k, v, kw: dict):
    """The float64 (out, lse) of a case's inputs: :func:`attnlab.reference` or, packed,
    :func:`attnlab.reference.reference_varlen`."""
    from attnlab.reference import reference, reference_varlen

    return reference_varlen(q, k, v, **kw) if _packed(kw) else reference(q, k, v, **kw)


def problem_of(q, k, v, kw: dict):
    """The validated Problem of a case's inputs (packed for a packed case)."""
    from attnlab.problem import make_packed_problem, make_problem

    return make_packed_problem(q, k, v, **kw) if _packed(kw) else make_problem(q, k, v, **kw)


def all_passed(df) -> bool:
    """Whether no row of a :func:`verify` table failed or raised (skipped rows, which a backend does not take,
    do not count against it)."""
    return bool((df["status"] != "failed").all() and (df["status"] != "error").all()) if len(df) else True


def summarize(df) -> str:
    """One line per backend: passed / checked, the skipped count (with the first reason), and the failing cases."""
    lines = []
    for b, g in df.groupby("backend", sort=False):
        skipped = g[g["status"] == "skipped"]
        checked = g[g["status"] != "skipped"]
        bad = checked[checked["status"] != "ok"]
        line = f"{b}: {len(checked) - len(bad)}/{len(checked)} passed"
        if len(skipped):
            line += f", {len(skipped)} skipped (not taken: {skipped['error'].iloc[0]})"
        lines.append(line)
        for _, r in bad.iterrows():
            why = r.get("error", "") or f"max_abs={r.get('max_abs', float('nan')):.3e}"
            lines.append(f"  FAIL {r['case']} [{r['dtype']}] {why}")
    return "\n".join(lines)
