"""Decode for notebook 10: the bytes and FLOPs of a few query rows against a long KV cache, how many programs
the split-KV path (:mod:`attnlab.backends.triton.decode`) launches against the SM count, the merge of partial
states, GQA packing, the paged KV cache drawn, and the recorded decode figures against the bandwidth.

Shapes only where possible (no large tensors): a :class:`~attnlab.problem.Problem` for a suite configuration
is built on stride-0 views of one element, which is all the decode path's host-side choices read.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import seaborn as sns
import torch

import attnlab
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


_CONFIG = re.compile(r"^-- (B\d+ Hq\d+ Hkv\d+ Nk\d+)")
_ROW = re.compile(r"^   (\S.*?)\s{2,}([\d.]+) us\s+(\d+) GB/s")


def _log_lines(path: str | Path) -> list[str] | None:
    """The lines of the GPU log at ``path``, or None if there is no such file (the data is not recorded)."""
    path = Path(path)
    return path.read_text().splitlines() if path.is_file() else None


def parse_decode_log(path: str | Path) -> pd.DataFrame | None:
    """The top-level timing rows (3-space indent: not the sweeps) of a raw decode GPU log such as
    data/gpu_tests/nvidia-h200-decode-run2.txt: config, variant, us, GB/s. None if the file is missing."""
    lines = _log_lines(path)
    if lines is None:
        return None
    rows, config = [], None
    for line in lines:
        if m := _CONFIG.match(line):
            config = m.group(1)
        elif config and (m := _ROW.match(line)):
            rows.append({"config": config, "variant": m.group(1).strip(), "us": float(m.group(2)),
                         "gbps": float(m.group(3))})
    return pd.DataFrame(rows) if rows else None


_GRAPH_ROW = re.compile(r"^B(\d+) Hkv(\d+) Nk(\d+) (sdpa-\S+|attnlab \S+)\s+([\d.]+) us")


def parse_graph_profile(path: str | Path, *, Hq: int = 32, D: int = 128, itemsize: int = 2) -> pd.DataFrame | None:
    """The GPU-only decode times of a scripts/decode_profile.py log (CUDA-graph replay, so no host time in
    them): config, variant, us, and GB/s of K/V read recomputed from the shape. None if the file is missing."""
    def row(m: re.Match) -> dict:
        B, Hkv, Nk = (int(m.group(i)) for i in (1, 2, 3))
        us = float(m.group(5))
        return {"config": config_label(B, Hq, Hkv, Nk), "variant": m.group(4).replace("attnlab ", ""), "us": us,
                "gbps": 2 * B * Hkv * Nk * D * itemsize / (us * 1e-6) / 1e9}

    return _matched_rows(path, _GRAPH_ROW, row)


_CEILING_SIZE = re.compile(r"^B(\d+) Hkv(\d+) Nk(\d+)k \((\d+) MiB\), TB/s: torch\.sum ([\d.]+)")
_CEILING_ROW = re.compile(r"^\s+(\d+/\d+/\d+) P(\d+) ([\d.]+)us ([\d.]+)( BAD)?$")


def parse_read_ceiling(path: str | Path, *, Hq: int = 32) -> pd.DataFrame | None:
    """The reads of a scripts/read_ceiling.py log (data/gpu_tests/nvidia-h200-read-ceiling.txt): per config,
    ``bytes`` (the K/V bytes of that decode shape), ``reader`` (``torch.sum`` or ``stream
    chunk/warps/stages P<programs>``), ``us`` (CUDA-graph replay), ``tbps`` and ``ok`` (the sum agreed with
    float64). None if the file is missing."""
    lines = _log_lines(path)
    if lines is None:
        return None
    rows, config, nbytes = [], None, 0
    for line in lines:
        if m := _CEILING_SIZE.match(line):
            B, Hkv, Nk = int(m.group(1)), int(m.group(2)), int(m.group(3)) * 1024
            config, nbytes, tbps = config_label(B, Hq, Hkv, Nk), int(m.group(4)) * 2**20, float(m.group(5))
            rows.append({"config": config, "bytes": nbytes, "reader": "torch.sum", "us": nbytes / tbps / 1e6,
                         "tbps": tbps, "ok": True})
        elif (m := _CEILING_ROW.match(line)) and config is not None:
            rows.append({"config": config, "bytes": nbytes, "reader": f"stream {m.group(1)} P{m.group(2)}",
                         "us": float(m.group(3)), "tbps": float(m.group(4)), "ok": m.group(5) is None})
    return pd.DataFrame(rows) if rows else None


def ceiling_table(graph: pd.DataFrame, reads: pd.DataFrame) -> pd.DataFrame:
    """Per config in both logs: the fastest correct pure read of its K/V bytes (:func:`parse_read_ceiling`)
    against attnlab's decode and SDPA's cuDNN kernel on those bytes (:func:`parse_graph_profile`), all GPU time
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


