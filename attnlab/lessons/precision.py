"""Precision experiments for notebook 07: TF32, fast exp, where the softmax scale is applied, and how the
error of each dtype grows with D and N.

GPU arithmetic is emulated on the CPU, bit for bit where that is cheap and by a documented bound where it
is not:

* **TF32** (tensor-core float32 matmuls): inputs rounded to 10 mantissa bits (round to nearest even),
  products accumulated in float32 (:func:`round_to_tf32`, :func:`tf32_matmul`);
* **fast exp** (CUDA's ``__expf``, what ``--use_fast_math`` turns ``expf`` into): ``ex2.approx`` of
  ``x * log2(e)`` rounded to float32. The argument rounding is exact here; ``ex2.approx``'s own error
  (about 2 ulp) is modelled by dropping two mantissa bits (:func:`fast_exp`);
* **a fused kernel** in a half type: scores and softmax in float32 from half inputs, P rounded to the input
  dtype before ``P @ V`` (as FlashAttention does), float32 accumulation, output rounded
  (:func:`fused_emulation`).

Every experiment draws its inputs from a seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import pandas as pd
import torch

from attnlab import check
from attnlab.reference import reference

LOG2E = 1.0 / math.log(2.0)


# ---- rounding helpers --------------------------------------------------------------------------------
def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round float32 ``x`` to ``bits`` explicit mantissa bits (round to nearest, ties to even).

    ``bits = 23`` is the identity, 10 is TF32, 7 is bfloat16's mantissa (with float32's exponent range).
    Infinities and NaN pass through.
    """
    if not 0 <= bits <= 23:
        raise ValueError(f"bits must be in [0, 23]; got {bits}")
    x = x.to(torch.float32).contiguous()
    if bits == 23:
        return x.clone()
    drop = 23 - bits
    i = x.view(torch.int32).to(torch.int64)
    half = 1 << (drop - 1)
    lsb = (i >> drop) & 1
    r = ((i + half - 1 + lsb) >> drop) << drop
    r = ((r + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), r, x)


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a TF32 tensor-core input sees it: 10 mantissa bits, float32 exponent."""
    return round_mantissa(x, 10)


def tf32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Emulated TF32 matmul: inputs rounded to TF32, products exact, sums in float32."""
    return (round_to_tf32(a).double() @ round_to_tf32(b).double()).float()


