"""The CUDA blog's float32 story measured on the recorded GPU: its timing table beside the fp32 suite
(``data/bench/<gpu>/fp32.csv``), the fair float32 comparison, where the tiled and rowmax kernels differ
(a per-score work model read from their sources) and the rowmax kernel's optimization ladder
(``data/notes/rowmax_ladder.csv``). Nothing is timed here; every number comes from a file or a model.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from attnlab.paths import data_file

#: The blog's table: time relative to its rowmax kernel, one Ampere GPU, B1 H8 N1024 D64 causal, float32,
#: a single run (the blog's own caveat). attnlab's backend that implements each row.
BLOG_FP32 = {"torch": 4.0, "cuda-naive": 3.2, "cuda-tiled": 1.4, "cuda-rowmax": 1.0}
BLOG_ROWS = {"torch": "PyTorch by hand (scores, mask, softmax, @ V)",
             "cuda-naive": "naive kernel (three passes)",
             "cuda-tiled": "tiled, online softmax per element",
             "cuda-rowmax": "tiled, online softmax per tile (rowmax)"}
BLOG_CASE = "fp32_b1_h8_n1024_d64_causal"

#: The float32 contenders: attnlab's CUDA-core kernels and every float32 rival the fp32 suite timed.
FP32_BACKENDS = ("cuda-naive", "cuda-tiled", "cuda-rowmax", "triton", "torch", "sdpa-math", "sdpa-efficient",
                 "flex")

LADDER_PATH = ("notes", "rowmax_ladder.csv")
#: The ladder's case labels as the notebooks say them (the CSV keeps its short ones).
LADDER_CASES = {"seed": "blog's (B1 H8 N1024)", "large": "large (B8 H16 N2048)"}


def _ok(df: pd.DataFrame, case: str) -> pd.Series:
    d = df[(df["case"] == case) & (df["status"] == "ok")]
    return d.set_index("backend")["ms"].astype(float)


def blog_vs_gpu(fp32: pd.DataFrame, case: str = BLOG_CASE, gpu_alone: pd.Series | None = None) -> pd.DataFrame:
    """The blog's table beside the recorded suite: per implementation, the blog's time relative to rowmax;
    with ``gpu_alone`` (backend -> time over rowmax's in GPU time alone, e.g. graph replay), that ratio, the one
    to compare with the blog's; the recorded time (ms: the median of the public call, host included), that time
    relative to ``cuda-rowmax`` (unrounded), the host's time per call (us), whether the call was host-bound (the
    host took at least 80% of the call's time: the GPU waited for it) and the peak memory beyond the output
    (MiB)."""
    d = fp32[(fp32["case"] == case) & (fp32["status"] == "ok")].set_index("backend")
    ms = d["ms"].astype(float)
    rows = []
    for b, rel in BLOG_FP32.items():
        t = ms.get(b)
        host = _column(d, b, "host_us")
        alone = {} if gpu_alone is None else {"GPU alone (x rowmax)": gpu_alone.get(b)}
        rows.append({"implementation": BLOG_ROWS[b], "attnlab backend": b, "blog (x rowmax)": rel, **alone,
                     "public call ms": t, "public call (x rowmax)": None if t is None else t / ms["cuda-rowmax"],
                     "host us": host, "host-bound": None if host is None or t is None else host >= 0.8 * t * 1e3,
                     "peak extra MiB": _column(d, b, "peak_extra_mib")})
    return pd.DataFrame(rows).set_index("implementation")


def _column(d: pd.DataFrame, backend: str, column: str) -> float | None:
    """A backend's value of a suite column, or None where the row or the column is missing or empty."""
    if backend not in d.index or column not in d.columns or pd.isna(d.loc[backend, column]):
        return None
    return float(d.loc[backend, column])


def order_story(blog: pd.DataFrame) -> dict:
    """How the recorded order of the blog's four implementations compares with the blog's: both orders
    (fastest first), whether they agree, and whether the naive kernel is slower than the PyTorch code on
    each side (the blog's troubleshooting table: a kernel slower than PyTorch has no tiling). The recorded
    side is GPU time alone where the table has it (``column``), else the public call's."""
    column = "GPU alone (x rowmax)" if "GPU alone (x rowmax)" in blog else "public call (x rowmax)"
    rec, pub = blog[column].astype(float), blog["blog (x rowmax)"]
    if rec.isna().any():
        missing = blog.loc[rec.isna(), "attnlab backend"].tolist()
        raise ValueError(f"the recorded suite has no time for {missing}: no order to compare")
    names = blog["attnlab backend"]
    rec_order = [names.iloc[i] for i in rec.argsort()]
    pub_order = [names.iloc[i] for i in pub.argsort()]
    naive, torch_row = BLOG_ROWS["cuda-naive"], BLOG_ROWS["torch"]
    return {"column": column, "recorded": rec_order, "blog": pub_order, "same": rec_order == pub_order,
            "naive slower than PyTorch (recorded)": bool(rec[naive] > rec[torch_row]),
            "naive slower than PyTorch (blog)": bool(pub[naive] > pub[torch_row])}


def fair_fp32(fp32: pd.DataFrame) -> pd.DataFrame:
    """Every float32 backend of the suite per case: ms, TFLOP/s and speed relative to ``sdpa-efficient``
    (> 1: faster); backends that could not run float32 are named in ``.attrs["unsupported"]``."""
    d = fp32[fp32["backend"].isin(FP32_BACKENDS) & (fp32["status"] == "ok")].copy()
    base = d[d["backend"] == "sdpa-efficient"].set_index("case")["ms"]
    d["x sdpa-efficient"] = d["case"].map(base) / d["ms"]
    t = d.pivot_table(index="backend", columns="case", values=["ms", "tflops", "x sdpa-efficient"])
    t = t.reindex([b for b in FP32_BACKENDS if b in t.index])
    bad = fp32[fp32["status"] != "ok"]
    t.attrs["unsupported"] = {b: str(n).split("(Triggered")[0].strip(" .;")
                              for b, n in zip(bad["backend"], bad["notes"])}
    return t


def ladder(path: Path | str | None = None) -> pd.DataFrame:
    """The rowmax ladder, one row per step: the change, the case, kernel time before and after (ms), the
    speedup (before / after) and whether it was taken."""
    d = pd.read_csv(path or data_file(*LADDER_PATH), dtype={"step": str})
    d["speedup"] = d["before_ms"] / d["after_ms"]
    d["case_label"] = d["case"].map(LADDER_CASES).fillna(d["case"])
    return d


def work_per_score(family: str, D: int = 64) -> dict[str, float]:
    """Instructions per score (one query row, one key) summed over the threads that share the score, for
    D = 64 float32 as the kernels' sources do it: a model, not a measurement.

    tiled: 8 threads per row each hold D / 8 dims: scalar shared loads (one per FMA), 3 shuffles to sum
    the dot product, and every one of the 8 runs the row's softmax update (2 exps) and rescales its slice
    of acc (one multiply per dim). rowmax: 4 x 4 register blocks fed by 16-byte shared loads (8 FMAs per
    load), one exp per score, the tile's rescale (one alpha per row and thread, one multiply per dim)
    shared by the 64 keys of a tile, 4 shuffles per row and tile for the tile max. naive: one warp per
    key, each lane 2 of 64 dims and 5 shuffles per dot product; the three passes compute every score
    three times and its exp twice on all 32 lanes; nothing is shared, so K and V come from L2 or HBM.
    The last entry counts K and V elements loaded from global memory per score (each tile is shared by
    16 or 64 query rows).
    """
    if family == "naive":  # one warp per key: 2 dims per lane, 5 shuffles; 3 passes recompute the score
        passes, lanes = 3, 32
        return {"FMA (QK^T + PV)": passes * D + D, "rescale multiplies": 0, "shared-memory loads": 0,
                "exp": 2 * lanes, "shuffles": passes * 5 * lanes, "global/L2 loads of K, V": passes * D + D}
    if family == "tiled":
        group = 8
        return {"FMA (QK^T + PV)": 2 * D, "rescale multiplies": D, "shared-memory loads": 2 * D,
                "exp": 2 * group, "shuffles": 3 * group,
                "global/L2 loads of K, V": 2 * D / 16}
    if family == "rowmax":
        bm = bn = 64
        threads, tm, threads_per_row = 256, 4, 16
        return {"FMA (QK^T + PV)": 2 * D, "rescale multiplies": bm * D / (bm * bn),
                "shared-memory loads": 2 * D / 8, "exp": 1 + threads_per_row / bn,
                "shuffles": threads * tm * 4 / (bm * bn), "global/L2 loads of K, V": 2 * D / bm}
    raise ValueError(f"no work model for {family!r}; one of 'naive', 'tiled', 'rowmax'")


def tiled_rowmax_split(fp32: pd.DataFrame, lad: pd.DataFrame, case: str = "fp32_b8_h16_n2048_d64_causal") -> dict:
    """How far the recorded tiled -> rowmax gap is covered by the ladder's measured steps (large case).

    ``gap``: tiled / rowmax in the suite; ``ladder``: the large case's first 'before' over the last taken
    step's 'after' (the rowmax kernel before cp.async, key splits and unrolling, against after);
    ``rest``: gap / ladder, the part no recorded ablation separates (rows per tile, register outer
    products, exp count). The ladder and the suite are different runs, so the split is approximate."""
    ms = _ok(fp32, case)
    big = lad[(lad["case"] == "large") & (lad["taken"] == "yes")].dropna(subset=["after_ms"])
    first, last = float(big["before_ms"].iloc[0]), float(big["after_ms"].iloc[-1])
    gap = float(ms["cuda-tiled"] / ms["cuda-rowmax"])
    return {"gap": gap, "ladder": first / last, "rest": gap / (first / last), "before_ms": first,
            "after_ms": last, "tiled_ms": float(ms["cuda-tiled"]), "rowmax_ms": float(ms["cuda-rowmax"])}
