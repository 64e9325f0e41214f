"""Every figure attnlab draws, in one theme: masks and tiles, the online-softmax state, memory and traffic
against N, the roofline, precision sweeps, and the performance figures built on recorded benchmarks.

Each function returns a matplotlib ``Figure`` (end a notebook cell with ``plt.show()`` or ``;`` so no
object address is printed). Axes carry labels with units. Functions that read benchmark data take the
DataFrame from :func:`load_bench` (the schema of ``data/bench/<gpu>/<suite>.csv``, see ``attnlab.bench``)
and, when there is none, print a clear message and return ``None`` instead of failing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from attnlab import memory
from attnlab.masks import EMPTY, FULL, PARTIAL, MaskSpec

#: Colours of the tile classes and of the allowed / masked elements.
TILE_COLORS = {EMPTY: "#f0f0f0", PARTIAL: "#f4a259", FULL: "#3d7ea6"}
MASK_CMAP = ListedColormap(["#f0f0f0", "#3d7ea6"])

#: One colour per backend, the same in every benchmark figure (unknown names get further colours).
BACKEND_COLORS = {
    "triton": "tab:blue", "cuda-rowmax": "tab:orange", "cuda-tiled": "tab:olive", "cuda-naive": "tab:brown",
    "torch": "tab:gray", "sdpa": "tab:cyan", "sdpa-flash": "tab:green", "sdpa-cudnn": "tab:red",
    "sdpa-efficient": "tab:purple", "sdpa-math": "tab:pink", "flex": "black",
}


def backend_colors(names: Iterable[str]) -> dict[str, object]:
    """name -> colour: :data:`BACKEND_COLORS` for known backends, distinct extra colours for the rest."""
    names = list(dict.fromkeys(names))
    extra = iter(sns.color_palette("husl", max(1, sum(n not in BACKEND_COLORS for n in names))))
    return {n: BACKEND_COLORS[n] if n in BACKEND_COLORS else next(extra) for n in names}


#: Where recorded benchmarks live: $ATTNLAB_BENCH_DIR, else a checkout's data/bench (a wheel has none).
DATA_ROOT = Path(os.environ.get("ATTNLAB_BENCH_DIR") or Path(__file__).resolve().parent.parent / "data" / "bench")

#: Columns every benchmark CSV has (a subset of ``attnlab.bench.COLUMNS``: what the figures read).
BENCH_COLUMNS = (
    "backend", "suite", "case", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "mask", "ms", "tflops",
    "gbps", "peak_extra_mib", "max_abs_err", "passed",
)


def use_theme() -> None:
    """The one attnlab theme: seaborn whitegrid, colour-blind palette, compact figures."""
    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")
    mpl.rcParams.update({
        "figure.figsize": (7.0, 4.0), "figure.dpi": 90, "axes.titleweight": "bold", "axes.titlesize": 11,
        "axes.labelsize": 10, "legend.fontsize": 9, "legend.title_fontsize": 9, "figure.autolayout": False,
    })


def _fig(nrows: int = 1, ncols: int = 1, size: tuple[float, float] | None = None, **kw):
    use_theme()
    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False, **kw)
    return fig, axes


def _binary_axis(ax, unit: str = "bytes") -> None:
    """Log y axis with ticks at powers of two (every 2nd or 4th one when the range is wide), in binary units.

    Call after the data is drawn: the ticks are chosen from the current limits.
    """
    ax.set_yscale("log", base=2)
    lo, hi = ax.get_ylim()
    e0, e1 = int(np.floor(np.log2(max(lo, 1.0)))), int(np.ceil(np.log2(max(hi, 2.0))))
    step = next(s for s in (1, 2, 4, 8) if (e1 - e0) / s <= 8)
    ticks = [2.0**e for e in range(e0 - e0 % step, e1 + 1, step) if lo <= 2.0**e <= hi]
    ax.set_yticks(ticks)
    ax.set_yticklabels([memory.fmt_bytes(t).replace(".0 ", " ") for t in ticks])
    ax.yaxis.set_minor_locator(mpl.ticker.NullLocator())
    ax.set_ylim(lo, hi)


def _n_axis(ax, values: Sequence[int], label: str = "sequence length N (tokens)") -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values))
    ax.set_xticklabels([f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
    ax.xaxis.set_minor_locator(mpl.ticker.NullLocator())
    ax.set_xlabel(label)


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
        fig, axes = _fig(size=(4.0, 4.0))
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
    fig, axes = _fig(nrows, ncols, size=(cell * ncols, cell * nrows + 0.3))
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
        fig, axes = _fig(size=(5.0, 4.6))
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
    fig, axes = _fig(1, 2, size=(10.0, 3.6))
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
    ax2.plot(x, [o[component] for o in trace["out"]], marker="s", color="#2c7a4b",
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
def memory_vs_n(sweep: pd.DataFrame, *, hbm_bytes: float | None = memory.H200["hbm_gib"] * 2**30,
                title: str = "") -> Figure:
    """Extra memory against N from :func:`attnlab.memory.sweep`: one score matrix, the textbook version's
    modelled peak and a fused kernel's, with the GPU's memory as a horizontal line."""
    fig, axes = _fig(size=(7.0, 4.2))
    ax = axes[0, 0]
    ax.plot(sweep["N"], sweep["score_bytes"], marker="o", label="one [B,H,N,N] score matrix")
    ax.plot(sweep["N"], sweep["textbook_extra"], marker="s", label="textbook peak (model: 2 scores + out)")
    ax.plot(sweep["N"], sweep["fused_extra"], marker="^", label="fused peak (model: out + lse)")
    if hbm_bytes:
        ax.axhline(hbm_bytes, color="#c0392b", linestyle="--",
                   label=f"H200 memory (141 GB = {memory.fmt_bytes(hbm_bytes)})")
    _binary_axis(ax)
    _n_axis(ax, list(sweep["N"]))
    ax.set_ylabel("extra memory (bytes, log scale)")
    ax.set_title(title or "memory beyond the inputs, against N")
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


def traffic_vs_n(sweep: pd.DataFrame, *, tbps: float = memory.H200["copy_tbps"], title: str = "") -> Figure:
    """HBM traffic of the unfused and fused pipelines against N (left) and its time at ``tbps`` next to
    the compute time at the matmul peak (right)."""
    fig, axes = _fig(1, 2, size=(11.0, 4.0))
    ax = axes[0, 0]
    ax.plot(sweep["N"], sweep["unfused_bytes"], marker="s", label="unfused (S, P through HBM)")
    ax.plot(sweep["N"], sweep["fused_bytes"], marker="^", label="fused (Q, K, V, O only)")
    _binary_axis(ax)
    _n_axis(ax, list(sweep["N"]))
    ax.set_ylabel("HBM traffic (bytes, log scale)")
    ax.set_title("bytes moved per forward")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(sweep["N"], sweep["unfused_ms"], marker="s", label=f"unfused traffic at {tbps:g} TB/s")
    ax.plot(sweep["N"], sweep["fused_ms"], marker="^", label=f"fused traffic at {tbps:g} TB/s")
    ax.plot(sweep["N"], sweep["compute_ms"], marker="o", linestyle="--", color="black", label="matmul FLOPs at peak")
    ax.set_yscale("log")
    _n_axis(ax, list(sweep["N"]))
    ax.set_ylabel("time (ms, log scale)")
    ax.set_title(title or "what the traffic costs")
    ax.legend()
    fig.tight_layout()
    return fig


def roofline(points: pd.DataFrame | Sequence[tuple[str, float, float | None]], *,
             peak_tflops: float = memory.H200["bf16_tflops"], tbps: float = memory.H200["copy_tbps"],
             extra_peaks: Mapping[str, float] | None = None, colors: Sequence[object] | None = None,
             title: str = "") -> Figure:
    """The roofline ``min(peak, I * bandwidth)`` with labelled points.

    ``points``: rows of (label, intensity FLOP/byte, measured TFLOP/s or None); a point without a measured
    value is drawn on the roof (the bound). ``extra_peaks``: further flat roofs (e.g. float32 matmul).
    """
    if isinstance(points, pd.DataFrame):
        points = list(points[["label", "intensity", "tflops"]].itertuples(index=False, name=None))
    fig, axes = _fig(size=(9.5, 4.6) if len(points) > 5 else (7.0, 4.6))
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
    if len(points) > 5:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    else:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


# ---- precision ---------------------------------------------------------------------------------------
def error_vs_n(df: pd.DataFrame, *, title: str = "") -> Figure:
    """Max abs error against N from :func:`attnlab.precision.error_sweep`, one panel per dtype, colour = D,
    line style = method, the checker's tolerance dashed."""
    dtypes = list(dict.fromkeys(df["dtype"]))
    fig, axes = _fig(1, len(dtypes), size=(4.2 * len(dtypes), 3.8), sharey=False)
    for ax, dt in zip(axes.flat, dtypes):
        d = df[df["dtype"] == dt]
        sns.lineplot(data=d, x="N", y="max_abs", hue="D", style="method", markers=True, ax=ax,
                     palette="crest", legend=ax is axes.flat[-1])
        tol = d.groupby("N")["tolerance"].min()
        ax.plot(tol.index, tol.values, color="#c0392b", linestyle="--", label="tolerance")
        ax.set_yscale("log")
        _n_axis(ax, sorted(d["N"].unique()), "N (Nq = Nk, tokens)")
        ax.set_ylabel("max |out - ref| (log scale)")
        ax.set_title(f"{dt}: red dashes = tolerance")
    if axes.flat[-1].get_legend() is not None:
        sns.move_legend(axes.flat[-1], "upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def exp_error(df: pd.DataFrame) -> Figure:
    """Relative error (ulps) of expf and fast exp against x, from :func:`attnlab.precision.exp_error_table`."""
    fig, axes = _fig(size=(6.0, 3.6))
    ax = axes[0, 0]
    ax.plot(-df["x"], df["expf_ulp"], marker="o", label="expf")
    ax.plot(-df["x"], df["fast_exp_ulp"], marker="s", label="fast exp, __expf (emulated)")
    ax.plot(-df["x"], 2 + 1.173 * (-df["x"]), linestyle="--", color="grey", label="bound 2 + 1.173|x| ulp")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("-x (exp argument is x = s - m <= 0, log scale)")
    ax.set_ylabel("max relative error (ulps, 2^-23)")
    ax.set_title("exp error against the argument")
    ax.legend()
    fig.tight_layout()
    return fig


# ---- recorded benchmarks -----------------------------------------------------------------------------
def bench_dirs(root: Path | str | None = None) -> list[Path]:
    """The GPU directories under ``data/bench`` that hold at least one CSV, sorted by name.

    A ``cpu`` folder (a smoke run of the harness written there by hand) is never one: plots show GPU data.
    """
    root = Path(root) if root is not None else DATA_ROOT
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and d.name != "cpu" and any(d.glob("*.csv")))


