"""The backward of attention, for notebook 09: the gradient formulas written out in float64 next to torch
autograd, a gradient check of ``attnlab.attention`` against float64 autograd of ``attnlab.reference``, what
masks do to the gradients, and the figures of the recorded ``backward`` suite.

The formulas, for one head with ``S = scale * Q K^T`` (masked entries -inf), ``P = softmax(S)`` row-wise and
``O = P V``, given the upstream gradient ``dO``::

    dV = P^T dO
    dP = dO V^T
    Delta_i = sum_j P_ij dP_ij = dO_i . O_i
    dS = P * (dP - Delta)           (elementwise; Delta broadcast over the keys)
    dQ = scale * dS K,   dK = scale * dS^T Q

A fused backward recomputes ``P_ij = exp(S_ij - lse_i)`` tile by tile from the saved log-sum-exp, so it never
needs a row's maximum or sum again, and gets ``Delta`` from ``dO`` and ``O`` (D numbers per row) instead of a
reduction over the keys.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
import seaborn as sns
import torch
from matplotlib.ticker import MaxNLocator

import attnlab
from attnlab.figure_style import backend_colors, binary_axis, n_axis, new_figure
from attnlab.lessons import memory
from attnlab.problem import make_problem


def manual_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    allowed: torch.Tensor | None = None, scale: float | None = None) -> dict[str, torch.Tensor]:
    """The forward and the backward of one attention call written out with the formulas above.

    q [.., Nq, D], k, v [.., Nk, D], dout like the output; ``allowed`` a bool [.., Nq, Nk] (True = attend).
    Rows with no allowed key get P = 0 (and so zero gradients). Returns the intermediates by name: s, p, lse,
    out, dp, delta (from rowsum(dO * O)), delta_p (from rowsum(P * dP)), p_from_lse, ds, dq, dk, dv.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0.0)), 0.0)
    out = p @ v
    dp = dout @ v.transpose(-1, -2)
    delta = (dout * out).sum(-1)
    delta_p = (p * dp).sum(-1)
    ds = p * (dp - delta[..., None])
    return {
        "s": s, "p": p, "lse": lse, "out": out, "dp": dp, "delta": delta, "delta_p": delta_p,
        "p_from_lse": torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0.0)), 0.0),
        "ds": ds, "dq": scale * ds @ k, "dk": scale * ds.transpose(-1, -2) @ q, "dv": p.transpose(-1, -2) @ dout,
    }


