"""The notebooks' figures, in one theme: masks and tiles, the online-softmax state, memory and traffic against N,
the roofline, precision sweeps, thread maps. The figures of recorded benchmarks are :mod:`attnlab.bench.plots`;
both draw with :mod:`attnlab.figure_style`.

Each function returns a matplotlib ``Figure`` (end a notebook cell with ``plt.show()`` or ``;`` so no
object address is printed). Axes carry labels with units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib as mpl
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from attnlab.figure_style import backend_colors, binary_axis, n_axis, new_figure, use_theme  # noqa: F401  (use_theme: notebooks)
from attnlab.lessons import memory
from attnlab.masks import EMPTY, FULL, PARTIAL, MaskSpec

#: Colours of the tile classes and of the allowed / masked elements.
TILE_COLORS = {EMPTY: "#f0f0f0", PARTIAL: "#f4a259", FULL: "#3d7ea6"}
MASK_CMAP = ListedColormap(["#f0f0f0", "#3d7ea6"])


# ---- masks and tiles ---------------------------------------------------------------------------------
def _as_2d(m: torch.Tensor | np.ndarray | MaskSpec, b: int = 0, h: int = 0) -> np.ndarray:
    if isinstance(m, MaskSpec):
        m = m.allowed(device="cpu")
    if isinstance(m, torch.Tensor):
        m = m.detach().cpu()
        while m.dim() > 2:
            m = m[b if m.dim() == 4 else h] if m.shape[0] > 1 else m[0]
        m = m.numpy()
    return np.asarray(m)


def mask_heatmap(mask, *, title: str | None = None, ax=None, b: int = 0, h: int = 0) -> Figure:
    """Draw one [Nq, Nk] mask: blue = allowed, grey = masked. Accepts a MaskSpec, a bool tensor of any
    rank (batch ``b`` and head ``h`` are shown) or a float bias (``-inf`` = masked, values shaded)."""
    if ax is None:
        fig, axes = new_figure(size=(4.0, 4.0))
        ax = axes[0, 0]
    else:
        fig = ax.figure
    a = _as_2d(mask, b, h)
    if a.dtype == bool:
        ax.imshow(a, cmap=MASK_CMAP, vmin=0, vmax=1, interpolation="nearest", aspect="auto")
    else:
        shown = np.ma.masked_invalid(np.where(np.isneginf(a), np.nan, a))
        cmap = mpl.colormaps["viridis"].with_extremes(bad="#f0f0f0")
        im = ax.imshow(shown, cmap=cmap, interpolation="nearest", aspect="auto")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="bias (grey: -inf)")
    nq, nk = a.shape
    ax.xaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
    ax.set_xlabel(f"key j (0..{nk - 1})")
    ax.set_ylabel(f"query i (0..{nq - 1})")
    ax.grid(False)
    if title:
        ax.set_title(title)
    return fig


def mask_grid(masks: Mapping[str, object], *, ncols: int = 3, cell: float = 3.0) -> Figure:
    """A grid of :func:`mask_heatmap` panels, one per (title, mask) item."""
    n = len(masks)
    nrows = max(1, -(-n // ncols))
    fig, axes = new_figure(nrows, ncols, size=(cell * ncols, cell * nrows + 0.3))
    for ax, (name, m) in zip(axes.flat, masks.items()):
        mask_heatmap(m, title=name, ax=ax)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.legend(handles=[Patch(color=MASK_CMAP(1), label="allowed"), Patch(color=MASK_CMAP(0), label="masked")],
               loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def tile_map(spec: MaskSpec, block_m: int, block_n: int, *, b: int = 0, h: int = 0, explicit: bool = False,
             title: str | None = None, ax=None) -> Figure:
    """The tile classifier's picture: each ``block_m x block_n`` tile coloured empty / partial / full, with
    the allowed elements drawn underneath, and the fraction of each class in the legend."""
    if ax is None:
        fig, axes = new_figure(size=(5.0, 4.6))
        ax = axes[0, 0]
    else:
        fig = ax.figure
    classes = spec.tile_classes(block_m, block_n, explicit=explicit)
    c = classes[b, min(h, classes.shape[1] - 1)].numpy()
    allowed = spec.allowed(device="cpu", explicit=explicit)
    a = allowed[b, min(h, allowed.shape[1] - 1)].numpy()
    ax.imshow(a, cmap=ListedColormap(["white", "#9bbfd6"]), vmin=0, vmax=1, interpolation="nearest",
              extent=(0, spec.Nk, spec.Nq, 0), aspect="auto")
    for ti in range(c.shape[0]):
        for tj in range(c.shape[1]):
            k = int(c[ti, tj])
            w, hgt = min(block_n, spec.Nk - tj * block_n), min(block_m, spec.Nq - ti * block_m)
            ax.add_patch(Rectangle((tj * block_n, ti * block_m), w, hgt, facecolor=TILE_COLORS[k],
                                   alpha=0.25 if k == FULL else 0.55 if k == PARTIAL else 0.8,
                                   edgecolor="#555555", linewidth=0.8))
    frac = {k: float((c == k).mean()) for k in (EMPTY, PARTIAL, FULL)}
    labels = {EMPTY: "empty (skipped)", PARTIAL: "partial (masked per element)", FULL: "full (no mask work)"}
    ax.legend(handles=[Patch(facecolor=TILE_COLORS[k], edgecolor="#555555", label=f"{labels[k]}: {frac[k]:.0%}")
                       for k in (EMPTY, PARTIAL, FULL)], loc="upper center", bbox_to_anchor=(0.5, -0.13),
              ncol=1, frameon=False)
    ax.set_xlim(0, spec.Nk)
    ax.set_ylim(spec.Nq, 0)
    ax.set_xlabel(f"key j (tiles of {block_n})")
    ax.set_ylabel(f"query i (tiles of {block_m})")
    ax.grid(False)
    ax.set_title(title or f"{spec.kind}: {block_m}x{block_n} tiles")
    fig.tight_layout()
    return fig


# ---- online softmax ----------------------------------------------------------------------------------
def online_trace(s: torch.Tensor, trace: pd.DataFrame, *, component: int = 0) -> Figure:
    """The running state of one row: scores and the running max m (left), l and out[component] (right)."""
    fig, axes = new_figure(1, 2, size=(10.0, 3.6))
    s = s.detach().double().cpu().numpy()
    x = np.arange(len(trace))
    ax = axes[0, 0]
    ax.bar(np.arange(len(s)), s, color="#9bbfd6", label="score s_j")
    ax.step(x, trace["m"], where="mid", color="#c0392b", linewidth=2, label="running max m")
    ax.set_xlabel("key j (one step per key)")
    ax.set_ylabel("score (logit units)")
    ax.set_title("scores and the running max")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(x, trace["l"], marker="o", label="l (sum of exp, relative to m)")
    ax.set_ylabel("l (dimensionless)")
    ax2 = ax.twinx()
    ax2.plot(x, trace[f"out[{component}]"], marker="s", color="#2c7a4b",
             label=f"out[{component}] = acc/l so far")
    ax2.set_ylabel(f"out[{component}] (value units)")
    ax2.grid(False)
    for j in np.flatnonzero(np.asarray(trace["alpha"]) < 1):
        ax.axvline(j, color="#c0392b", alpha=0.25, linewidth=6)
    ax.set_xlabel("key j (shaded: the max rose, old state rescaled)")
    ax.set_title("running denominator and output")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right")
    fig.tight_layout()
    return fig


# ---- memory, traffic, roofline -----------------------------------------------------------------------
def memory_vs_n(sweep: pd.DataFrame, *, hbm_bytes: float | None = -1.0, title: str = "") -> Figure:
    """Extra memory against N from :func:`attnlab.lessons.memory.sweep`: one score matrix, the textbook version's
    modelled peak and a fused kernel's, with the GPU's memory as a horizontal line (``hbm_bytes``; by default
    the memory the recorded suites saw, :func:`attnlab.lessons.memory.recorded_memory`; None: no line)."""
    if hbm_bytes is not None and hbm_bytes < 0:
        hbm_bytes = memory.recorded_memory()["hbm_gib"] * 2**30
    fig, axes = new_figure(size=(9.8, 4.2))
    ax = axes[0, 0]
    ax.plot(sweep["N"], sweep["score_bytes"], marker="o", label="one [B,H,N,N] score matrix")
    ax.plot(sweep["N"], sweep["textbook_extra"], marker="s", label="textbook peak (model: 2 scores + out)")
    ax.plot(sweep["N"], sweep["fused_extra"], marker="^", label="fused peak (model: out + lse)")
    if hbm_bytes:
        ax.axhline(hbm_bytes, color="#c0392b", linestyle="--",
                   label=f"{memory.RECORDED_GPU['name']} memory ({memory.fmt_bytes(hbm_bytes)})")
    binary_axis(ax)
    n_axis(ax, list(sweep["N"]))
    ax.set_ylabel("extra memory (bytes, log scale)")
    ax.set_title(title or "memory beyond the inputs, against N")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)  # outside: no line hidden
    fig.tight_layout()
    return fig


def traffic_vs_n(sweep: pd.DataFrame, *, tbps: float = memory.RECORDED_GPU["copy_tbps"], title: str = "") -> Figure:
    """HBM traffic of the unfused and fused pipelines against N (left) and its time at ``tbps`` next to
    the compute time at the matmul peak (right)."""
    fig, axes = new_figure(1, 2, size=(11.0, 4.0))
    ax = axes[0, 0]
    ax.plot(sweep["N"], sweep["unfused_bytes"], marker="s", label="unfused (S, P through HBM)")
    ax.plot(sweep["N"], sweep["fused_bytes"], marker="^", label="fused (Q, K, V, O only)")
    binary_axis(ax)
    n_axis(ax, list(sweep["N"]))
    ax.set_ylabel("HBM traffic (bytes, log scale)")
    ax.set_title("bytes moved per forward")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(sweep["N"], sweep["unfused_ms"], marker="s", label=f"unfused traffic at {tbps:g} TB/s")
    ax.plot(sweep["N"], sweep["fused_ms"], marker="^", label=f"fused traffic at {tbps:g} TB/s")
    ax.plot(sweep["N"], sweep["compute_ms"], marker="o", linestyle="--", color="black", label="matmul FLOPs at peak")
    ax.set_yscale("log")
    n_axis(ax, list(sweep["N"]))
    ax.set_ylabel("time (ms, log scale)")
    ax.set_title(title or "what the traffic costs")
    ax.legend()
    fig.tight_layout()
    return fig


def roofline(points: pd.DataFrame | Sequence[tuple[str, float, float | None]], *,
             peak_tflops: float = memory.RECORDED_GPU["bf16_tflops"], tbps: float = memory.RECORDED_GPU["copy_tbps"],
             extra_peaks: Mapping[str, float] | None = None, colors: Sequence[object] | None = None,
             title: str = "") -> Figure:
    """The roofline ``min(peak, I * bandwidth)`` with labelled points.

    ``points``: rows of (label, intensity FLOP/byte, measured TFLOP/s or None); a point without a measured
    value is drawn on the roof (the bound). ``extra_peaks``: further flat roofs (e.g. float32 matmul).
    """
    if isinstance(points, pd.DataFrame):
        points = list(points[["label", "intensity", "tflops"]].itertuples(index=False, name=None))
    fig, axes = new_figure(size=(9.8, 4.6))
    ax = axes[0, 0]
    ridge = memory.ridge_point(peak_tflops, tbps)
    kinks = [ridge] + [memory.ridge_point(p, tbps) for p in (extra_peaks or {}).values()]
    lo = min(kinks + [p[1] for p in points]) / 4
    hi = max([ridge] + [p[1] for p in points]) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(x, np.minimum(peak_tflops, x * tbps), color="black", linewidth=2,
            label=f"roof: {peak_tflops:g} TFLOP/s, {tbps:g} TB/s")
    ax.axvline(ridge, color="grey", linestyle=":", label=f"ridge point {ridge:.0f} FLOP/B")
    for name, p in (extra_peaks or {}).items():
        ax.plot(x, np.minimum(p, x * tbps), linestyle="--", linewidth=1.2, label=f"{name}: {p:g} TFLOP/s")
    palette = list(colors) if colors is not None else sns.color_palette("colorblind", max(3, len(points)))
    for (label, inten, meas), col in zip(points, palette):
        bound = memory.attainable_tflops(inten, peak_tflops, tbps)
        y = bound if meas is None or (isinstance(meas, float) and np.isnan(meas)) else meas
        ax.scatter([inten], [y], s=50, color=col, zorder=3, label=f"{label} ({inten:.0f} FLOP/B)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    y0, y1 = ax.get_ylim()
    ax.set_yticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000) if y0 <= t <= y1])
    ax.yaxis.set_major_formatter(mpl.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(mpl.ticker.NullFormatter())
    ax.set_ylim(y0, y1)
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte, log scale)")
    ax.set_ylabel("throughput (TFLOP/s, log scale)")
    ax.set_title(title or "roofline")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)  # outside: no roof hidden
    fig.tight_layout()
    return fig


# ---- precision ---------------------------------------------------------------------------------------
def error_vs_n(df: pd.DataFrame, *, relative: bool = False, title: str = "") -> Figure:
    """Max error against N from :func:`attnlab.lessons.precision.error_sweep`, one panel per dtype, colour = D,
    line style = method, the checker's tolerance dashed. ``relative``: the error and the tolerance divided
    by max|ref| (columns ``max_rel``, ``rel_tolerance``), the measure that does not fall just because |out|
    shrinks with N."""
    y, tol_col = ("max_rel", "rel_tolerance") if relative else ("max_abs", "tolerance")
    dtypes = list(dict.fromkeys(df["dtype"]))
    fig, axes = new_figure(1, len(dtypes), size=(4.2 * len(dtypes), 3.8), sharey=False)
    for ax, dt in zip(axes.flat, dtypes):
        d = df[df["dtype"] == dt]
        sns.lineplot(data=d, x="N", y=y, hue="D", style="method", markers=True, ax=ax,
                     palette="crest", legend=ax is axes.flat[-1])
        tol = d.groupby("N")[tol_col].min()
        ax.plot(tol.index, tol.values, color="#c0392b", linestyle="--", label="tolerance")
        ax.set_yscale("log")
        n_axis(ax, sorted(d["N"].unique()), "N (Nq = Nk, tokens)")
        ax.set_ylabel(("max |out - ref| / max |ref|" if relative else "max |out - ref|") + " (log scale)")
        ax.set_title(f"{dt}: red dashes = tolerance")
    if axes.flat[-1].get_legend() is not None:
        sns.move_legend(axes.flat[-1], "upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def exp_error(df: pd.DataFrame) -> Figure:
    """Relative error (ulps) of expf and fast exp against x, from :func:`attnlab.lessons.precision.exp_error_table`."""
    fig, axes = new_figure(size=(6.0, 3.6))
    ax = axes[0, 0]
    ax.plot(-df["x"], df["cpu_exp_ulp"], marker="o", label="float32 exp on this CPU (torch.exp)")
    ax.plot(-df["x"], df["fast_exp_emulated_ulp"], marker="s", label="fast exp, __expf (emulated)")
    ax.plot(-df["x"], 2 + 1.173 * (-df["x"]), linestyle="--", color="grey", label="bound 2 + 1.173|x| ulp")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("-x (exp argument is x = s - m <= 0, log scale)")
    ax.set_ylabel("max relative error (ulps, 2^-23)")
    ax.set_title("exp error against the argument")
    ax.legend()
    fig.tight_layout()
    return fig


# ---- kernels -----------------------------------------------------------------------------------------
def _components(owner: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(thread id, cells) of each 4-connected region of equal ids, in row-major order of first cell."""
    seen = np.zeros(owner.shape, dtype=bool)
    out = []
    rows, cols = owner.shape
    for r in range(rows):
        for c in range(cols):
            if seen[r, c]:
                continue
            t, stack, cells = owner[r, c], [(r, c)], []
            seen[r, c] = True
            while stack:
                y, x = stack.pop()
                cells.append((y, x))
                for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= yy < rows and 0 <= xx < cols and not seen[yy, xx] and owner[yy, xx] == t:
                        seen[yy, xx] = True
                        stack.append((yy, xx))
            out.append((int(t), np.array(cells)))
    return out


def thread_map(owner: np.ndarray, *, color: np.ndarray | None = None, title: str = "", xlabel: str = "",
               ylabel: str = "", ax=None, fontsize: float | None = None) -> Figure:
    """Draw which thread owns each element of a tile: ``owner`` holds thread ids. Colours follow ``color``
    (default: the thread id, cycling through 20), white lines separate owners, and each thread's id is
    written once on every rectangular region it owns (on each cell of an irregular one). ``fontsize``
    None sizes each label to fit its region (at most 11 pt), so labels stay legible: draw few cells."""
    from matplotlib.collections import LineCollection

    owner = np.asarray(owner)
    color = owner if color is None else np.asarray(color)
    if ax is None:
        fig, axes = new_figure(size=(6.0, 4.0))
        ax = axes[0, 0]
    else:
        fig = ax.figure
    ax.imshow(color % 20, cmap="tab20", vmin=0, vmax=19, interpolation="nearest", aspect="auto")
    rows, cols = owner.shape
    segs = [[(c + 0.5, r - 0.5), (c + 0.5, r + 0.5)] for r, c in np.argwhere(owner[:, 1:] != owner[:, :-1])]
    segs += [[(c - 0.5, r + 0.5), (c + 0.5, r + 0.5)] for r, c in np.argwhere(owner[1:, :] != owner[:-1, :])]
    ax.add_collection(LineCollection(segs, colors="white", linewidths=1.0))
    pos = ax.get_position()
    cell_w = 0.85 * fig.get_figwidth() * pos.width * 72 / cols  # points per cell
    cell_h = 0.85 * fig.get_figheight() * pos.height * 72 / rows

    def label(x: float, y: float, text: str, w: int, h: int) -> None:
        size = fontsize or min(11.0, w * cell_w / (0.62 * len(text) + 0.4), 0.7 * h * cell_h)
        ax.text(x, y, text, ha="center", va="center", fontsize=size, color="black")

    for t, comp in _components(owner):
        (r0, c0), (r1, c1) = comp.min(0), comp.max(0)
        if len(comp) == (r1 - r0 + 1) * (c1 - c0 + 1):  # a rectangle: one label in its middle
            label((c0 + c1) / 2, (r0 + r1) / 2, str(t), c1 - c0 + 1, r1 - r0 + 1)
        else:
            for r, c in comp:
                label(c, r, str(t), 1, 1)
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.xaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True))
    ax.grid(False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig


# ---- the float32 story (notebook 05) -----------------------------------------------------------------
def blog_vs_gpu(table: pd.DataFrame, *, gpu: str = "recorded GPU") -> Figure:
    """The blog's relative times beside the recorded ones (:func:`attnlab.lessons.fp32_story.blog_vs_gpu`): per
    implementation the blog's bar, the GPU-alone bar where the table has one, and the public call's (host
    included), log scale, each bar labelled with its ratio."""
    bars = [("blog (x rowmax)", "blog (Ampere, single run)", "#9bbfd6")]
    if "GPU alone (x rowmax)" in table:
        bars.append(("GPU alone (x rowmax)", f"{gpu}, GPU time alone (graph replay)", "#3d7ea6"))
    bars.append(("public call (x rowmax)", f"{gpu}, public call (host included)", "#c9c9c9"))
    fig, axes = new_figure(size=(8.5, 1.0 * len(table) + 0.9 * len(bars)))
    ax = axes[0, 0]
    y = np.arange(len(table))
    height = 0.8 / len(bars)
    for j, (col, name, c) in enumerate(bars):
        off = (j - (len(bars) - 1) / 2) * height
        vals = table[col].astype(float).to_numpy()
        ax.barh(y + off, vals, height=height * 0.95, color=c, label=name)
        for yy, v in zip(y + off, vals):
            if np.isfinite(v):
                ax.text(v * 1.05, yy, f"{v:.1f}x", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(table.index)
    ax.invert_yaxis()
    ax.set_xlim(0.8, float(table[[c for c, _, _ in bars]].astype(float).max().max()) * 2)
    ax.xaxis.set_major_formatter(mpl.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("time relative to the rowmax kernel (log scale; 1x = rowmax)")
    ax.set_title("B1 H8 N1024 D64 causal, float32")
    ax.legend(loc="upper center", bbox_to_anchor=(0.45, -0.18), ncol=len(bars), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def ladder_chart(lad: pd.DataFrame) -> Figure:
    """The rowmax ladder (:func:`attnlab.lessons.fp32_story.ladder`): each measured step's speedup on its
    case, coloured by whether it was kept; steps never measured are listed as such."""
    fig, axes = new_figure(size=(11.0, 4.2))
    ax = axes[0, 0]
    colors = {"yes": "#3d7ea6", "no": "#bbbbbb", "opt-in": "#f4a259"}
    y = np.arange(len(lad))
    for yy, row in zip(y, lad.itertuples(index=False)):
        label = f"{row.step}: {row.change} ({getattr(row, 'case_label', row.case)})"
        if np.isfinite(row.speedup):
            ax.barh(yy, row.speedup - 1, left=1, color=colors[row.taken], height=0.6)
            ax.text(max(row.speedup, 1) + 0.004, yy, f"{row.speedup:.3f}x  ({row.before_ms:g} -> {row.after_ms:g} ms)",
                    va="center", fontsize=8)
        else:
            ax.text(1.004, yy, "not measured", va="center", fontsize=8, color="#777777")
        ax.text(0.0, yy, label, transform=mpl.transforms.blended_transform_factory(ax.transAxes, ax.transData),
                ha="right", va="center", fontsize=8.5)
    ax.axvline(1, color="black", linewidth=1)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlim(0.97, max(1.3, float(np.nanmax(lad["speedup"])) + 0.12))
    ax.set_xlabel("speedup of the step (kernel time before / after, measured side by side)")
    ax.set_title("rowmax ladder (float32, recorded)")
    ax.legend(handles=[Patch(color=c, label={"yes": "kept", "no": "not kept", "opt-in": "opt-in switch"}[k])
                       for k, c in colors.items()], loc="lower right")
    fig.tight_layout()
    return fig


def _log_bars(ax, values: pd.Series, colors: Mapping[str, object] | None, label: str, headroom: float) -> None:
    """Horizontal bars of ``values`` (index: backends) on a log axis, sorted (largest at the top), each labelled
    with its value; ``headroom``: how far past the largest bar the axis runs."""
    t = values.dropna().sort_values()
    ax.barh(t.index, t.values, color=[(colors or {}).get(b, "#3d7ea6") for b in t.index])
    for i, v in enumerate(t.values):
        ax.text(v * 1.04, i, f"{v:.3g}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(t.min() / 1.5, t.max() * headroom)
    ax.xaxis.set_major_formatter(mpl.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel(label)


def fp32_bars(fair: pd.DataFrame, colors: Mapping[str, object] | None = None) -> Figure:
    """TFLOP/s of every float32 backend per case (:func:`attnlab.lessons.fp32_story.fair_fp32`), one
    panel per case, bars sorted by speed."""
    cases = list(fair["tflops"].columns)
    fig, axes = new_figure(1, len(cases), size=(5.2 * len(cases), 3.8))
    for ax, case in zip(axes.flat, cases):
        _log_bars(ax, fair["tflops"][case], colors, "TFLOP/s (useful FLOPs, log scale)", 2)
        ax.set_title(case.replace("fp32_", "").replace("_", " "))
    fig.suptitle("float32 IEEE (TF32 off) against float32 rivals only", fontweight="bold")
    fig.tight_layout()
    return fig


def cuda_ladder_bars(lad: pd.DataFrame, case: str, colors: Mapping[str, object] | None = None) -> Figure:
    """GPU time per call in graph replay of every rung of the CUDA ladder on one case
    (:func:`attnlab.lessons.cuda_ladder.recorded`), one panel per dtype, slowest at the top."""
    d = lad[(lad["case"] == case) & lad["graph_us"].notna()]
    dtypes = list(dict.fromkeys(d["dtype"]))
    fig, axes = new_figure(1, len(dtypes), size=(5.2 * len(dtypes), 3.6))
    for ax, dt in zip(np.atleast_1d(axes).flat, dtypes):
        ms = d[d["dtype"] == dt].set_index("backend")["graph_us"] / 1e3
        _log_bars(ax, ms, colors, "ms per call, graph replay (log scale)", 3)
        ax.set_title(dt)
    fig.suptitle(f"The CUDA ladder, {case.replace('_', ' ')}", fontweight="bold")
    fig.tight_layout()
    return fig


def route_bars(table: pd.DataFrame) -> Figure:
    """Each Hopper route's best time over cuDNN's per case (:func:`attnlab.lessons.hopper.routes`): grouped
    horizontal bars in the table's order, a line at cuDNN's speed."""
    cases = list(dict.fromkeys(table.index.get_level_values("case")))
    families = list(dict.fromkeys(table.index.get_level_values("family")))
    x = table["x cudnn"].unstack("family").reindex(index=cases, columns=families)
    fig, axes = new_figure(size=(8.5, 0.3 * len(cases) * len(families) + 2.0))
    ax = np.atleast_1d(axes).flat[0]
    height = 0.8 / len(families)
    palette = sns.color_palette("deep", len(families))
    for j, fam in enumerate(families):
        pos = np.arange(len(cases)) + (j - (len(families) - 1) / 2) * height
        ax.barh(pos, x[fam].to_numpy(), height=height, color=palette[j], label=fam)
    ax.set_yticks(np.arange(len(cases)), cases)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=1, ls="--", label="cuDNN")
    ax.set_xlim(0.5, 1.05)
    ax.set_xlabel("speed over cuDNN's in the same run (cuDNN time / route time)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.14), ncol=3, fontsize=8, frameon=False)
    ax.set_title("The forward on Hopper: routes within Triton against cuDNN (bf16)", fontweight="bold")
    fig.tight_layout()
    return fig


def backward_bars(table: pd.DataFrame, mode: str = "bwd") -> Figure | None:
    """The backward suite's TFLOP/s of one ``mode`` (:func:`attnlab.lessons.perf.backward_table`), per shape:
    grouped horizontal bars, one colour per backend; shapes or backends with nothing timed are left out."""
    if mode not in table:
        return None
    x = pd.to_numeric(table[mode], errors="coerce").unstack("backend").dropna(how="all").dropna(axis=1, how="all")
    if x.empty:
        return None
    shapes, backends = list(x.index), list(x.columns)
    fig, axes = new_figure(size=(8.5, 0.22 * len(shapes) * len(backends) + 2.0))
    ax = np.atleast_1d(axes).flat[0]
    height = 0.8 / len(backends)
    colors = backend_colors(backends)
    for j, b in enumerate(backends):
        pos = np.arange(len(shapes)) + (j - (len(backends) - 1) / 2) * height
        ax.barh(pos, x[b].to_numpy(), height=height, color=colors[b], label=b)
    ax.set_yticks(np.arange(len(shapes)), shapes)
    ax.invert_yaxis()
    ax.set_xlabel(f"TFLOP/s ({mode}; the backward counts 2.5x the forward's FLOPs)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.1), ncol=len(backends), fontsize=8, frameon=False)
    ax.set_title(f"The backward suite, {mode}, through the public call", fontweight="bold")
    fig.tight_layout()
    return fig