def load_bench(suite: str, *, gpu: str | None = None, root: Path | str | None = None,
               quiet: bool = False) -> pd.DataFrame | None:
    """The recorded rows of ``suite`` (``data/bench/<gpu>/<suite>.csv``), or None with a printed message.

    ``gpu`` picks the directory (default: the first, by name, that has the suite); read by
    ``attnlab.bench.load`` (typed columns).
    """
    dirs = [d for d in bench_dirs(root) if gpu is None or d.name == gpu]
    path = next((d / f"{suite}.csv" for d in dirs if (d / f"{suite}.csv").is_file()), None)
    if path is None:
        if not quiet:
            where = Path(root) if root is not None else DATA_ROOT
            print(f"No recorded benchmark data for suite {suite!r} yet (looked for {where}/<gpu>/{suite}.csv). "
                  f"Run `python -m attnlab bench --suite {suite}` on a GPU and commit the result.")
        return None
    from attnlab.bench import load  # lazily: the harness module is large and needed only here

    df = load(path).copy()
    df.attrs["path"] = str(path)
    df.attrs["gpu"] = path.parent.name
    return df


def bench_environment(suite: str, *, gpu: str | None = None, root: Path | str | None = None) -> dict:
    """The environment JSON recorded beside a suite's CSV (GPU, driver, versions, date...), or {}."""
    for d in bench_dirs(root):
        if (gpu is None or d.name == gpu) and (d / f"{suite}.json").is_file():
            return json.loads((d / f"{suite}.json").read_text())
    return {}


