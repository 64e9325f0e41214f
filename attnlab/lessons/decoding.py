"""Decode for notebook 10: the bytes and FLOPs of a few query rows against a long KV cache, how many programs
the split-KV path (:mod:`attnlab.backends.triton.decode`) launches against the SM count, the merge of partial
states, GQA packing, the paged KV cache drawn, and the recorded decode figures against the bandwidth.

Shapes only where possible (no large tensors): a :class:`~attnlab.problem.Problem` for a suite configuration
is built on stride-0 views of one element, which is all the decode path's host-side choices read.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import seaborn as sns
import torch

import attnlab
from attnlab import paths
from attnlab.backends.triton import decode as dec
from attnlab.figure_style import new_figure
from attnlab.lessons import memory
from attnlab.lessons import online_softmax as osm
from attnlab.problem import Problem, make_problem


def config_label(B: int, Hq: int, Hkv: int, Nk: int, Nq: int = 1) -> str:
    return f"B{B} Hq{Hq} Hkv{Hkv} Nk{Nk // 1024}k" + ("" if Nq == 1 else f" Nq{Nq}")


def shape_problem(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, dtype: torch.dtype = torch.bfloat16) -> Problem:
    """A Problem of the given shape on stride-0 CPU views (nothing allocated): for the host-side choices."""
    z = torch.zeros(1, dtype=dtype)
    return make_problem(z.expand(B, Hq, Nq, D), z.expand(B, Hkv, Nk, D), z.expand(B, Hkv, Nk, D))


def suite_configs(cases: Iterable | None = None) -> pd.DataFrame:
    """The distinct (B, Hq, Hkv, Nq, Nk, D, dtype) of the decode suite's cases (default: ``suite_cases("decode")``)."""
    if cases is None:
        from attnlab.bench.suites import suite_cases

        cases = suite_cases("decode", device="cuda")  # the GPU shapes (cases only: no tensors are made)
    rows = [{"B": c.B, "Hq": c.Hq, "Hkv": c.Hkv or c.Hq, "Nq": c.Nq, "Nk": c.Nk or c.Nq, "D": c.D, "dtype": c.dtype}
            for c in cases]
    return pd.DataFrame(rows).drop_duplicates().reset_index(drop=True)


# ---- bytes against FLOPs ----------------------------------------------------------------------------------
def decode_roofline(configs: pd.DataFrame, *, tbps: float = memory.RECORDED_GPU["copy_tbps"],
                    peak_tflops: float = memory.RECORDED_GPU["bf16_tflops"]) -> pd.DataFrame:
    """Per configuration: FLOPs, HBM bytes of the fused forward (q, k, v read once, o and lse written), the
    arithmetic intensity, and the time the bytes take at ``tbps`` against the time the FLOPs take at
    ``peak_tflops``."""
    rows = []
    for r in configs.itertuples():
        f = memory.flops(r.B, r.Hq, r.Nq, r.Nk, r.D)
        by = memory.fused_traffic(r.B, r.Hq, r.Nq, r.Nk, r.D, r.dtype, Hkv=r.Hkv).total
        rows.append({"config": config_label(r.B, r.Hq, r.Hkv, r.Nk, r.Nq), "flops": f, "bytes": by,
                     "FLOP/byte": f / by, "us_at_bandwidth": 1e6 * by / (tbps * 1e12),
                     "us_at_peak_flops": 1e6 * f / (peak_tflops * 1e12)})
    df = pd.DataFrame(rows)
    df["bytes/flops time"] = df["us_at_bandwidth"] / df["us_at_peak_flops"]
    return df


def intensity_vs_rows(Nqs: Iterable[int], groups: Iterable[int], dtype: object = "bfloat16", D: int = 128,
                      Nk: int = 32768) -> pd.DataFrame:
    """Intensity of decode with ``Nq`` query rows per sequence and ``group`` query heads per kv head (one kv
    head, long cache): about ``2 * group * Nq / bytes_per_element`` FLOP/byte."""
    return pd.DataFrame(
        {f"group {g}": [memory.flops(1, g, n, Nk, D) / memory.fused_traffic(1, g, n, Nk, D, dtype, Hkv=1).total
                        for n in Nqs] for g in groups},
        index=pd.Index(list(Nqs), name="Nq"),
    )


# ---- occupancy -------------------------------------------------------------------------------------------
def occupancy(configs: pd.DataFrame, sms: int = 132) -> pd.DataFrame:
    """Programs launched per configuration: the fused forward (one per query head and batch entry: a few
    query rows fit one of its row tiles), the decode path packed without a split (one per kv head, batch
    entry and row tile) and with the split count :func:`attnlab.backends.triton.decode.num_splits` picks
    for ``sms`` SMs with the config the decode path takes for equal lengths (no kv_len) and a contiguous
    cache (``kernel``: key tile and pipeline stages)."""
    rows = []
    for r in configs.itertuples():
        dt = getattr(torch, str(r.dtype).replace("torch.", ""))
        prob = shape_problem(r.B, r.Hq, r.Hkv, r.Nq, r.Nk, r.D, dt)
        bm = dec.block_m(prob)
        cfg = dec.default_config(dt, r.D, rows=bm)
        rt = dec.row_tiles(prob)
        s = dec.num_splits(prob, cfg, sms)
        rows.append({"config": config_label(r.B, r.Hq, r.Hkv, r.Nk, r.Nq), "block_m": bm,
                     "kernel": f"{cfg.block_n} keys, {cfg.num_stages} stages", "row_tiles": rt, "splits": s,
                     "fused forward": r.B * r.Hq,
                     "packed, no split": r.B * r.Hkv * rt, "packed + split": r.B * r.Hkv * rt * s,
                     "keys per split": math.ceil(r.Nk / s),
                     "workspace_bytes": dec.workspace_bytes(prob, s)})
    df = pd.DataFrame(rows)
    df.attrs["sms"] = sms
    return df