def _matched_rows(path: str | Path, pattern: re.Pattern, row) -> pd.DataFrame | None:
    """``row(match)`` of every line of the log at ``path`` that ``pattern`` matches, as a frame; None if the file
    is missing or no line matches."""
    lines = _log_lines(path)
    if lines is None:
        return None
    rows = [row(m) for line in lines if (m := pattern.match(line))]
    return pd.DataFrame(rows) if rows else None


_AB_ROW = re.compile(r"^B(\d+) Hkv(\d+) Nk(\d+) \| (merge-in-split|merge-kernel|sdpa-\S+) \| ([\d.]+) \| (\d+) \| "
                     r"([\d.]+) \| ([\d.]+) \|")


def parse_merge_ab(path: str | Path, *, Hq: int = 32) -> pd.DataFrame | None:
    """The rows of a merge A/B log (data/gpu_tests/nvidia-h200-merge-ab-87c02c2.txt): the split states merged
    by the split kernel itself (``merge-in-split``: one launch a call) or by a second kernel (``merge-kernel``),
    beside SDPA, per config: ``graph_us`` (CUDA-graph replay: the GPU alone), ``gbps`` of K/V read,
    ``stream_us`` (back-to-back calls: host and GPU overlapped) and ``host_us`` (the host alone). None if the
    file is missing."""
    def row(m: re.Match) -> dict:
        B, Hkv, Nk = (int(m.group(i)) for i in (1, 2, 3))
        return {"config": config_label(B, Hq, Hkv, Nk), "way": m.group(4), "graph_us": float(m.group(5)),
                "gbps": float(m.group(6)), "stream_us": float(m.group(7)), "host_us": float(m.group(8))}

    return _matched_rows(path, _AB_ROW, row)


_PDL_ROW = re.compile(r"^B(\d+) Hkv(\d+) Nk(\d+): (.*) \| bitwise equal (True|False)$")
_PDL_PART = re.compile(r"(cudnn|pdl=[01]) graph +([\d.]+) events +([\d.]+)")


def parse_pdl_ab(path: str | Path, *, Hq: int = 32) -> pd.DataFrame | None:
    """The rows of a PDL A/B log (data/gpu_tests/nvidia-h200-decode-pdl-ab.txt): per config and way (``cudnn``,
    ``pdl=0``: the merge as a plain second launch, ``pdl=1``: by programmatic dependent launch), ``graph_us``
    (CUDA-graph replay) and ``events_us`` (event-timed public calls back to back), and whether both launches'
    outputs were equal bit for bit. None if the file is missing."""
    lines = _log_lines(path)
    if lines is None:
        return None
    rows = []
    for m in filter(None, map(_PDL_ROW.match, lines)):
        B, Hkv, Nk = (int(m.group(i)) for i in (1, 2, 3))
        rows += [{"config": config_label(B, Hq, Hkv, Nk), "way": way, "graph_us": float(g), "events_us": float(e),
                  "equal": m.group(5) == "True"} for way, g, e in _PDL_PART.findall(m.group(4))]
    return pd.DataFrame(rows) if rows else None


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
_DEEP_CASE = re.compile(r"^bf16_b(\d+)_hq(\d+)_hkv(\d+)_nk(\d+)_d\d+(_kvlen)?\s+(.*)$")
_DEEP_CELL = re.compile(r"^(?:default S=(\d+)|cudnn|(\d+)/(\d+)/(\d+) S(\d+)(?: p(\d+))?) ([\d.]+)( BAD| DIFFERS)?$")


def parse_deep_sweep(path: str | Path) -> pd.DataFrame | None:
    """The cells of a scripts/decode_deep_sweep.py log (data/gpu_tests/nvidia-h200-decode-deep-sweep-2.txt):
    per config (``ragged``: seeded kv_len), ``variant`` (``default``, ``cudnn`` or ``block_n/warps/stages``),
    split count ``S`` (None for cuDNN), ``paged`` block size (0: the contiguous cache), ``us`` (CUDA-graph
    replay) and ``ok`` (the output agreed). None if the file is missing."""
    lines = _log_lines(path)
    if lines is None:
        return None
    rows = []
    for m in filter(None, map(_DEEP_CASE.match, lines)):
        B, Hq, Hkv, Nk = (int(m.group(i)) for i in (1, 2, 3, 4))
        label = config_label(B, Hq, Hkv, Nk) + (" ragged" if m.group(5) else "")
        for cell in m.group(6).split(" | "):
            c = _DEEP_CELL.match(cell.strip())
            if c is None:
                continue
            if c.group(1):
                variant, S = "default", int(c.group(1))
            elif c.group(2):
                variant, S = f"{c.group(2)}/{c.group(3)}/{c.group(4)}", int(c.group(5))
            else:
                variant, S = "cudnn", None
            rows.append({"config": label, "variant": variant, "S": S, "paged": int(c.group(6) or 0),
                         "us": float(c.group(7)), "ok": c.group(8) is None})
    return pd.DataFrame(rows) if rows else None


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