def _has_data(df: pd.DataFrame | None, what: str) -> bool:
    if df is None or len(df) == 0:
        print(f"Nothing to plot for {what}: no recorded benchmark data.")
        return False
    return True


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    """Rows whose output passed the checker and that have a timing (``status == "ok"`` where recorded)."""
    passed = df["passed"].astype(str).str.lower().isin(["true", "1", "1.0"])
    if "status" in df:
        passed = passed & (df["status"].astype(str) == "ok")
    return df[passed & pd.to_numeric(df["ms"], errors="coerce").notna()]


def _mask_label(df: pd.DataFrame) -> pd.Series:
    causal = df["causal"].astype(str).str.lower().isin(["true", "1", "1.0"])
    mask = df["mask"].fillna("").astype(str).replace({"nan": "", "none": "", "dense": ""})
    return np.where(mask != "", mask, np.where(causal, "causal", "dense"))


def pick_backend(df: pd.DataFrame, *candidates: str) -> str | None:
    """The first of ``candidates`` present in ``df['backend']`` (exact, then case-insensitive substring)."""
    names = list(dict.fromkeys(df["backend"].astype(str)))
    for c in candidates:
        if c in names:
            return c
    for c in candidates:
        hit = [n for n in names if c.lower() in n.lower()]
        if hit:
            return hit[0]
    return None


