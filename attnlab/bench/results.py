"""Files: CSV rows and the environment JSON beside them, reading them back (:func:`load`), and the one
:func:`ratios` of recorded runs."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from attnlab.bench.schema import COLUMNS
from attnlab.bench.truth import l2_bytes

# ---------------------------------------------------------------------------------------------------------
# Files: CSV, JSON, load, ratios
# ---------------------------------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the folder under data/bench)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def _cmd(args: Sequence[str], timeout: float = 10.0) -> str:
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
        return r.stdout.strip() if r.returncode == 0 else ""
    except Exception:
        return ""


def _version(mod: str) -> str:
    try:
        m = __import__(mod)
    except Exception as e:
        return f"not importable ({type(e).__name__})"
    return str(getattr(m, "__version__", "?"))


def _hopper_mode() -> str:
    """How the ``triton`` backend's forward used its Hopper kernel in this run (:mod:`hopper_forward`'s mode)."""
    from attnlab.backends.triton import hopper_forward as hopper

    return hopper.mode()


def _hopper_bands() -> str:
    """Which kernel narrow two-sided bands ran on in this run (:data:`hopper_forward.PORTABLE_BANDS`)."""
    from attnlab.backends.triton import hopper_forward as hopper

    if not hopper.NARROW_TO_PORTABLE:
        return "hopper kernel"
    return "portable kernel up to " + ", ".join(f"{w} keys at D {d}" for d, w in hopper.PORTABLE_BANDS.items())


def environment(device: str, argv: Sequence[str],
                prog: Sequence[str] = ("python", "-m", "attnlab", "bench")) -> dict[str, Any]:
    """The environment a result depends on: device, driver, library versions, commit, date, command (``prog``
    followed by ``argv``)."""
    from attnlab import __version__
    from attnlab import backends as _b

    root = Path(__file__).resolve().parents[2]
    commit = os.environ.get("ATTNLAB_COMMIT") or _cmd(["git", "-C", str(root), "rev-parse", "HEAD"]) or "unknown"
    dirty = None
    if commit != "unknown" and not os.environ.get("ATTNLAB_COMMIT"):
        dirty = bool(_cmd(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]))
    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": os.environ.get("ATTNLAB_BENCH_COMMAND") or shlex.join([*prog, *argv]),
        "attnlab": __version__,
        "commit": commit,
        "commit_dirty": dirty,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "triton": _version("triton"),
        "cupy": _version("cupy"),
        "device": device,
        "tf32_matmul_default": _tf32(),
        "hopper_forward": _hopper_mode(),
        "hopper_narrow_bands": _hopper_bands(),
    }
    if os.environ.get("ATTNLAB_BENCH_COMMAND"):
        env["restarted_as"] = shlex.join([*prog, *argv])
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        q = _cmd(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"])
        env.update(
            gpu=p.name, sm=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1), l2_bytes=l2_bytes(torch.device(device)),
            driver=q.split(",")[0].strip() if q else "unknown", nvidia_smi=q,
        )
    else:
        env.update(gpu="cpu", driver="none")
    env["backends"] = {n: repr(a) for n, a in _b.status().items()}
    return env


def _tf32() -> bool:
    from attnlab.check import tf32_enabled

    return tf32_enabled()


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.6g}"
    return v


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write rows with :data:`COLUMNS` (atomically: a temporary file renamed over the target)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c, "")) for c in COLUMNS})
    os.replace(tmp, path)


def read_rows(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


_BOOL_COLS = ("causal", "passed")
_INT_COLS = ("B", "Hq", "Hkv", "Nq", "Nk", "D", "reps", "sets")
_FLOAT_COLS = ("allowed_frac", "flops", "bytes", "ms", "ms_min", "ms_iqr", "tflops", "gbps", "peak_extra_mib",
               "setup_mib", "max_abs_err", "rel_l2", "base_max_abs", "host_us")


def load(paths: str | os.PathLike | Iterable[str | os.PathLike]):
    """Read benchmark CSVs into one pandas DataFrame with typed columns (:data:`COLUMNS`).

    ``paths``: a folder (every ``*.csv`` below it, e.g. ``data/bench`` or ``data/bench/nvidia-h200``), one
    CSV, or a list of either. ``passed`` and ``causal`` are pandas nullable booleans (``passed`` is <NA>
    when the output was never produced); numbers are floats (NaN where not measured). The JSON beside each
    CSV is in ``df.attrs["meta"]`` (path -> dict).
    """
    import pandas as pd

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        files += sorted(p.rglob("*.csv")) if p.is_dir() else [p]
    frames, meta = [], {}
    for f in files:
        frames.append(pd.read_csv(f, dtype=str, keep_default_na=False))
        j = f.with_suffix(".json")
        if j.exists():
            meta[str(f)] = json.loads(j.read_text())
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    for c in COLUMNS:
        if c not in df:
            df[c] = ""
    for c in _BOOL_COLS:
        df[c] = df[c].map({"True": True, "False": False, "true": True, "false": False}).astype("boolean")
    for c in _INT_COLS + _FLOAT_COLS:
        df[c] = pd.to_numeric(df[c].replace("", float("nan")), errors="coerce")
    for c in _INT_COLS:
        if df[c].notna().all():
            df[c] = df[c].astype("int64")
    df.attrs["meta"] = meta
    return df


def passed_rows(df):
    """Rows whose output passed the checker and that have a timing (``status == "ok"`` where recorded)."""
    import pandas as pd

    passed = df["passed"].astype(str).str.lower().isin(["true", "1", "1.0"])
    if "status" in df:
        passed = passed & (df["status"].astype(str) == "ok")
    return df[passed & pd.to_numeric(df["ms"], errors="coerce").notna()]


def mask_label(df):
    """Each row's mask kind for grouping: the ``mask`` column, else ``causal`` or ``dense``."""
    import numpy as np

    causal = df["causal"].astype(str).str.lower().isin(["true", "1", "1.0"])
    mask = df["mask"].fillna("").astype(str).replace({"nan": "", "none": "", "dense": ""})
    return np.where(mask != "", mask, np.where(causal, "causal", "dense"))


