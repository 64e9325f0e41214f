"""The one figure style of attnlab: the theme, new figures, the axes every chart shares (binary byte sizes,
sequence lengths) and one colour per backend. The notebooks' figures (:mod:`attnlab.lessons.figures`) and the
figures of recorded benchmarks (:mod:`attnlab.bench.plots`) both draw with it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns

from attnlab.lessons.memory import fmt_bytes


def use_theme() -> None:
    """The one attnlab theme: seaborn whitegrid, colour-blind palette, compact figures."""
    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")
    mpl.rcParams.update({
        "figure.figsize": (7.0, 4.0), "figure.dpi": 90, "axes.titleweight": "bold", "axes.titlesize": 11,
        "axes.labelsize": 10, "legend.fontsize": 9, "legend.title_fontsize": 9, "figure.autolayout": False,
    })


def new_figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] | None = None, **kw):
    """A figure in the theme with an [nrows, ncols] array of axes (always 2-D)."""
    use_theme()
    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False, **kw)
    return fig, axes


def binary_axis(ax, unit: str = "bytes") -> None:
    """Log y axis with ticks at powers of two (every 2nd or 4th one when the range is wide), in binary units.

    Call after the data is drawn: the ticks are chosen from the current limits.
    """
    ax.set_yscale("log", base=2)
    lo, hi = ax.get_ylim()
    e0, e1 = int(np.floor(np.log2(max(lo, 1.0)))), int(np.ceil(np.log2(max(hi, 2.0))))
    step = next(s for s in (1, 2, 4, 8) if (e1 - e0) / s <= 8)
    ticks = [2.0**e for e in range(e0 - e0 % step, e1 + 1, step) if lo <= 2.0**e <= hi]
    ax.set_yticks(ticks)
    ax.set_yticklabels([fmt_bytes(t).replace(".0 ", " ") for t in ticks])
    ax.yaxis.set_minor_locator(mpl.ticker.NullLocator())
    ax.set_ylim(lo, hi)


def n_axis(ax, values: Sequence[int], label: str = "sequence length N (tokens)") -> None:
    """A log-2 x axis of sequence lengths, ticked at ``values`` (1k, 2k, ... past 1024)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values))
    ax.set_xticklabels([f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
    ax.xaxis.set_minor_locator(mpl.ticker.NullLocator())
    ax.set_xlabel(label)


#: One colour per backend, the same in every benchmark figure (unknown names get further colours).
BACKEND_COLORS = {
    "triton": "tab:blue", "cuda-rowmax": "tab:orange", "cuda-tiled": "tab:olive", "cuda-naive": "tab:brown",
    "torch": "tab:gray", "sdpa": "tab:cyan", "sdpa-flash": "tab:green", "sdpa-cudnn": "tab:red",
    "sdpa-efficient": "tab:purple", "sdpa-math": "tab:pink", "flex": "darkgoldenrod", "cuda-mma": "teal",
}


def backend_colors(names: Iterable[str]) -> dict[str, object]:
    """name -> colour: :data:`BACKEND_COLORS` for known backends, distinct extra colours for the rest."""
    names = list(dict.fromkeys(names))
    extra = iter(sns.color_palette("husl", max(1, sum(n not in BACKEND_COLORS for n in names))))
    return {n: BACKEND_COLORS[n] if n in BACKEND_COLORS else next(extra) for n in names}