def throughput_vs_n(df: pd.DataFrame | None, *, backends: Iterable[str] | None = None, x: str = "Nk",
                    title: str = "") -> Figure | None:
    """TFLOP/s against N per backend; one panel per (dtype, D, mask kind). Passed rows only."""
    if not _has_data(df, "throughput"):
        return None
    d = _ok(df).copy()
    if backends is not None:
        d = d[d["backend"].isin(list(backends))]
    if d.empty:
        print("Nothing to plot for throughput: no row passed the checker.")
        return None
    d["panel"] = d["dtype"].astype(str) + " D" + d["D"].astype(str) + " " + _mask_label(d)
    panels = list(dict.fromkeys(d.sort_values(["dtype", "D"])["panel"]))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = _fig(nrows, ncols, size=(4.3 * ncols, 3.4 * nrows + 0.6), sharey=True)
    order = list(dict.fromkeys(d["backend"]))
    pal = backend_colors(order)
    tf = pd.to_numeric(d["tflops"], errors="coerce")
    log = bool(tf.max() / max(tf[tf > 0].min(), 1e-9) > 20)  # a log axis when backends differ by > 20x
    for ax, p in zip(axes.flat, panels):
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(mpl.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        g = d[d["panel"] == p].groupby(["backend", x], as_index=False)["tflops"].median()
        for b in order:
            gb = g[g["backend"] == b]
            if len(gb):
                ax.plot(gb[x], gb["tflops"], marker="o", color=pal[b], label=b)
        _n_axis(ax, sorted(d[x].unique()), f"{x} (tokens)")
        ax.set_ylabel("throughput (TFLOP/s, log scale)" if log else "throughput (TFLOP/s)")
        ax.set_title(p)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=pal[b], marker="o", label=b) for b in order]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(order)), frameon=False)
    fig.suptitle(title or f"throughput against N ({df.attrs.get('gpu', 'recorded')})")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def ratios(df: pd.DataFrame | None, baseline: str, *, backends: Iterable[str] | None = None) -> pd.DataFrame | None:
    """Median over configurations of ``tflops / baseline tflops`` per backend and mask kind (passed rows,
    matched on the configuration columns). None when there is no data or no baseline."""
    if df is None or len(df) == 0:
        return None
    d = _ok(df).copy()
    base = pick_backend(d, baseline) if len(d) else None
    if base is None:
        return None
    keys = [c for c in ("suite", "case", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "mask") if c in d]
    d["mask_kind"] = _mask_label(d)
    b = d[d["backend"] == base][[*keys, "tflops"]].rename(columns={"tflops": "base"})
    m = d.merge(b, on=keys, how="inner")
    if backends is not None:
        m = m[m["backend"].isin(list(backends))]
    m["ratio"] = m["tflops"] / m["base"]
    out = m.groupby(["backend", "mask_kind"])["ratio"].median().unstack("mask_kind")
    out.attrs["baseline"] = base
    return out