def ieee_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 matmul with IEEE float32 inputs (what ``strict_fp32`` guarantees on a GPU)."""
    return a.float() @ b.float()


def fast_exp(x: torch.Tensor) -> torch.Tensor:
    """Emulated CUDA ``__expf(x)``: ``ex2.approx(fp32(x * log2e))``.

    The product is rounded to float32 (this part is exact), so the error grows with ``|x|``: an absolute
    error of half an ulp in ``t = x log2 e`` is a relative error of about ``|x| * 2^-24`` in ``2^t``. The
    approximate ``ex2`` itself is modelled by rounding its result to 21 mantissa bits (about 2 ulp).
    """
    t = x.float() * torch.tensor(LOG2E, dtype=torch.float32)
    return round_mantissa(torch.exp2(t.double()).float(), 21)


def exp_inputs(xs: Iterable[float] = (-0.5, -2, -8, -16, -32, -64, -85)) -> list[tuple[float, torch.Tensor]]:
    """Per magnitude ``x0``: 4096 float32 values within 1% above it (seeded), the inputs of every exp table."""
    g = torch.Generator().manual_seed(0)
    out = []
    for x0 in xs:
        x = torch.tensor(x0, dtype=torch.float64) * (1 + 0.01 * torch.rand(4096, generator=g, dtype=torch.float64))
        out.append((x0, x.float()))
    return out


def ulp_error(y, exact: torch.Tensor) -> float:
    """The max relative error of ``y`` (a tensor or array) against float64 ``exact``, in float32 ulps (2^-23)."""
    return float(((torch.as_tensor(y).double() - exact).abs() / exact).max()) / 2**-23


def exp_error_table(xs: Iterable[float] = (-0.5, -2, -8, -16, -32, -64, -85)) -> pd.DataFrame:
    """Max relative error against float64, in ulps (units of 2^-23, the spacing of float32 numbers in [1, 2)),
    of float32 ``torch.exp`` on this CPU (``cpu_exp_ulp``: not CUDA's ``expf``, which this cannot run) and of
    ``__expf`` emulated in PyTorch (``fast_exp_emulated_ulp``, :func:`fast_exp`)."""
    rows = []
    for x0, x in exp_inputs(xs):
        exact = torch.exp(x.double())
        rel = lambda y, e=exact: ulp_error(y, e)
        rows.append({"x": x0, "cpu_exp_ulp": rel(torch.exp(x)), "fast_exp_emulated_ulp": rel(fast_exp(x)),
                     "exp(x)": float(math.exp(x0))})
    return pd.DataFrame(rows)


# ---- a configurable float32 attention, for the experiments -------------------------------------------
def attention_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = ieee_matmul,
    exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp,
    causal: bool = False,
) -> torch.Tensor:
    """Dense (optionally causal, top-left) attention in float32 with a chosen matmul and exp.

    q, k, v are [..., N, D]. ``matmul`` computes both QK^T and PV; ``exp`` the softmax numerator.
    """
    q, k, v = q.float(), k.float(), v.float()
    s = matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = exp(s - s.amax(-1, keepdim=True))
    return matmul(p / p.sum(-1, keepdim=True), v)


def attention_inputs(B: int, H: int, N: int, D: int, seed: int, dtype: torch.dtype = torch.float32,
                     Nk: int | None = None):
    """Seeded q [B, H, N, D] and k, v [B, H, Nk, D] on the CPU."""
    g = torch.Generator().manual_seed(seed)
    Nk = N if Nk is None else Nk
    q = torch.randn(B, H, N, D, generator=g).to(dtype)
    k = torch.randn(B, H, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, H, Nk, D, generator=g).to(dtype)
    return q, k, v


def tf32_effect(B: int = 1, H: int = 4, N: int = 256, D: int = 64, *, seed: int = 0) -> pd.DataFrame:
    """float32 attention with IEEE matmuls vs emulated TF32 matmuls, judged by the float32 tolerance."""
    q, k, v = attention_inputs(B, H, N, D, seed)
    ref, _ = reference(q, k, v, causal=True)
    rows = []
    for name, mm in (("IEEE float32 (strict_fp32)", ieee_matmul), ("TF32 tensor cores (emulated)", tf32_matmul)):
        rep = check.compare(attention_fp32(q, k, v, matmul=mm, causal=True), ref)
        rows.append({"matmul": name, "max_abs": rep.max_abs, "rel_l2": rep.rel_l2,
                     "tolerance": f"{rep.atol:g} + {rep.rtol:g}|ref|", "passed": rep.passed})
    return pd.DataFrame(rows)


def tf32_settings() -> dict[str, str]:
    """The float32 matmul settings that decide TF32 on CUDA, as strings (works on CPU-only torch too)."""
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(m, "fp32_precision"):
        return {"cuda.matmul.fp32_precision": str(m.fp32_precision),
                "cudnn.fp32_precision": str(getattr(c, "fp32_precision", "n/a")),
                "tf32_enabled": str(check.tf32_enabled())}
    return {"cuda.matmul.allow_tf32": str(m.allow_tf32), "cudnn.allow_tf32": str(c.allow_tf32),
            "tf32_enabled": str(check.tf32_enabled())}


def fast_exp_effect(B: int = 1, H: int = 4, N: int = 256, D: int = 64, *, spread: float = 1.0,
                    seed: int = 0) -> pd.DataFrame:
    """float32 attention with ``expf`` vs the emulated ``__expf``; ``spread`` scales q (sharper softmax)."""
    q, k, v = attention_inputs(B, H, N, D, seed)
    q = q * spread
    ref, _ = reference(q, k, v, causal=True)
    rows = []
    for name, ex in (("expf (accurate)", torch.exp), ("__expf (fast, emulated)", fast_exp)):
        rep = check.compare(attention_fp32(q, k, v, exp=ex, causal=True), ref)
        rows.append({"exp": name, "spread": spread, "max_abs": rep.max_abs, "rel_l2": rep.rel_l2,
                     "passed": rep.passed})
    return pd.DataFrame(rows)


# ---- a fused kernel in a half type -------------------------------------------------------------------
def fused_emulation(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale_at: str = "scores", round_p: bool = True,
    causal: bool = False,
) -> torch.Tensor:
    """What a FlashAttention-style kernel computes from half-precision q, k, v (dense or causal).

    Scores in float32 from the half inputs, softmax in float32, P rounded to the input dtype before
    ``P @ V`` (``round_p``), float32 accumulation, output rounded to the input dtype. ``scale_at`` says
    where ``1/sqrt(D)`` is applied:

    * ``"scores"``: to the float32 scores (exact up to one float32 rounding);
    * ``"q"`` / ``"k"``: to q (or k) in the input dtype before the matmul, as some kernels do to save a
      multiply per score; the product ``q * scale`` is rounded to the half type;
    * ``"exp2"``: folded with log2(e) into one float32 constant and applied inside ``exp2``.
    """
    dt = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    if scale_at == "q":
        q = (q.float() * scale).to(dt)
    elif scale_at == "k":
        k = (k.float() * scale).to(dt)
    elif scale_at not in ("scores", "exp2"):
        raise ValueError(f"scale_at must be 'scores', 'q', 'k' or 'exp2'; got {scale_at!r}")
    s = q.float() @ k.float().transpose(-1, -2)  # half products are exact in float32
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if scale_at == "scores":
        s = s * scale
    if scale_at == "exp2":
        c = torch.tensor(scale * LOG2E, dtype=torch.float32)
        mx = s.amax(-1, keepdim=True)
        p = torch.exp2(s * c - mx * c)
    else:
        p = torch.exp(s - s.amax(-1, keepdim=True))
    l = p.sum(-1, keepdim=True)
    pv = (p.to(dt).float() if round_p else p) @ v.float()
    return (pv / l).to(dt)


def scale_rounding(D: int, dtype: torch.dtype, *, n: int = 100_000, seed: int = 0) -> float:
    """Fraction of N(0, 1) values x in ``dtype`` for which ``round(x * scale)`` differs from ``x * scale``.

    0 when ``1/sqrt(D)`` is a power of two (D = 4, 16, 64, 256): the scale then only moves the exponent.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype).double()
    exact = x * (1.0 / math.sqrt(D))
    return float((exact.to(dtype).double() != exact).double().mean())