def autograd_grads(fn, tensors: Iterable[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``(fn(*leaves) * dout).sum()`` with respect to fresh leaf copies of ``tensors``.

    ``fn`` returns the output, or a tuple whose first element is the output (as ``attnlab.reference`` does).
    """
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    (out * dout.to(out.dtype)).sum().backward()
    return [t.grad for t in leaves]


def grad_check(backends: Iterable[str], *, B: int = 2, Hq: int = 4, Hkv: int = 2, Nq: int = 24, Nk: int = 40,
               D: int = 16, seed: int = 0, bound: float = 2e-5, **kw) -> pd.DataFrame:
    """dq, dk, dv of ``attnlab.attention`` in float32 on each backend against float64 autograd of
    ``attnlab.reference``, on one seeded problem with the masks ``kw``. One row per (backend, gradient):
    the largest absolute error and whether it is within ``bound``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)
    want = autograd_grads(lambda *t: attnlab.reference(*t, **kw), (q, k, v), dout)
    rows = []
    for be in backends:
        got = autograd_grads(lambda *t, be=be: attnlab.attention(*t, backend=be, **kw),
                             (q.float(), k.float(), v.float()), dout)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            err = (a.double() - b).abs().max().item()
            rows.append({"backend": be, "grad": name, "max_abs_err": err, "finite": bool(torch.isfinite(a).all()),
                         "passed": bool(torch.isfinite(a).all()) and err <= bound})
    df = pd.DataFrame(rows)
    df.attrs["bound"] = bound
    return df


def naive_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The textbook masked attention (``masked_fill(-inf)``, ``softmax``, ``@ v``): NaN in rows with no key."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def mask_gradients(seed: int = 0, backend: str = "torch") -> dict:
    """Gradients of a masked call: B2 H2 N12 D8, causal (top-left) with kv_len [12, 7] and q_len [12, 9], plus
    a bool mask that empties one more row. Returns the inputs, the allowed pattern, attnlab's gradients
    (``backend``) and those of :func:`naive_masked` on the same pattern."""
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = 2, 2, 12, 8
    q, k, v, dout = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    mask = torch.ones(B, H, N, N, dtype=torch.bool)
    mask[0, 0, 3] = False  # row 3 of head 0 of batch 0 may see no key
    kw = dict(causal=True, kv_len=[12, 7], q_len=[12, 9], mask=mask)
    allowed = make_problem(q, k, v, **kw).spec.allowed().expand(B, H, N, N)  # the contract's pattern
    dq, dk, dv = autograd_grads(lambda *t: attnlab.attention(*t, backend=backend, **kw), (q, k, v), dout)
    nq, nk, nv = autograd_grads(lambda *t: naive_masked(*t, allowed), (q, k, v), dout)
    return {"allowed": allowed, "dq": dq, "dk": dk, "dv": dv, "naive_dq": nq, "naive_dk": nk, "naive_dv": nv,
            "kv_len": kw["kv_len"], "q_len": kw["q_len"]}


def mask_gradient_summary(r: dict) -> pd.DataFrame:
    """What the gradients of :func:`mask_gradients` look like where the mask forbids: one row per check, for
    attnlab and for the textbook version."""
    allowed = r["allowed"]
    empty_rows = ~allowed.any(-1)  # [B, H, Nq]
    unseen_keys = ~allowed.any(-2)  # [B, H, Nk]: keys no row may see
    rows = []
    for who, dq, dk, dv in (("attnlab", r["dq"], r["dk"], r["dv"]),
                            ("textbook masked_fill", r["naive_dq"], r["naive_dk"], r["naive_dv"])):
        rows.append({
            "version": who,
            "empty rows": int(empty_rows.sum()),
            "dq of empty rows all zero": bool((dq[empty_rows] == 0).all()),
            "dk, dv of unseen keys all zero": bool((dk[unseen_keys] == 0).all() and (dv[unseen_keys] == 0).all()),
            "NaN in dq, dk, dv": bool(any(torch.isnan(t).any() for t in (dq, dk, dv))),
        })
    return pd.DataFrame(rows).set_index("version")


def plot_mask_gradients(r: dict, b: int = 0, h: int = 0):
    """The allowed pattern of one (batch, head) beside |dq| per row and |dk| per key (attnlab's)."""
    fig, axes = new_figure(1, 3, size=(12.0, 3.6))
    a = r["allowed"][b, h].numpy()
    axes[0, 0].imshow(a, cmap="Blues", vmin=0, vmax=1.3)
    axes[0, 0].set(title=f"allowed (batch {b}, head {h})", xlabel="key j", ylabel="query i")
    axes[0, 0].grid(False)
    dq = r["dq"][b, h].norm(dim=-1).numpy()
    dk = r["dk"][b, h].norm(dim=-1).numpy()
    axes[0, 1].bar(range(len(dq)), dq, color="#3d7ea6")
    axes[0, 1].set(title="|dq| per query row", xlabel="query i")
    axes[0, 2].bar(range(len(dk)), dk, color="#f4a259")
    axes[0, 2].set(title="|dk| per key", xlabel="key j")
    for ax in axes[0]:  # rows and keys are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


# ---- memory ------------------------------------------------------------------------------------------------
def saved_bytes(B: int, H: int, N: int, D: int, dtype: object = "bfloat16", *, fused: bool) -> int:
    """Bytes the forward keeps for the backward, beyond q, k, v and the output (which both keep):
    the textbook autograd graph keeps P, [B, H, N, N] in ``dtype`` (the softmax's output, which its own
    backward and that of ``P @ V`` both read); a fused kernel keeps the float32 lse, [B, H, N]."""
    return B * H * N * 4 if fused else memory.score_bytes(B, H, N, N, dtype)


def memory_table(Ns: Iterable[int], *, B: int = 1, H: int = 16, D: int = 128,
                 dtype: object = "bfloat16") -> pd.DataFrame:
    """One row per N: bytes saved for the backward by the textbook and the fused version, and q, k, v, o."""
    rows = []
    for n in Ns:
        ops = sum(memory.qkvo_bytes(B, H, n, n, D, dtype).values())
        rows.append({"N": n, "textbook_saved": saved_bytes(B, H, n, D, dtype, fused=False),
                     "fused_saved": saved_bytes(B, H, n, D, dtype, fused=True), "qkvo": ops})
    df = pd.DataFrame(rows)
    df["ratio"] = df["textbook_saved"] / df["fused_saved"]
    return df


def plot_memory(df: pd.DataFrame, *, hbm_bytes: float | None = -1.0, title: str = ""):
    """Saved-for-backward bytes against N: textbook P, fused lse, and q, k, v, o for scale; the GPU's memory as a
    line (by default the memory the recorded suites saw, :func:`attnlab.lessons.memory.recorded_memory`)."""
    if hbm_bytes is not None and hbm_bytes < 0:
        hbm_bytes = memory.recorded_memory()["hbm_gib"] * 2**30
    fig, axes = new_figure(size=(7.5, 4.2))
    ax = axes[0, 0]
    ax.plot(df["N"], df["textbook_saved"], marker="o", label="textbook: P [B, H, N, N]")
    ax.plot(df["N"], df["fused_saved"], marker="o", label="fused: lse [B, H, N] float32")
    ax.plot(df["N"], df["qkvo"], marker="o", linestyle="--", color="grey", label="q, k, v, o (both keep them)")
    if hbm_bytes:
        gpu = memory.RECORDED_GPU["name"]
        ax.axhline(hbm_bytes, color="#c0392b", linestyle=":", label=f"{gpu} HBM ({memory.fmt_bytes(hbm_bytes)})")
    n_axis(ax, list(df["N"]))
    binary_axis(ax)
    ax.set_ylabel("bytes saved for the backward")
    ax.set_title(title or "what the forward keeps for the backward")
    ax.legend(fontsize=8, loc="lower right", frameon=True)  # the upper left holds the HBM line
    fig.tight_layout()
    return fig


# ---- the recorded backward suite -------------------------------------------------------------------------
def backward_summary(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """Median TFLOP/s of the passed rows of a ``backward`` suite: one row per (mode, case), one column per
    backend. ``mode`` (e.g. "fwd+bwd", "bwd") is taken from a ``mode`` column when there is one, else from
    the case name, else "all"."""
    if df is None or len(df) == 0:
        return None
    d = df[df["status"].eq("ok")] if "status" in df else df
    d = d[pd.to_numeric(d["tflops"], errors="coerce").notna()].copy()
    if d.empty:
        return None
    d["mode"] = d["mode"] if "mode" in d else ["bwd" if "bwd" in str(c) and "fwd" not in str(c) else
                                               "fwd+bwd" if "fwd" in str(c) else "all" for c in d["case"]]
    return d.pivot_table(index=["mode", "case"], columns="backend", values="tflops", aggfunc="median")


def plot_backward(table: pd.DataFrame, *, title: str = ""):
    """Grouped bars of :func:`backward_summary`: TFLOP/s per backend per configuration, one panel per mode."""
    modes = list(dict.fromkeys(table.index.get_level_values("mode")))
    fig, axes = new_figure(len(modes), 1, size=(10.0, 3.6 * len(modes)))
    colors = backend_colors(table.columns)
    for ax, mode in zip(axes[:, 0], modes):
        t = table.xs(mode, level="mode").reset_index().melt(id_vars="case", var_name="backend", value_name="tflops")
        sns.barplot(data=t.dropna(), x="case", y="tflops", hue="backend", palette=colors, ax=ax)
        ax.set(title=f"{title or 'backward suite'}: {mode}", xlabel="", ylabel="TFLOP/s")
        ax.tick_params(axis="x", rotation=20)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig

