"""The forward's Hopper routes as recorded on the GPU (``tools/hopper_routes.py``): the public Triton call, the
same call with forced configs, TMA tensor-descriptor loads and triton's automatic warp specialization, each timed
beside cuDNN; Nsight Compute's view of attnlab's and cuDNN's forward kernels; the first measure of the
warp-specialized Gluon kernel (``attnlab/backends/triton/hopper_kernel.py``); the Gluon backward
(``hopper_bwd_kernel.py``) beside the portable one; and both Gluon kernels profiled beside cuDNN's. Nothing is
timed here.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd

from attnlab.paths import DATA_DIR

_DIR = DATA_DIR / "experiments" / "nvidia-h200"
#: The route runs (the warp-specialized kernels ran in a process of their own) and the profile.
ROUTE_FILES = (_DIR / "hopper-routes-e059209.json", _DIR / "hopper-routes-ws-e059209.json")
PROFILE_FILE = _DIR / "ncu-forward-causal-e059209.csv"
#: The Gluon kernel's first run: its checks against the float64 reference, then times beside cuDNN and the
#: portable kernel (docs/decisions.md, "The forward on Hopper: a warp-specialized Gluon kernel").
GLUON_FILE = _DIR / "hopper-gluon-first-e01d16c.json"
#: The Gluon backward as it is (an H100): the backward alone through the public call, beside the form before its
#: lse2 and Delta came by TMA, the portable backward and cuDNN's (docs/decisions.md, "The Hopper backward's lse2
#: and Delta by TMA"; its first run, "The Hopper backward", is ``hopper-bwd-3517dae.json``, the same format).
_H100 = DATA_DIR / "experiments" / "nvidia-h100-80gb-hbm3"
BACKWARD_FILE = _H100 / "hopper-bwd-rows-tma-b1c0c19.json"
#: ncu's profiles of the Gluon kernels beside cuDNN's (an H100, the GPU's own clocks; docs/decisions.md, "The
#: Hopper kernels beside cuDNN's, profiled"): the forward, full then causal; one causal backward, whole.
GLUON_PROFILE_FILE = _H100 / "ncu-forward-a7a2405.csv"
BACKWARD_PROFILE_FILE = _H100 / "ncu-backward-causal-a7a2405.csv"

#: Route families by the prefix of their names in the files, as the notebook says them.
FAMILIES = {"triton": "public call, shipped config", "triton cfg": "public call, best forced config",
            "tma ws=False": "TMA loads", "tma ws=True": "TMA loads + warp specialization"}
#: The profile's metrics the notebook shows, by (section, metric) in ncu's export.
PROFILE_METRICS = {
    ("GPU Speed Of Light Throughput", "Duration"): "duration (ns)",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "SM busy (%)",
    ("Compute Workload Analysis", "Executed Ipc Active"): "instructions per active cycle",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"): "cycles per issued instruction",
    ("Occupancy", "Achieved Occupancy"): "achieved occupancy (%)",
    ("Occupancy", "Theoretical Active Warps per SM"): "warps per SM (theoretical)",
}


def _family(route: str) -> str | None:
    if route == "triton":
        return FAMILIES["triton"]
    if route.startswith("triton cfg"):
        return FAMILIES["triton cfg"]
    if route.startswith("tma"):
        return FAMILIES["tma ws=True" if route.endswith("ws=True") else "tma ws=False"]
    return None


def routes(paths: tuple[Path | str, ...] = ROUTE_FILES) -> pd.DataFrame | None:
    """The best route of each family per case by its ratio to cuDNN's time in the same run (``x cudnn``: above
    1 is faster than cuDNN; each file is one run), with its config, time and TFLOP/s; None when the files are
    absent. Routes that failed (the compiler refused, or the checker did) count in ``failed``."""
    runs = []
    for i, p in enumerate(map(Path, paths)):
        if not p.exists():
            return None
        run = pd.DataFrame(json.loads(p.read_text())["rows"]).assign(run=i)
        cudnn = run[run["route"] == "sdpa-cudnn"].set_index("case")["ms"]
        runs.append(run.assign(**{"x cudnn": cudnn.reindex(run["case"]).to_numpy() / run["ms"].to_numpy()}))
    df = pd.concat(runs, ignore_index=True)
    df["family"] = df["route"].map(_family)
    mine = df[df["family"].notna()]
    ok = mine["passed"].astype(bool)
    failed = mine[~ok].groupby(["case", "family"]).size()
    best = mine[ok].sort_values("x cudnn", ascending=False).groupby(["case", "family"], sort=False).head(1)
    best = best.assign(config=best["route"].str.extract(r"cfg=(\([^)]*\))", expand=False).fillna("shipped"))
    out = best.set_index(["case", "family"])[["config", "ms", "tflops", "x cudnn"]]
    out["failed"] = failed.reindex(out.index).fillna(0).astype(int)
    order = {c: i for i, c in enumerate(dict.fromkeys(df["case"]))}
    fam = {f: i for i, f in enumerate(FAMILIES.values())}
    return out.sort_index(key=lambda ix: ix.map(order) if ix.name == "case" else ix.map(fam))


#: Kernel names in the profile by the prefix ncu reports, as the notebook says them.
PROFILE_KERNELS = {"attn_fwd_hopper": "attnlab (Gluon)", "attn_fwd_kernel": "attnlab (triton)",
                   "attn_bwd_hopper": "attnlab (Gluon backward)",
                   "cudnn_generated_fort_native_sdpa_sm90_flash_bprop": "cuDNN backward", "cudnn": "cuDNN"}
#: The raw metrics ``tools/hopper_routes.py``'s ncu command adds (section "Command line profiler metrics"). On
#: sm_90 the hmma pipe counts the warpgroup MMAs too (ncu 2025.3 reports no gmma pipe there).
TENSOR_METRICS = {
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe active, wgmma (%)",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe active (%)",
}
_STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def profile(path: Path | str = PROFILE_FILE, masks: tuple[str, ...] = ("causal",)) -> pd.DataFrame | None:
    """The selected ncu metrics (rows) of attnlab's and cuDNN's forward kernels (columns), with each kernel's
    threads per block; None when the export is absent. A kernel's k-th launch in the export is ``masks[k]``
    (``tools/hopper_routes.py --profile`` runs full, then causal); with one mask the columns are the kernels'
    names alone. Exports made with the raw metrics add the tensor pipe's activity and, per stall reason, the
    cycles a warp spent stalled on it per issued instruction (``stall: <reason>``)."""
    p = Path(path)
    if not p.exists():
        return None
    table: dict[str, dict[str, float]] = {}
    launches: dict[str, str] = {}  # ncu's launch ID -> column
    with p.open() as f:
        for r in csv.DictReader(f):
            col = launches.get(r["ID"])
            if col is None:
                name = next((v for k, v in PROFILE_KERNELS.items() if r["Kernel Name"].startswith(k)),
                            r["Kernel Name"][:40])
                k = sum(c.split(",")[0] == name for c in table)
                col = name if len(masks) == 1 else f"{name}, {masks[k] if k < len(masks) else k + 1}"
                launches[r["ID"]] = col
                table[col] = {"threads per block": float(r["Block Size"].strip("()").split(",")[0])}
            metric, value = r["Metric Name"], r["Metric Value"].replace(",", "")
            label = PROFILE_METRICS.get((r["Section Name"], metric)) or TENSOR_METRICS.get(metric)
            if label is None and metric.startswith(_STALL[0]) and metric.endswith(_STALL[1]):
                label = "stall: " + metric[len(_STALL[0]):-len(_STALL[1])]
            if label is not None and value not in ("", "n/a"):
                table[col][label] = float(value)
    return pd.DataFrame(table)


def gluon_kernel(path: Path | str = GLUON_FILE) -> tuple[pd.DataFrame, int, int] | None:
    """The Gluon kernel's first run: (per case its time and the portable kernel's and cuDNN's, in ms, and the speed
    of each over cuDNN's; checks passed; checks run); None when the file is absent."""
    p = Path(path)
    if not p.exists():
        return None
    run = json.loads(p.read_text())
    rows = []
    for r in run["time"]:
        if "ms" not in r:
            continue
        ms = r["ms"]
        cudnn = ms.get("sdpa-cudnn")
        rows.append({"case": r["case"], "Gluon kernel (ms)": ms["hopper"], "portable kernel (ms)": ms["triton"],
                     "cuDNN (ms)": cudnn,
                     "Gluon x cuDNN": cudnn / ms["hopper"] if cudnn else None,
                     "portable x cuDNN": cudnn / ms["triton"] if cudnn else None,
                     "Gluon x portable": ms["triton"] / ms["hopper"]})
    checks = run["check"]
    return pd.DataFrame(rows).set_index("case"), sum(bool(c.get("passed")) for c in checks), len(checks)


