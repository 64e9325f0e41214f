"""Tables and generated sentences of notebook 08 (performance), all from the recorded suites in ``data/bench/``.

Every function takes the DataFrames of :func:`attnlab.bench.plots.load_bench` (or None) and returns a table
or a string; nothing is timed here. Ratios are computed from unrounded values and rounded only for display.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pandas as pd

from attnlab.bench import plots as bench_plots


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def recorded_path(df: pd.DataFrame) -> str:
    """How a suite was timed: "public" (through ``attnlab.attention``, the ``path`` column), or the older
    validate-once kernel path for suites recorded before the ``path`` column existed (empty ``path``)."""
    if "path" not in df or df["path"].isna().all() or (df["path"].astype(str).str.strip() == "").all():
        return "validate-once kernel path (no path column)"
    paths = df["path"].fillna("").astype(str).str.strip()
    named = sorted(p for p in paths.unique() if p)
    # a suite that kept an older run's rows (--keep-others): those rows have no path
    return ", ".join(named + (["validate-once kernel path (older rows, no path)"] if (paths == "").any() else []))


def suites_table(found: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per recorded suite: commit, date, how it was timed, the modes timed."""
    rows = []
    for s, df in found.items():
        env = bench_plots.bench_environment(s)
        modes = sorted({str(m).strip() for m in df["mode"].dropna()} - {""}) if "mode" in df else []
        rows.append({"suite": s, "commit": env.get("commit", "?")[:7], "date (UTC)": env.get("date_utc", "?")[:16],
                     "timed through": recorded_path(df), "modes": ", ".join(modes) or "fwd",
                     "host_us": "host_us" in df and df["host_us"].notna().any()})
    return pd.DataFrame(rows).set_index("suite")


def with_ratios(t: pd.DataFrame, baseline: str, backends: Iterable[str], decimals: int = 2) -> pd.DataFrame:
    """``t`` (a :func:`bench_plots.summary` pivot, unrounded) with ``b / baseline`` columns, the ratios taken
    before any rounding and every column rounded for display afterwards."""
    ratios = {f"{b} / {baseline}": t[b] / t[baseline] for b in backends if b in t and b != baseline}
    return t.round(1).assign(**{k: v.round(decimals) for k, v in ratios.items()})