def plot_occupancy(occ: pd.DataFrame, *, title: str = ""):
    """Programs per configuration (log scale) with and without the split, against the SM count."""
    sms = occ.attrs.get("sms", 132)
    cols = ["fused forward", "packed, no split", "packed + split"]
    t = occ.melt(id_vars="config", value_vars=cols, var_name="grid", value_name="programs")
    fig, axes = new_figure(size=(9.0, 4.0))
    ax = axes[0, 0]
    sns.barplot(data=t, x="config", y="programs", hue="grid", ax=ax,
                palette=["#bbbbbb", "#f4a259", "#3d7ea6"])
    ax.axhline(sms, color="#c0392b", linestyle="--", label=f"{sms} SMs")
    ax.set_yscale("log")
    ax.set(xlabel="", ylabel="programs launched (log scale)", title=title or "programs against the SM count")
    ax.tick_params(axis="x", rotation=15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    return fig


# ---- merging partial states ------------------------------------------------------------------------------
def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine the (out, lse) of disjoint key ranges with the lse rule of notebook 04 (empty parts add nothing)."""
    out, lse = outs[0], lses[0]
    for o, s in zip(outs[1:], lses[1:]):
        out, lse = osm.merge_lse(out, lse, o, s)
    return out, lse


def split_reference(q, k, v, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention computed over ``splits`` key ranges separately (``attnlab.reference`` on each slice)
    and merged with :func:`merge_partials`: what the decode path's two kernels do, in PyTorch."""
    Nk = k.shape[2]
    bounds = [round(i * Nk / splits) for i in range(splits + 1)]
    parts = [attnlab.reference(q, k[:, :, a:b], v[:, :, a:b]) for a, b in itertools.pairwise(bounds)]
    return merge_partials([p[0] for p in parts], [p[1] for p in parts])


def decode_splits(q, k, v, splits: Iterable[int], **kw) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The decode path's (out, lse) of one call with each forced split count (on CPU: the interpreter)."""
    prob = make_problem(q, k, v, **kw)
    res = {}
    for s in splits:
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        dec.decode_forward(prob, out, lse, splits=s)
        res[s] = (out, lse)
    return res


# ---- GQA packing -----------------------------------------------------------------------------------------
def packed_rows(Hq: int, Hkv: int, Nq: int, kv_head: int = 0, interpret: bool = False) -> pd.DataFrame:
    """The packed rows of the programs of one kv head: packed row r = g * Nq + i is query head
    ``kv_head * group + g``, query row i; rows past group * Nq are masked padding of the tile."""
    prob = shape_problem(1, Hq, Hkv, Nq, 64, 16)
    bm, group = dec.block_m(prob, interpret), Hq // Hkv
    rows = []
    for rt in range(dec.row_tiles(prob, interpret)):
        for r in range(rt * bm, (rt + 1) * bm):
            live = r < group * Nq
            rows.append({"row tile": rt, "packed row": r, "query head": kv_head * group + r // Nq if live else None,
                         "query row i": r % Nq if live else None, "live": live})
    return pd.DataFrame(rows)


def kv_bytes(configs: pd.DataFrame) -> pd.DataFrame:
    """K/V bytes per call read once per kv head (packed) and once per query head (one program per query
    head, no cache help), and the ratio (the group size)."""
    rows = []
    for r in configs.itertuples():
        once = 2 * r.B * r.Hkv * r.Nk * r.D * memory.dtype_bytes(r.dtype)
        rows.append({"config": config_label(r.B, r.Hq, r.Hkv, r.Nk, r.Nq), "per kv head (packed)": once,
                     "per query head": once * (r.Hq // r.Hkv), "ratio": r.Hq // r.Hkv})
    return pd.DataFrame(rows)


# ---- the paged KV cache ----------------------------------------------------------------------------------
def paged_example(seed: int = 0, *, block_size: int = 16, kv_len=(72, 40), Hq: int = 4, Hkv: int = 2, D: int = 16,
                  Nq: int = 1, num_blocks: int = 12, dtype: torch.dtype = torch.float32) -> dict:
    """Two sequences in a shared pool of ``num_blocks`` physical blocks, in shuffled order (seeded). Returns
    q, the caches [num_blocks, block_size, Hkv, D], the int32 block table [2, max_blocks], kv_len and the
    dense k, v [2, Hkv, Nk, D] the table describes."""
    g = torch.Generator().manual_seed(seed)
    B = len(kv_len)
    max_blocks = max(math.ceil(n / block_size) for n in kv_len)
    need = [math.ceil(n / block_size) for n in kv_len]
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(B, max_blocks, dtype=torch.int32)
    used = 0
    for b in range(B):
        table[b, :need[b]] = perm[used:used + need[b]].to(torch.int32)
        used += need[b]
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g, dtype=dtype)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=dtype)
    k = k_cache[table.long()].reshape(B, max_blocks * block_size, Hkv, D).transpose(1, 2)
    v = v_cache[table.long()].reshape(B, max_blocks * block_size, Hkv, D).transpose(1, 2)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": table, "kv_len": list(kv_len),
            "k": k, "v": v, "block_size": block_size, "need": need}


def plot_block_table(ex: dict, *, title: str = ""):
    """The block table drawn: each sequence's logical blocks (left) and where they live in the pool (right)."""
    table, need, bs = ex["block_table"], ex["need"], ex["block_size"]
    nblocks = ex["k_cache"].shape[0]
    colors = ["#3d7ea6", "#f4a259", "#6ab187", "#b05f9e"]
    fig, axes = new_figure(size=(9.5, 3.8))
    ax = axes[0, 0]
    B = table.shape[0]
    for b in range(B):
        y = B - b + 0.8
        ax.text(-0.3, y + 0.35, f"seq {b} (kv_len {ex['kv_len'][b]})", ha="right", va="center", fontsize=9)
        for j in range(table.shape[1]):
            used = j < need[b]
            ax.add_patch(plt_rect(j, y, colors[b] if used else "#f0f0f0"))
            ax.text(j + 0.45, y + 0.35, f"L{j}" if used else "-", ha="center", va="center", fontsize=8,
                    color="white" if used else "grey")
            if used:
                p = int(table[b, j])
                ax.annotate("", xy=(p + 0.45, 0.75), xytext=(j + 0.45, y), arrowprops=dict(
                    arrowstyle="->", color=colors[b], alpha=0.7, lw=1.2))
    owner = {int(table[b, j]): b for b in range(B) for j in range(need[b])}
    for p in range(nblocks):
        ax.add_patch(plt_rect(p, 0, colors[owner[p]] if p in owner else "#f0f0f0"))
        ax.text(p + 0.45, 0.35, f"P{p}", ha="center", va="center", fontsize=8,
                color="white" if p in owner else "grey")
    ax.text(-0.3, 0.35, "physical pool", ha="right", va="center", fontsize=9)
    ax.set_xlim(-4.2, nblocks + 0.2)
    ax.set_ylim(-0.4, B + 2.0)
    ax.axis("off")
    ax.set_title(title or f"block table: logical block Lj of a sequence -> physical block P (block_size {bs})")
    fig.tight_layout()
    return fig


def plt_rect(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 0.9, 0.7, facecolor=color, edgecolor="white")


# ---- recorded figures ------------------------------------------------------------------------------------
def bandwidth_table(df: pd.DataFrame | None, backends: Iterable[str] | None = None) -> pd.DataFrame | None:
    """GB/s of K/V read (median of passed rows), one row per case, one column per backend."""
    if df is None or len(df) == 0:
        return None
    d = df[df["status"].eq("ok")]
    d = d[pd.to_numeric(d["gbps"], errors="coerce").notna()]
    if backends is not None:
        d = d[d["backend"].isin(list(backends))]
    if d.empty:
        return None
    return d.pivot_table(index="case", columns="backend", values="gbps", aggfunc="median", sort=False)


#: The decode experiments recorded as structured files: ``data/experiments/<gpu>/<name>.csv`` (its JSON beside it
#: says which run and log it comes from). ``decode-deep-sweep``: config, variant (``default``, ``cudnn`` or
#: ``block_n/warps/stages``), split count ``S`` (empty for cuDNN), ``paged`` block size (0: contiguous), ``us``
#: (CUDA-graph replay), ``ok``. ``decode-merge-ab``: config, way (``merge-in-split``, ``merge-kernel``, SDPA),
#: ``graph_us``, ``gbps``, ``stream_us``, ``host_us``. ``decode-pdl-ab``: config, way (``cudnn``, ``pdl=0``,
#: ``pdl=1``), ``graph_us``, ``events_us``, ``equal``. ``decode-graph``: config, variant, ``us``, ``gbps`` (graph
#: replay). ``read-ceiling``: config, ``bytes`` of K/V, ``reader``, ``us``, ``tbps``, ``ok``.
EXPERIMENTS = ("decode-deep-sweep", "decode-merge-ab", "decode-pdl-ab", "decode-graph", "read-ceiling")


def experiment(name: str, gpu_dir: Path | str | None = None) -> pd.DataFrame | None:
    """The rows of the recorded decode experiment ``name`` (:data:`EXPERIMENTS`) of one GPU (by default the
    recorded one), or None when it is not recorded there."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown decode experiment {name!r}; recorded ones: {', '.join(EXPERIMENTS)}")
    gpu = Path(gpu_dir).name if gpu_dir is not None else memory.DEFAULT_GPU_DIR.name
    path = (Path(gpu_dir) if gpu_dir is not None else paths.DATA_DIR / "experiments" / gpu) / f"{name}.csv"
    return pd.read_csv(path) if path.is_file() else None


def ceiling_table(graph: pd.DataFrame, reads: pd.DataFrame) -> pd.DataFrame:
    """Per config in both experiments: the fastest correct pure read of its K/V bytes (``read-ceiling``)
    against attnlab's decode and SDPA's cuDNN kernel on those bytes (``decode-graph``), all GPU time
    alone; ``x read`` is the decode's time over the read's."""
    best = reads[reads["ok"]].sort_values("us").groupby("config", sort=False).head(1).set_index("config")
    g = graph.pivot_table(index="config", columns="variant", values="us", sort=False)
    rows = []
    for config, r in best.iterrows():
        if config not in g.index:
            continue
        auto, cudnn = g.loc[config, "auto"], g.loc[config].get("sdpa-cudnn", float("nan"))
        rows.append({"config": config, "K/V MiB": r["bytes"] / 2**20, "fastest read": r["reader"],
                     "read us": r["us"], "read TB/s": r["tbps"],
                     "attnlab us": auto, "attnlab TB/s": r["bytes"] / auto / 1e6, "cudnn us": cudnn,
                     "x read": auto / r["us"]})
    return pd.DataFrame(rows).set_index("config")


def pdl_ab_story(ab: pd.DataFrame) -> str:
    """What the PDL A/B says, from its numbers: GPU time and event-timed call time saved, outputs equal."""
    wide = ab.pivot(index="config", columns="way", values=["graph_us", "events_us"])
    graph = wide["graph_us"]["pdl=0"] - wide["graph_us"]["pdl=1"]
    events = wide["events_us"]["pdl=0"] - wide["events_us"]["pdl=1"]
    equal = "equal bit for bit" if ab["equal"].all() else "NOT equal"
    return (f"Launched by programmatic dependent launch, the merge changes the GPU time of a call by "
            f"{-graph.max():+.1f} to {-graph.min():+.1f} us and an event-timed call by {-events.max():+.1f} to "
            f"{-events.min():+.1f} us across the {len(graph)} configs; the outputs of both launches are {equal}.")


def merge_ab_story(ab: pd.DataFrame) -> str:
    """What the A/B says, from its numbers: the host time one launch saves and the GPU time it costs."""
    wide = ab.pivot(index="config", columns="way", values=["graph_us", "stream_us", "host_us"])
    host = wide["host_us"]["merge-kernel"] - wide["host_us"]["merge-in-split"]
    gpu = wide["graph_us"]["merge-in-split"] - wide["graph_us"]["merge-kernel"]
    stream = wide["stream_us"]["merge-in-split"] - wide["stream_us"]["merge-kernel"]
    worst = gpu.idxmax()
    return (f"Merging in the split kernel saves {host.min():.0f}-{host.max():.0f} us of host time a call (one launch "
            f"instead of two) but costs {gpu.min():.1f}-{gpu.max():.1f} us of GPU time, most at {worst} "
            f"({wide['graph_us']['merge-in-split'][worst]:.1f} against {wide['graph_us']['merge-kernel'][worst]:.1f} "
            f"us): the merge then runs at the end of the kernel, one program per column after its last split. "
            f"Back to back, host and GPU overlapped, it is {stream.min():+.1f} to {stream.max():+.1f} us a "
            f"call against the merge kernel, so the decode path keeps the second kernel.")


# ---- pipeline depth against the split count ----------------------------------------------------------------
def deep_sweep_table(sweep: pd.DataFrame, variants: Iterable[str] = ("128/4/3", "64/4/4")) -> pd.DataFrame:
    """Per config (contiguous cache): the default's and cuDNN's us, and each of ``variants`` at its fewest
    splits (about one program per SM), with its split count and its time over cuDNN's."""
    dense = sweep[sweep["paged"] == 0]
    out = []
    for config, g in dense.groupby("config", sort=False):
        row = {"config": config}
        d = g[g["variant"] == "default"].iloc[0]
        row["default S"], row["default us"] = int(d["S"]), d["us"]
        cudnn = g[g["variant"] == "cudnn"]["us"].iloc[0]
        row["cudnn us"] = cudnn
        for v in variants:
            rows = g[g["variant"] == v]
            if len(rows):
                r = rows.loc[rows["S"].idxmin()]
                row[f"{v} S"], row[f"{v} us"], row[f"{v} / cudnn"] = int(r["S"]), r["us"], r["us"] / cudnn
        out.append(row)
    return pd.DataFrame(out).set_index("config")


def deep_paged_ratio(sweep: pd.DataFrame, variant: str = "128/4/3") -> pd.Series:
    """The paged caches' us over the contiguous cache's for ``variant`` at the same split count, per config
    and block size (the sweep measured paged caches at the fewest splits only)."""
    g = sweep[sweep["variant"] == variant]
    dense = g[g["paged"] == 0].set_index(["config", "S"])["us"]
    dense = dense[~dense.index.duplicated()]  # (two aims can give one split count: the first measurement)
    paged = g[g["paged"] > 0]
    return pd.Series([r.us / dense[(r.config, r.S)] for r in paged.itertuples()],
                     index=pd.MultiIndex.from_frame(paged[["config", "paged"]]), name=f"{variant} paged / dense",
                     dtype=float)