def pick_backend(df, *candidates: str) -> str | None:
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


def ratios(df, baseline: str = "sdpa-flash", metric: str = "ms", *, by: str = "suite",
           backends: Iterable[str] | None = None):
    """Median speed ratio of each backend to ``baseline`` (> 1: faster than the baseline), over the cases where
    both have an ``ok`` timing: ``baseline_ms / backend_ms`` (for ``metric="tflops"``, ``backend / baseline``:
    the same number when both did the same work).

    ``by="suite"``: a DataFrame indexed by suite with one column per backend, cases matched on (gpu, suite,
    case); ``.attrs["counts"]`` holds the number of cases behind each median. ``by="mask"``: indexed by
    backend with one column per mask kind (:func:`mask_label`), rows that passed the check, matched on the
    configuration columns, the baseline found by :func:`pick_backend`; None without data or baseline.
    ``backends`` keeps only those. ``.attrs["baseline"]``: the baseline used.
    """
    import pandas as pd

    if by == "mask":
        return _ratios_by_mask(df, baseline, metric, backends)
    if by != "suite":
        raise ValueError(f"by must be 'suite' or 'mask'; got {by!r}")
    ok = df[df["status"] == "ok"]
    key = ["suite", "case"]
    if "gpu" in ok:
        key = ["gpu", *key]
    base = ok[ok["backend"] == baseline].set_index(key)[metric]
    out, counts = {}, {}
    for (suite, backend), g in ok.groupby(["suite", "backend"], sort=False):
        if backends is not None and backend not in backends:
            continue
        mine = g.set_index(key)[metric]
        both = mine.index.intersection(base.index)
        if len(both) == 0:
            continue
        r = mine.loc[both] / base.loc[both] if metric == "tflops" else base.loc[both] / mine.loc[both]
        out.setdefault(backend, {})[suite] = float(r.median())
        counts.setdefault(backend, {})[suite] = len(both)
    res = pd.DataFrame(out)
    res.index.name = "suite"
    res.attrs["counts"] = pd.DataFrame(counts)
    res.attrs["baseline"] = baseline
    return res


def _ratios_by_mask(df, baseline: str, metric: str, backends: Iterable[str] | None):
    if df is None or len(df) == 0:
        return None
    d = passed_rows(df).copy()
    base = pick_backend(d, baseline) if len(d) else None
    if base is None:
        return None
    keys = [c for c in ("suite", "case", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "mask") if c in d]
    d["mask_kind"] = mask_label(d)
    b = d[d["backend"] == base][[*keys, metric]].rename(columns={metric: "base"})
    m = d.merge(b, on=keys, how="inner")
    if backends is not None:
        m = m[m["backend"].isin(list(backends))]
    m["ratio"] = m[metric] / m["base"] if metric == "tflops" else m["base"] / m[metric]
    out = m.groupby(["backend", "mask_kind"])["ratio"].median().unstack("mask_kind")
    out.attrs["baseline"] = base
    return out