def scale_placement(Ds: Iterable[int] = (64, 128), dtypes: Iterable[torch.dtype] = (torch.float16, torch.bfloat16),
                    *, B: int = 1, H: int = 4, N: int = 256, seed: int = 0) -> pd.DataFrame:
    """Output error of :func:`fused_emulation` for each place the scale can be applied, per D and dtype."""
    rows = []
    for dt in dtypes:
        for D in Ds:
            q, k, v = attention_inputs(B, H, N, D, seed, dt)
            ref, _ = reference(q, k, v)
            row = {"dtype": str(dt).replace("torch.", ""), "D": D, "scale": f"1/sqrt({D})",
                   "q*scale rounded": f"{100 * scale_rounding(D, dt):.0f}%"}
            for where in ("scores", "exp2", "q", "k"):
                out = fused_emulation(q, k, v, scale_at=where)
                row[f"err_{where}"] = float((out.double() - ref).abs().max())
            rows.append(row)
    return pd.DataFrame(rows)


# ---- error against N and D per dtype -----------------------------------------------------------------
def error_sweep(Ns: Iterable[int] = (64, 256, 1024), Ds: Iterable[int] = (32, 64, 128),
                dtypes: Iterable[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16), *,
                B: int = 1, H: int = 2, causal: bool = False, seed: int = 0) -> pd.DataFrame:
    """Max abs error against the float64 reference for the textbook backend and the fused emulation.

    One row per (dtype, N, D, method), with the checker's tolerance ``atol + rtol * max|ref|`` beside it,
    and both relative to ``max|ref|`` (``ref_max``, ``max_rel``, ``rel_tolerance``): |out| shrinks as N
    grows (the output averages more V rows), so the absolute error falls with it and only the relative
    error says whether the arithmetic got worse. float32 runs the textbook backend only (a float32 fused
    kernel keeps P in float32).
    """
    from attnlab.api import attention

    rows = []
    for dt in dtypes:
        atol, rtol = check.TOLERANCES[dt]
        for N in Ns:
            for D in Ds:
                q, k, v = attention_inputs(B, H, N, D, seed + N + D, dt)
                ref, _ = reference(q, k, v, causal=causal)
                ref_max = float(ref.abs().max())
                outs = {"textbook torch": attention(q, k, v, causal=causal, backend="torch")}
                if dt != torch.float32:
                    outs["fused (P rounded)"] = fused_emulation(q, k, v, causal=causal)
                for method, out in outs.items():
                    rows.append({"dtype": str(dt).replace("torch.", ""), "N": N, "D": D, "method": method,
                                 "max_abs": float((out.double() - ref).abs().max()),
                                 "tolerance": atol + rtol * ref_max, "ref_max": ref_max})
    df = pd.DataFrame(rows)
    if len(df):
        df["max_rel"] = df["max_abs"] / df["ref_max"]
        df["rel_tolerance"] = df["tolerance"] / df["ref_max"]
    return df