def backward_ab(path: Path | str = BACKWARD_FILE) -> pd.DataFrame | None:
    """The Gluon backward beside the portable one and cuDNN's, per case: times (ms), each one's speed over cuDNN's
    (and the earlier form's, where the run timed one: ``old``), and the largest gap to the portable gradients
    (relative to the largest entry); only cases whose gradients agreed were timed. Reads the first run's names
    (``hopper-bwd``, ``portable-bwd``) and the later runs' (``product``, ``portable``). None when the file is
    absent."""
    p = Path(path)
    if not p.exists():
        return None
    rows = []
    for r in json.loads(p.read_text())["rows"]:
        if not r.get("passed"):
            continue
        ms = r["ms"]
        cudnn, gluon = ms["sdpa-cudnn-bwd"], ms.get("product", ms.get("hopper-bwd"))
        portable = ms.get("portable", ms.get("portable-bwd"))
        row = {"case": r["case"], "Gluon (ms)": gluon, "portable (ms)": portable, "cuDNN (ms)": cudnn,
               "Gluon x cuDNN": cudnn / gluon, "portable x cuDNN": cudnn / portable,
               "Gluon x portable": portable / gluon}
        if "old" in ms:
            row["earlier form x cuDNN"] = cudnn / ms["old"]
        row["gap to portable grads"] = max(r.get("product_err_vs_portable", r.get("err_vs_portable")))
        rows.append(row)
    return pd.DataFrame(rows).set_index("case")