def ratio_bars(df: pd.DataFrame | None, baselines: Sequence[str] = ("sdpa-flash", "sdpa-cudnn"), *,
               title: str = "") -> Figure | None:
    """Bars of the median throughput ratio of each backend to each baseline (1.0 = as fast)."""
    if not _has_data(df, "ratios"):
        return None
    tabs = [(bl, ratios(df, bl)) for bl in baselines]
    tabs = [(bl, t) for bl, t in tabs if t is not None and len(t)]
    if not tabs:
        print(f"Nothing to plot for ratios: none of the baselines {list(baselines)} is in the data.")
        return None
    fig, axes = _fig(1, len(tabs), size=(5.5 * len(tabs), 3.8), sharey=False)
    for ax, (_bl, t) in zip(axes.flat, tabs):
        long = t.reset_index().melt(id_vars="backend", var_name="mask", value_name="ratio").dropna()
        sns.barplot(data=long, y="backend", x="ratio", hue="mask", ax=ax, orient="h")
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_xlabel(f"median throughput ratio to {t.attrs['baseline']} (1 = as fast)")
        ax.set_ylabel("")
    fig.suptitle(title or "throughput relative to PyTorch's best")
    fig.tight_layout()
    return fig


def memory_measured(df: pd.DataFrame | None, *, live_scores: Sequence[int] = (2, 3), title: str = "") -> Figure | None:
    """Measured peak extra memory against N per backend, with the models of :mod:`attnlab.memory` in black:
    the textbook version holding each of ``live_scores`` score-sized tensors, and a fused kernel holding
    its float32 lse. The benchmark's ``peak_extra_mib`` excludes the output, so the models do too.
    Backends at 0 bytes cannot appear on the log axis; their legend entry says so."""
    if not _has_data(df, "memory"):
        return None
    d = df[pd.to_numeric(df["peak_extra_mib"], errors="coerce").notna()].copy()
    if d.empty:
        print("Nothing to plot for memory: no row has a peak_extra_mib value.")
        return None
    d["N"] = d["Nk"]
    fig, axes = _fig(size=(7.5, 4.4))
    ax = axes[0, 0]
    cols = backend_colors(d["backend"])
    for b, g in d.groupby("backend", sort=False):
        g = g.groupby("N", as_index=False)["peak_extra_mib"].max()
        zero = bool((g["peak_extra_mib"] <= 0).all())
        ax.plot(g["N"], g["peak_extra_mib"] * 2**20, marker="o", color=cols[b],
                label=f"{b} (measured{': 0 B, not drawn' if zero else ''})")
    r = d.iloc[0]
    B, H, D, dt = int(r["B"]), int(r["Hq"]), int(r["D"]), str(r["dtype"])
    Ns = sorted(int(n) for n in d["N"].unique())
    out = [memory.qkvo_bytes(B, H, n, n, D, dt)["o"] for n in Ns]  # the models count it; the suite does not
    for k, style in zip(live_scores, ("--", "-.", (0, (5, 1)))):
        tb = [memory.textbook_peak_extra(B, H, n, n, D, dt, live_scores=k) - o for n, o in zip(Ns, out)]
        ax.plot(Ns, tb, linestyle=style, color="black", label=f"model: textbook ({k} scores)")
    fu = [memory.fused_peak_extra(B, H, n, n, D, dt) - o for n, o in zip(Ns, out)]
    ax.plot(Ns, fu, linestyle=":", color="black", label="model: fused (lse)")
    _binary_axis(ax)
    _n_axis(ax, Ns)
    ax.set_ylabel("peak extra memory (bytes, log scale)")
    ax.set_title(title or f"measured memory against the model (B{B} H{H} D{D} {dt})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def decode_bandwidth(df: pd.DataFrame | None, *, copy_tbps: float = memory.H200["copy_tbps"],
                     title: str = "") -> Figure | None:
    """Decode (Nq = 1): achieved K/V bandwidth against the KV length per backend, with the copy ceiling."""
    if not _has_data(df, "decode"):
        return None
    d = _ok(df)
    d = d[pd.to_numeric(d["gbps"], errors="coerce").notna()]
    if d.empty:
        print("Nothing to plot for decode: no passed row with a bandwidth.")
        return None
    fig, axes = _fig(size=(7.5, 4.2))
    ax = axes[0, 0]
    g = d.groupby(["backend", "Nk"], as_index=False)["gbps"].median()
    sns.lineplot(data=g, x="Nk", y="gbps", hue="backend", marker="o", ax=ax, palette=backend_colors(g["backend"]))
    ax.axhline(copy_tbps * 1e3, color="#c0392b", linestyle="--", label=f"device copy {copy_tbps:g} TB/s")
    _n_axis(ax, sorted(d["Nk"].unique()), "KV length Nk (tokens)")
    ax.set_ylabel("K/V read bandwidth (GB/s)")
    ax.set_title(title or "decode: bandwidth against the copy ceiling")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def bench_roofline(df: pd.DataFrame | None, *, backends: Iterable[str] | None = None,
                   peak_tflops: float = memory.H200["bf16_tflops"], tbps: float = memory.H200["copy_tbps"],
                   unfused: Iterable[str] = ("torch", "sdpa-math"), title: str = "") -> Figure | None:
    """The best measured configuration of each backend on the roofline, at the intensity of the traffic
    model that fits it: unfused for the backends in ``unfused`` (they write the scores), fused otherwise."""
    if not _has_data(df, "roofline"):
        return None
    d = _ok(df)
    if backends is not None:
        d = d[d["backend"].isin(list(backends))]
    if d.empty:
        print("Nothing to plot for the roofline: no passed rows.")
        return None
    d = d.copy()
    unfused = set(unfused)
    d["intensity"] = [  # useful FLOPs (the CSV's, as the y axis counts them) per byte of the pipeline's traffic
        r.flops
        / (memory.unfused_traffic if r.backend in unfused else memory.fused_traffic)(
            r.B, r.Hq, r.Nq, r.Nk, r.D, r.dtype, Hkv=r.Hkv).total
        for r in d.itertuples()
    ]
    best = d.loc[d.groupby("backend", sort=False)["tflops"].idxmax()]
    pts = [(f"{r.backend} N{r.Nk} D{r.D}", r.intensity, r.tflops) for r in best.itertuples()]
    cols = backend_colors(best["backend"])
    return roofline(pts, peak_tflops=peak_tflops, tbps=tbps, colors=[cols[b] for b in best["backend"]],
                    title=title or "best measured point per backend")