def latency_table(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """Latency suite: per case and backend, the time per call (``call_us``: the median of CUDA events around
    back-to-back calls, the device's time when the host keeps up, the host's when it does not) and the host's
    time per call (``host_us``)."""
    if df is None:
        return None
    d = _ok(df).copy()
    d["call_us"] = 1e3 * d["ms"]
    t = d.pivot_table(index="case", columns="backend", values=["call_us", "host_us"], aggfunc="median")
    order = list(dict.fromkeys(df["case"]))
    return t.reindex([c for c in order if c in t.index]).round(0)


def ratio_range(df: pd.DataFrame | None, backend: str, baseline: str) -> tuple[float, float] | None:
    """The smallest and largest speed ratio of ``backend`` to ``baseline`` over the cases both timed
    (> 1: faster), from :func:`speed_ratios`."""
    r = speed_ratios(df, backend, baseline)
    return (float(r.min()), float(r.max())) if len(r) else None


def backward_table(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """Backward suite: TFLOP/s per (shape, backend) for fwd, bwd and fwd+bwd; a status where nothing was timed.

    Shapes with no timed row at all are left out and named in ``.attrs["untimed_shapes"]``."""
    if df is None:
        return None
    d = df.copy()
    d["shape"] = d["case"].str.replace(r"_(fwd|bwd|fwdbwd)$", "", regex=True)
    tf = d.pivot_table(index=["shape", "backend"], columns="mode", values="tflops", aggfunc="median")
    st = d.pivot_table(index=["shape", "backend"], columns="mode", values="status", aggfunc="first")
    cols = [c for c in ("fwd", "bwd", "fwd+bwd") if c in st]
    timed = d.loc[d["status"] == "ok", "shape"].unique()
    keep = st.index.get_level_values("shape").isin(timed)
    out = tf.reindex(index=st.index, columns=cols).round(1).astype(object)
    out = out.where(out.notna(), st[cols])[keep]
    out.attrs["untimed_shapes"] = sorted(set(d["shape"]) - set(timed))
    return out


def decode_peaks(df: pd.DataFrame | None, backends: Iterable[str]) -> pd.DataFrame | None:
    """Decode: per backend, its best K/V bandwidth (TB/s) and the configuration where it was reached."""
    if df is None:
        return None
    ok = _ok(df)
    ok = ok[ok["backend"].isin(list(backends)) & ok["gbps"].notna()]
    if ok.empty:
        return None
    best = ok.loc[ok.groupby("backend")["gbps"].idxmax()]
    return pd.DataFrame({"backend": best["backend"], "TB/s": best["gbps"] / 1e3,
                         "config": bench_plots.decode_config_label(best)}).set_index("backend")


def _rng(values, fmt: str = "{:.0f}") -> str:
    lo, hi = min(values), max(values)
    a, b = fmt.format(lo), fmt.format(hi)
    return a if a == b else f"{a}-{b}"


def tflops_of(df: pd.DataFrame | None, backend: str) -> pd.Series:
    """TFLOP/s of ``backend`` per case of a recorded suite (ok rows; empty without data)."""
    if df is None:
        return pd.Series(dtype=float)
    ok = _ok(df)
    return ok[ok["backend"] == backend].set_index("case")["tflops"]


def speed_ratios(df: pd.DataFrame | None, backend: str, baseline: str) -> pd.Series:
    """Per case ``baseline_ms / backend_ms`` over the cases both timed (unrounded; > 1: ``backend`` is
    faster; empty without data)."""
    if df is None:
        return pd.Series(dtype=float)
    ok = _ok(df)
    a = ok[ok["backend"] == backend].set_index("case")["ms"]
    b = ok[ok["backend"] == baseline].set_index("case")["ms"]
    both = a.index.intersection(b.index)
    return b.loc[both] / a.loc[both]


def dense_split(df: pd.DataFrame | None) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """The dense suite as (its grid of full and causal configs, its sliding-window rows); a suite recorded
    before the window row has none."""
    if df is None:
        return None, None
    if "window" not in df:
        return df, df.iloc[:0]
    banded = df["window"].notna() & (df["window"].astype(str).str.len() > 0)
    return df[~banded], df[banded]


def takeaways(data: Mapping[str, pd.DataFrame | None], *, copy_tbps: float, read_tbps: float | None = None) -> str:
    """The takeaways of notebook 08 as Markdown, every figure computed from the recorded suites."""
    out = []
    dense, window = dense_split(data.get("dense"))
    if dense is not None:
        tri, cud, fa = tflops_of(dense, "triton"), tflops_of(dense, "sdpa-cudnn"), tflops_of(dense, "sdpa-flash")
        r_fa, r_cud = speed_ratios(dense, "triton", "sdpa-flash"), speed_ratios(dense, "triton", "sdpa-cudnn")
        tb = speed_ratios(dense, "torch", "sdpa-flash")
        cuda = {k: tflops_of(dense, f"cuda-{k}") for k in ("naive", "tiled", "rowmax")}
        out.append(
            f"* **Dense bf16/fp16** ({len(r_fa)} configs): cuDNN median {cud.median():.0f} TFLOP/s (up to "
            f"{cud.max():.0f}), attnlab's Triton kernel median {tri.median():.0f} (up to {tri.max():.0f}), "
            f"FlashAttention-2 median {fa.median():.0f}. Triton against FlashAttention-2: a median "
            f"{r_fa.median():.2f}x, {_rng(r_fa, '{:.2f}')}x over the configs; against cuDNN a median "
            f"{r_cud.median():.2f}x. The textbook version: {_rng(tflops_of(dense, 'torch'))} TFLOP/s (a median "
            f"{tb.median():.2f}x FlashAttention-2), memory-bound as notebook 01 predicts. attnlab's CUDA kernels "
            + ", ".join(f"{k} {_rng(v, '{:.1f}')}" for k, v in cuda.items() if len(v))
            + " TFLOP/s: float32 arithmetic on CUDA cores, there to be read and measured.")
    if window is not None and len(speed_ratios(window, "triton", "flex")):
        out.append(f"* **Sliding window** (N 16384, 1024 keys): Triton {_rng(tflops_of(window, 'triton'))} "
                   f"TFLOP/s, {_rng(speed_ratios(window, 'triton', 'flex'), '{:.2f}')}x compiled FlexAttention with "
                   "its block mask.")
    pad = data.get("padding")
    if pad is not None:
        r_flex = speed_ratios(pad, "triton", "flex")
        parts = [f"{b} {_rng(speed_ratios(pad, 'triton', b), '{:.1f}')}x" for b in ("sdpa-cudnn", "sdpa-efficient")
                 if len(speed_ratios(pad, "triton", b))]
        n_ragged = pad.loc[pad["case"].str.contains("ragged"), "case"].nunique()
        out.append(
            f"* **Padding** ({len(r_flex)} cases, {n_ragged} of them ragged with `q_len = kv_len`; useful FLOPs): "
            "Triton "
            f"{_rng(tflops_of(pad, 'triton'))} TFLOP/s, {_rng(r_flex, '{:.2f}')}x compiled FlexAttention "
            f"({_rng(tflops_of(pad, 'flex'))}); against SDPA fed a materialized mask: " + ", ".join(parts) + ".")
    pre = data.get("prefill")
    if pre is not None:
        out.append(
            f"* **Prefill** (bottom-right causal): Triton {_rng(tflops_of(pre, 'triton'))} TFLOP/s, "
            f"{_rng(speed_ratios(pre, 'triton', 'sdpa-flash'), '{:.2f}')}x FlashAttention-2 and "
            f"{_rng(speed_ratios(pre, 'triton', 'sdpa-cudnn'), '{:.2f}')}x cuDNN.")
    dec = data.get("decode")
    if dec is not None:
        ours = "triton-decode" if (dec["backend"] == "triton-decode").any() else "triton"
        peaks = decode_peaks(dec, ["sdpa-flash", "sdpa-cudnn", ours])
        r = speed_ratios(dec, ours, "sdpa-flash")
        rc = speed_ratios(dec, ours, "sdpa-cudnn")
        above = [b for b in peaks.index if peaks.loc[b, "TB/s"] > copy_tbps]
        text = ("* **Decode** is bandwidth: best K/V read rates " + ", ".join(
            f"{b} {peaks.loc[b, 'TB/s']:.2f} TB/s ({peaks.loc[b, 'config']})" for b in peaks.index)
            + f"; `{ours}` a median {r.median():.2f}x FlashAttention-2 ({_rng(r, '{:.2f}')}x over the "
            f"configurations it runs) and {rc.median():.2f}x cuDNN ({_rng(rc, '{:.2f}')}x).")
        if above:
            text += (f" {' and '.join(above)} read faster than the {copy_tbps:g} TB/s measured for a device "
                     "copy: that figure is a measured copy rate (a copy reads and writes), not a ceiling "
                     "for a read-only stream.")
        if read_tbps is not None:
            best = peaks["TB/s"].max()
            text += (f" The best, {best:.2f} TB/s, is {best / read_tbps:.0%} of the {read_tbps:g} TB/s measured "
                     "for a read-only stream" + (" (above it: the stream roofs.py measured is not the ceiling "
                     "either)" if best > read_tbps else "") + ".")
        out.append(text)
    fp32 = data.get("fp32")
    if fp32 is not None:
        cases = [c for c in dict.fromkeys(_ok(fp32)["case"])]
        cells = []
        for b in ("triton", "cuda-rowmax", "torch"):
            t, r = tflops_of(fp32, b), speed_ratios(fp32, b, "sdpa-efficient")
            if len(t):
                cells.append(f"{b} " + " and ".join(f"{t[c]:.1f}" for c in cases if c in t) + " TFLOP/s ("
                             + " and ".join(f"{r[c]:.2f}x" for c in cases if c in r) + ")")
        out.append(f"* **IEEE float32** (TF32 off; ratios to SDPA's efficient kernel, cases {', '.join(cases)}): "
                   + "; ".join(cells) + ".")
    mem = data.get("memory")
    if mem is not None:
        ok = _ok(mem)
        t = ok[ok["backend"] == "torch"].set_index("Nk")["peak_extra_mib"]
        oom = sorted(mem[(mem["backend"] == "torch") & (mem["status"] == "oom")]["Nk"])
        fa = ok[ok["backend"] == "sdpa-flash"].set_index("Nk")["peak_extra_mib"]
        out.append(
            f"* **Memory**: the textbook version needs {t.iloc[0]:.0f} MiB beyond inputs and output at "
            f"{t.index[0]} tokens and {t.iloc[-1] / 1024:.0f} GiB at {t.index[-1]}"
            + (f", and runs out at {oom[0]}" if oom else "")
            + f"; FlashAttention-2 only its float32 lse ({fa.iloc[-1]:.0f} MiB at {fa.index[-1]}).")
    lat = data.get("latency")
    if lat is not None:
        ok = _ok(lat)
        med = ok.groupby("backend")["host_us"].median()
        out.append("* **Latency** (small shapes, host time per call, median over the cases): " + ", ".join(
            f"{b} {med[b]:.0f} µs" for b in ("triton", "triton-kernel", "auto", "sdpa-flash", "sdpa-cudnn",
                                             "sdpa-efficient") if b in med)
                   + (": through the public call the Triton path costs more host time per call than each of "
                      "SDPA's kernels." if "triton" in med and all(med["triton"] > med[b] for b in
                      ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient") if b in med) else "."))
    bias = data.get("bias")
    if bias is not None and len(speed_ratios(bias, "triton", "sdpa-cudnn")):
        r = speed_ratios(bias, "triton", "sdpa-cudnn")
        out.append(f"* **Bias** (ALiBi-style float bias with causal): Triton {tflops_of(bias, 'triton').iloc[0]:.0f} "
                   f"TFLOP/s, {r.iloc[0]:.2f}x cuDNN fed the bias.")
    bwd = data.get("backward")
    if bwd is not None:
        fb = _ok(bwd)[_ok(bwd)["mode"] == "fwd+bwd"]
        shapes = sorted(fb["case"].unique())
        parts = []
        for c in shapes:
            g = fb[fb["case"] == c].set_index("backend")["ms"]
            if "triton" in g:
                parts.append(c.removesuffix("_fwdbwd") + ": " + ", ".join(
                    f"{g[b] / g['triton']:.2f}x {b}" for b in ("sdpa-flash", "sdpa-cudnn", "flex") if b in g))
        skipped = int((bwd["status"] == "skipped").sum())
        out.append("* **Backward** (forward + backward, Triton's speed relative to each): " + "; ".join(parts)
                   + (f". {skipped} rows of the suite were skipped and are not timed." if skipped else "."))
    return "\n".join(out)


def _value(t: pd.DataFrame, backend: str, column: str) -> float:
    """``t.loc[backend, column]`` as a float, NaN where the row or the column is missing."""
    return float(t.loc[backend, column]) if backend in t.index and column in t else float("nan")


def small_n_verdict(df: pd.DataFrame | None, *, public: str = "triton", kernel: str = "triton-kernel") -> str:
    """Whether "for N of a few hundred just use SDPA" holds in the latency suite: per case, SDPA's fastest
    kernel (``sdpa-*``) against attnlab's public call by time per call (median ms: what a caller waits), with
    the public call's host time, and what the ``kernel`` row is. The suite records no device time of its own
    (the time per call is the host's whenever the host is the slower), so nothing is said of the kernels
    alone. A sentence built from whatever the CSV holds."""
    if df is None or not len(df):
        return "No latency suite recorded: nothing to judge."
    ok = _ok(df)
    rows = []
    for case, d in ok.groupby("case", sort=False):
        t = d.set_index("backend")
        sd = t[t.index.str.startswith("sdpa")]
        if public not in t.index or sd.empty:
            continue
        rows.append({"case": case, "N": int(t["Nk"].iloc[0]), "sdpa_ms": float(sd["ms"].min()),
                     "public_ms": float(t.loc[public, "ms"]), "public_host_us": _value(t, public, "host_us"),
                     "kernel_host_us": _value(t, kernel, "host_us")})
    if not rows:
        return "The latency suite holds no case with both SDPA and attnlab timed."
    r = pd.DataFrame(rows)
    sdpa_wins = int((r["sdpa_ms"] <= r["public_ms"]).sum())
    ratio = r["public_ms"] / r["sdpa_ms"]
    holds = sdpa_wins == len(r)
    text = (f"Over the {len(r)} latency cases (N from {r['N'].min()} to {r['N'].max()}), SDPA's fastest kernel "
            f"beats attnlab's public call in {sdpa_wins}: the public call takes {ratio.min():.2f}x to "
            f"{ratio.max():.2f}x SDPA's time (median host time {r['public_host_us'].median():.0f} µs per call). ")
    kh = r["kernel_host_us"].dropna()
    if len(kh):
        slower = ", and it is slower than the public call" if kh.median() > r["public_host_us"].median() else ""
        text += (f"The `{kernel}` row is not the bare kernel{slower}: it validates "
                 f"a Problem once, then calls the backend's forward, which rebuilds its launch plan's key from the "
                 f"Problem and launches through Triton's launcher object on every call ({kh.median():.0f} µs of "
                 f"host time per call, median), while a repeated public call finds its cached fast call by "
                 f"signature and calls the compiled kernel's C launch directly "
                 f"({r['public_host_us'].median():.0f} µs). The suite times no kernel alone, so this verdict "
                 "is about calls. ")
    return text + "Verdict: " + ("it holds; for N of a few hundred, call SDPA." if holds else
                                 "it holds only in part; SDPA is not faster in every case here.")