#: The rows :func:`gluon_profiles` keeps: time, tensor pipe, issue rate, and the stalls that set the kernels apart.
GLUON_PROFILE_ROWS = ("duration (ns)", "tensor pipe active (%)", "SM busy (%)", "instructions per active cycle",
                      "cycles per issued instruction", "stall: barrier", "stall: long_scoreboard", "stall: wait",
                      "achieved occupancy (%)", "threads per block")


def backward_profile(path: Path | str = BACKWARD_PROFILE_FILE) -> tuple[pd.DataFrame, pd.Series] | None:
    """The backward export's main kernels (attnlab's Gluon pass, cuDNN's bprop; :func:`profile`'s rows), and each
    side's whole backward in ns, its small kernels (preprocess, dQ's zeroing and conversion) added: attnlab's
    launches come first in the export, cuDNN's from its first kernel on. None when the export is absent."""
    prof = profile(path)
    if prof is None:
        return None
    cols = list(prof.columns)
    first = next((i for i, c in enumerate(cols) if "cudnn" in c.lower()), len(cols))
    ns = prof.loc["duration (ns)"]
    total = pd.Series({"attnlab": ns[cols[:first]].sum(), "cuDNN": ns[cols[first:]].sum()})
    return prof[[c for c in cols if c in PROFILE_KERNELS.values()]], total


def gluon_profiles(forward: Path | str = GLUON_PROFILE_FILE, backward: Path | str = BACKWARD_PROFILE_FILE,
                   ) -> tuple[pd.DataFrame, pd.Series, dict] | None:
    """The Gluon forward (full, causal) and backward pass beside cuDNN's in one table (:data:`GLUON_PROFILE_ROWS`
    by kernel, durations in us), each side's whole backward (us), and the forward export's environment (its
    ``.env.json``: GPU, ncu command); None when an export is absent."""
    fwd, bwd = profile(forward, masks=("full", "causal")), backward_profile(backward)
    if fwd is None or bwd is None:
        return None
    env_path = Path(forward).with_suffix(".env.json")
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    table = pd.concat([fwd, bwd[0].add_suffix(", causal")], axis=1).reindex(list(GLUON_PROFILE_ROWS))
    table.loc["duration (ns)"] /= 1e3
    return table.rename(index={"duration (ns)": "duration (us)"}), bwd[1] / 1e3, env