def summary(df: pd.DataFrame | None, *, backends: Iterable[str] | None = None,
            value: str = "tflops") -> pd.DataFrame | None:
    """A pivot of ``value`` (median) with one row per configuration and one column per backend."""
    if df is None or len(df) == 0:
        return None
    d = _ok(df)
    if backends is not None:
        d = d[d["backend"].isin(list(backends))]
    if d.empty:
        return None
    d = d.copy()
    d["mask_kind"] = _mask_label(d)
    return d.pivot_table(index=["dtype", "D", "mask_kind", "Nk"], columns="backend", values=value,
                         aggfunc="median").round(1)


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
               ylabel: str = "", ax=None, fontsize: float = 5.5) -> Figure:
    """Draw which thread owns each element of a tile: ``owner`` holds thread ids. Colours follow ``color``
    (default: the thread id, cycling through 20), white lines separate owners, and each thread's id is
    written once on every rectangular region it owns (on each cell of an irregular one)."""
    from matplotlib.collections import LineCollection

    owner = np.asarray(owner)
    color = owner if color is None else np.asarray(color)
    if ax is None:
        fig, axes = _fig(size=(6.0, 4.0))
        ax = axes[0, 0]
    else:
        fig = ax.figure
    ax.imshow(color % 20, cmap="tab20", vmin=0, vmax=19, interpolation="nearest", aspect="auto")
    rows, cols = owner.shape
    segs = [[(c + 0.5, r - 0.5), (c + 0.5, r + 0.5)] for r, c in np.argwhere(owner[:, 1:] != owner[:, :-1])]
    segs += [[(c - 0.5, r + 0.5), (c + 0.5, r + 0.5)] for r, c in np.argwhere(owner[1:, :] != owner[:-1, :])]
    ax.add_collection(LineCollection(segs, colors="white", linewidths=0.7))
    for t, comp in _components(owner):
        (r0, c0), (r1, c1) = comp.min(0), comp.max(0)
        if len(comp) == (r1 - r0 + 1) * (c1 - c0 + 1):  # a rectangle: one label in its middle
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, str(t), ha="center", va="center", fontsize=fontsize)
        else:
            for r, c in comp:
                ax.text(c, r, str(t), ha="center", va="center", fontsize=fontsize)
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.grid(False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig
