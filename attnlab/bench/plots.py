"""Figures of recorded benchmarks (``data/bench/<gpu>/<suite>.csv``, the schema of :mod:`attnlab.bench.schema`),
in the theme of :mod:`attnlab.lessons.figures`. Functions take the DataFrame from :func:`load_bench` and, when
there is none, print a clear message and return ``None`` instead of failing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import matplotlib as mpl
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from attnlab.bench.results import mask_label, passed_rows, ratios
from attnlab.figure_style import BACKEND_COLORS, backend_colors, binary_axis, n_axis, new_figure  # noqa: F401
from attnlab.lessons import memory
from attnlab.lessons.figures import roofline
from attnlab.paths import BENCH_DIR

#: Where recorded benchmarks live (:data:`attnlab.paths.BENCH_DIR`).
DATA_ROOT = BENCH_DIR

#: Columns every benchmark CSV has (a subset of ``attnlab.bench.COLUMNS``: what the figures read).
BENCH_COLUMNS = (
    "backend", "suite", "case", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "mask", "ms", "tflops",
    "gbps", "peak_extra_mib", "max_abs_err", "passed",
)


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








def throughput_vs_n(df: pd.DataFrame | None, *, backends: Iterable[str] | None = None, x: str = "Nk",
                    title: str = "") -> Figure | None:
    """TFLOP/s against N per backend; one panel per (dtype, D, mask kind). Passed rows only."""
    if not _has_data(df, "throughput"):
        return None
    d = passed_rows(df).copy()
    if backends is not None:
        d = d[d["backend"].isin(list(backends))]
    if d.empty:
        print("Nothing to plot for throughput: no row passed the checker.")
        return None
    d["panel"] = d["dtype"].astype(str) + " D" + d["D"].astype(str) + " " + mask_label(d)
    panels = list(dict.fromkeys(d.sort_values(["dtype", "D"])["panel"]))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = new_figure(nrows, ncols, size=(4.3 * ncols, 3.4 * nrows + 0.6), sharey=True)
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
        xs = sorted(d[x].unique())
        n_axis(ax, xs, f"{x} (tokens), batch size below")
        batch = d[d["panel"] == p].groupby(x)["B"].agg(lambda b: "/".join(map(str, sorted(set(b)))))
        ax.set_xticklabels([f"{t.get_text()}\nB{batch.get(v, '?')}" for t, v in zip(ax.get_xticklabels(), xs)])
        ax.set_ylabel("throughput (TFLOP/s, log scale)" if log else "throughput (TFLOP/s)")
        ax.set_title(p)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=pal[b], marker="o", label=b) for b in order]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(order)), frameon=False)
    fig.suptitle(title or f"throughput against N ({df.attrs.get('gpu', 'recorded')})")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig




def ratio_bars(df: pd.DataFrame | None, baselines: Sequence[str] = ("sdpa-flash", "sdpa-cudnn"), *,
               title: str = "") -> Figure | None:
    """Bars of the median throughput ratio of each backend to each baseline (1.0 = as fast)."""
    if not _has_data(df, "ratios"):
        return None
    tabs = [(bl, ratios(df, bl, "tflops", by="mask")) for bl in baselines]
    tabs = [(bl, t) for bl, t in tabs if t is not None and len(t)]
    if not tabs:
        print(f"Nothing to plot for ratios: none of the baselines {list(baselines)} is in the data.")
        return None
    fig, axes = new_figure(1, len(tabs), size=(5.5 * len(tabs), 3.8), sharey=False)
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
    """Measured peak extra memory against N per backend, with the models of :mod:`attnlab.lessons.memory` in black:
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
    fig, axes = new_figure(size=(7.5, 4.4))
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
    binary_axis(ax)
    n_axis(ax, Ns)
    ax.set_ylabel("peak extra memory (bytes, log scale)")
    ax.set_title(title or f"measured memory against the model (B{B} H{H} D{D} {dt})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def decode_config_label(d: pd.DataFrame) -> list[str]:
    """A short label per decode row: batch, heads, KV length and the mask when not dense."""
    return [f"B{b} Hq{hq}/Hkv{hkv} Nk{nk // 1024}k" + ("" if str(m) == "dense" else f" {m}")
            for b, hq, hkv, nk, m in zip(d["B"], d["Hq"], d["Hkv"], d["Nk"], d["mask"])]


def decode_bandwidth(df: pd.DataFrame | None, *, copy_tbps: float = memory.RECORDED_GPU["copy_tbps"],
                     backends: Iterable[str] | None = None, title: str = "",
                     read_tbps: float | None = None) -> Figure | None:
    """Decode (Nq = 1): achieved K/V bandwidth per recorded configuration (no median over batch sizes or
    masks) and backend, with the measured device copy rate as a reference line (a measured rate, not a bound:
    a kernel can read faster than a copy, which also writes) and, when given, the measured read-only rate
    (``read_tbps``, :func:`attnlab.lessons.memory.measured_roofs`): the memory roof of a read stream."""
    if not _has_data(df, "decode"):
        return None
    d = passed_rows(df)
    d = d[pd.to_numeric(d["gbps"], errors="coerce").notna()]
    if backends is not None:
        d = d[d["backend"].isin(list(backends))]
    if d.empty:
        print("Nothing to plot for decode: no passed row with a bandwidth.")
        return None
    d = d.sort_values(["Nk", "B", "mask"])
    d = d.assign(config=[c.replace(" ", "\n") for c in decode_config_label(d)])
    fig, axes = new_figure(size=(11.0, 4.6))
    ax = axes[0, 0]
    sns.barplot(data=d, x="config", y="gbps", hue="backend", ax=ax, palette=backend_colors(d["backend"]),
                errorbar=None)
    ax.axhline(copy_tbps * 1e3, color="#c0392b", linestyle="--", label=f"measured device copy {copy_tbps:g} TB/s")
    if read_tbps is not None:
        ax.axhline(read_tbps * 1e3, color="black", linestyle="-", linewidth=1.2,
                   label=f"measured read-only stream {read_tbps:g} TB/s")
    ax.set_xlabel("configuration (D128 bf16, one query per sequence)")
    ax.set_ylabel("K/V read bandwidth (GB/s)")
    ax.tick_params(axis="x", labelsize=8)  # one line per field of the label: no two labels overlap
    ax.set_title(title or "decode: bandwidth per configuration, measured rates as lines")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


def bench_roofline(df: pd.DataFrame | None, *, backends: Iterable[str] | None = None,
                   peak_tflops: float = memory.RECORDED_GPU["bf16_tflops"],
                   tbps: float = memory.RECORDED_GPU["copy_tbps"],
                   unfused: Iterable[str] = ("torch", "sdpa-math"), title: str = "",
                   extra_peaks: Mapping[str, float] | None = None) -> Figure | None:
    """The best measured configuration of each backend on the roofline, at the intensity of the traffic
    model that fits it: unfused for the backends in ``unfused`` (they write the scores), fused otherwise
    (K and V read once). The intensities are ideal ones from the model, not measured bytes. ``extra_peaks``:
    further flat roofs, e.g. the FP32 FMA rate of the CUDA-core kernels."""
    if not _has_data(df, "roofline"):
        return None
    d = passed_rows(df)
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
                    extra_peaks=extra_peaks, title=title or "best measured point per backend")


def summary(df: pd.DataFrame | None, *, backends: Iterable[str] | None = None,
            value: str = "tflops", decimals: int | None = 1) -> pd.DataFrame | None:
    """A pivot of ``value`` (median) with one row per configuration and one column per backend, rounded to
    ``decimals`` (None: unrounded, to compute ratios from)."""
    if df is None or len(df) == 0:
        return None
    d = passed_rows(df)
    if backends is not None:
        d = d[d["backend"].isin(list(backends))]
    if d.empty:
        return None
    d = d.copy()
    d["mask_kind"] = mask_label(d)
    t = d.pivot_table(index=["dtype", "D", "mask_kind", "Nk"], columns="backend", values=value, aggfunc="median")
    return t if decimals is None else t.round(decimals)
