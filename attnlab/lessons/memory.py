"""The memory math of attention: how big the score matrix is, how much HBM traffic each pipeline moves,
what that traffic costs in time, and where a kernel sits on the roofline.

Everything here is arithmetic on shapes (no tensors are allocated), so it runs anywhere and answers
questions about GPUs you do not have. Conventions:

* bytes are exact integers; :func:`fmt_bytes` prints them in binary units (KiB, MiB, GiB);
* FLOPs follow the FlashAttention convention ``4 * B * H * Nq * Nk * D`` (two matmuls, a multiply and
  an add each); causal masking halves it;
* the *unfused* pipeline is the textbook one (``S = QK^T``; softmax; ``P @ V``, each a separate kernel that
  writes its result to HBM); the *fused* one (FlashAttention) reads Q once, K and V once per query tile
  (``ceil(Nq / BLOCK_M)`` times, fewer from HBM when the L2 cache serves the re-reads) and writes O and the
  log-sum-exp, never the scores.

The measured roofs come from ``data/bench/<gpu>/roofs.json`` (:func:`measured_roofs`), the older
ceilings (:data:`RECORDED_GPU`, its fallback) are listed with their versions in docs/design.md, "Measured
figures"; the measured extra memory comes from the dense suite's file (:func:`recorded_anchors`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from attnlab.paths import BENCH_DIR

#: Ceilings of the GPU the recorded data comes from, measured before ``tools/roofs.py`` (docs/design.md,
#: "Measured figures"): TFLOP/s and TB/s. The fallback of :func:`measured_roofs`, which reads the re-measured
#: roofs when recorded.
RECORDED_GPU = {
    "name": "NVIDIA H200",
    "bf16_tflops": 692.0,  # dense bf16 matmul, measured
    "fp32_tflops": 51.0,  # IEEE float32 matmul (TF32 off), measured
    "copy_tbps": 4.2,  # device-to-device copy, measured
    "hbm_gib": 141e9 / 2**30,  # 141 GB of HBM3e
}

#: Where :func:`measured_roofs` looks by default: the recorded GPU's data (``ATTNLAB_BENCH_DIR`` moves it).
DEFAULT_GPU_DIR = BENCH_DIR / "nvidia-h200"


def measured_roofs(gpu_dir: Path | str | None = None) -> dict:
    """The roofs measured on one GPU (``<gpu_dir>/roofs.json``, written by ``tools/roofs.py``), or the
    constants of :data:`RECORDED_GPU` when that file is absent or unreadable.

    Keys: ``name``; ``bf16_tflops`` (dense bf16 matmul: the roof of the tensor-core kernels);
    ``fp32_tflops`` (IEEE float32 matmul, TF32 off); ``fp32_fma_tflops`` (float32 FMAs in registers: the roof
    of the CUDA-core kernels); ``read_tbps`` (read-only stream: the memory roof); ``copy_tbps`` (a
    device-to-device copy, which reads and writes); ``hbm_gib`` (the memory torch reported beside the recorded
    suites, :func:`recorded_memory`, with ``hbm_source``); and where they come from: ``source`` (the
    file, or ``"fallback: memory.RECORDED_GPU"``), ``commit``, ``date_utc``, ``how``. The fallback has no FMA or
    read-only measurement, so it uses the float32 matmul rate and the copy rate for them.
    """
    folder = Path(gpu_dir if gpu_dir is not None else DEFAULT_GPU_DIR)
    fallback = {**RECORDED_GPU, "fp32_fma_tflops": RECORDED_GPU["fp32_tflops"], "read_tbps": RECORDED_GPU["copy_tbps"],
                "source": "fallback: memory.RECORDED_GPU", "commit": None, "date_utc": None, "how": None,
                **recorded_memory(folder)}
    path = folder / "roofs.json"
    try:
        rec = json.loads(path.read_text())
        r, env = rec["roofs"], rec.get("environment", {})
        return {**fallback, "name": env.get("gpu", fallback["name"]),
                "bf16_tflops": float(r["bf16_matmul_tflops"]), "fp32_tflops": float(r["fp32_matmul_tflops"]),
                "fp32_fma_tflops": float(r["fp32_fma_tflops"]), "read_tbps": float(r["read_tbps"]),
                "copy_tbps": float(r["copy_tbps"]), "source": f"{path.parent.name}/{path.name}",
                "commit": env.get("commit"), "date_utc": env.get("date_utc"), "how": env.get("how")}
    except (OSError, ValueError, KeyError, TypeError):
        return fallback


def recorded_memory(gpu_dir: Path | str | None = None) -> dict:
    """``{"hbm_gib": ..., "hbm_source": ...}``: the GPU memory (GiB, as torch reports the device's total) that
    the suites recorded in their environment (``<gpu_dir>/<suite>.json``, ``memory_gib``; the first suite by
    name that has it), or the data sheet's figure of :data:`RECORDED_GPU` when none did."""
    folder = Path(gpu_dir if gpu_dir is not None else DEFAULT_GPU_DIR)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            gib = json.loads(path.read_text()).get("memory_gib")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(gib, (int, float)) and gib > 0:
            return {"hbm_gib": float(gib), "hbm_source": f"{folder.name}/{path.name}"}
    return {"hbm_gib": RECORDED_GPU["hbm_gib"], "hbm_source": "data sheet: 141 GB (memory.RECORDED_GPU)"}


#: Score-sized tensors attnlab's textbook backend holds at its peak: the scores, the softmax's output and the
#: copy its empty-row fix makes (a ``masked_fill`` on P). The formula itself needs two.
TEXTBOOK_LIVE_SCORES = 3


def recorded_anchors(gpu_dir: Path | str | None = None) -> pd.DataFrame | None:
    """Extra memory beyond the inputs that the dense suite recorded (``<gpu_dir>/dense.csv``, bf16 cases without
    a mask, MHA, Nq = Nk): per shape the textbook (``torch``) and the fused Triton kernel (``triton``), in MiB, each the
    suite's ``peak_extra_mib`` (beyond the inputs and the output) plus the output. None when not recorded.
    ``.attrs``: ``source`` and ``commit``."""
    folder = Path(gpu_dir if gpu_dir is not None else DEFAULT_GPU_DIR)
    path = folder / "dense.csv"
    if not path.is_file():
        return None
    d = pd.read_csv(path)
    d = d[(d["status"] == "ok") & (d["dtype"] == "bfloat16") & (d["mask"] == "dense")
          & (d["Hq"] == d["Hkv"]) & (d["Nq"] == d["Nk"])]  # the model's shapes: MHA, square
    rows = []
    for (B, H, N, D), g in d.groupby(["B", "Hq", "Nq", "D"]):
        peak = g.set_index("backend")["peak_extra_mib"]
        if {"torch", "triton"} <= set(peak.index):
            out = qkvo_bytes(B, H, N, N, D, "bfloat16")["o"] / 2**20
            rows.append({"B": B, "H": H, "N": N, "D": D, "textbook_mib": peak["torch"] + out,
                         "fused_mib": peak["triton"] + out, "output_mib": out})
    if not rows:
        return None
    a = pd.DataFrame(rows)
    try:
        a.attrs["commit"] = json.loads((folder / "dense.json").read_text()).get("commit")
    except (OSError, ValueError):
        a.attrs["commit"] = None
    a.attrs["source"] = f"{folder.name}/dense.csv"
    return a


_SIZES = {
    "float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2, "fp8": 1,
    "fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2, "half": 2, "float": 4, "double": 8,
}


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype``: a torch dtype, a name ("bf16", "float32"...) or an int size."""
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).replace("torch.", "").lower()
    if name not in _SIZES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_SIZES)} or a byte count")
    return _SIZES[name]


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units with one decimal, e.g. ``16.0 GiB``."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    x, u = float(n), 0
    while abs(x) >= 1024 and u < len(units) - 1:
        x, u = x / 1024, u + 1
    return f"{x:.0f} {units[u]}" if u == 0 else f"{x:.1f} {units[u]}"


def score_bytes(B: int, H: int, Nq: int, Nk: int | None = None, dtype: object = "float32") -> int:
    """Bytes of one materialized ``[B, H, Nq, Nk]`` score (or probability) matrix.

    >>> fmt_bytes(score_bytes(8, 32, 4096, dtype="float32"))
    '16.0 GiB'
    """
    Nk = Nq if Nk is None else Nk
    return B * H * Nq * Nk * dtype_bytes(dtype)


def qkvo_bytes(B: int, Hq: int, Nq: int, Nk: int, D: int, dtype: object, Hkv: int | None = None) -> dict[str, int]:
    """Bytes of the four operands: q and o are ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]``."""
    Hkv = Hq if Hkv is None else Hkv
    e = dtype_bytes(dtype)
    return {"q": B * Hq * Nq * D * e, "k": B * Hkv * Nk * D * e, "v": B * Hkv * Nk * D * e, "o": B * Hq * Nq * D * e}


def flops(B: int, H: int, Nq: int, Nk: int, D: int, *, causal: bool = False) -> float:
    """Forward FLOPs by the FlashAttention convention: ``4 B H Nq Nk D``, halved for causal."""
    f = 4.0 * B * H * Nq * Nk * D
    return f / 2 if causal else f


@dataclass(frozen=True)
class Traffic:
    """HBM bytes moved by one forward pass, split into where they go."""

    operands: int  #: reading q, k, v and writing o (and lse)
    scores: int  #: reading and writing the score / probability matrices (0 for a fused kernel)

    @property
    def total(self) -> int:
        return self.operands + self.scores


def unfused_traffic(
    B: int, H: int, Nq: int, Nk: int, D: int, dtype: object = "float16", *,
    Hkv: int | None = None, elementwise_passes: int = 0,
) -> Traffic:
    """HBM traffic of the textbook pipeline ``S = QK^T -> P = softmax(S) -> O = P V``.

    The score matrix crosses HBM four times: ``S`` written by the first matmul, read by the softmax,
    ``P`` written by it, read again by ``P @ V``. Each extra elementwise kernel on the scores (a separate
    scale, a ``masked_fill``, adding a bias) reads and writes it once more: ``elementwise_passes``.
    """
    ops = qkvo_bytes(B, H, Nq, Nk, D, dtype, Hkv)
    s = score_bytes(B, H, Nq, Nk, dtype)
    return Traffic(operands=sum(ops.values()), scores=(4 + 2 * elementwise_passes) * s)


def fused_traffic(
    B: int, H: int, Nq: int, Nk: int, D: int, dtype: object = "float16", *,
    Hkv: int | None = None, block_m: int | None = None, lse: bool = True,
) -> Traffic:
    """HBM traffic of a fused (FlashAttention-style) forward: q, k, v read, o (and lse, float32) written.

    With ``block_m`` the K/V re-reads are counted as if no cache helped: each of the ``ceil(Nq/block_m)``
    query tiles streams all of K and V. Without it K and V are read once (what a large L2 achieves when
    the tiles of one head run together).
    """
    ops = qkvo_bytes(B, H, Nq, Nk, D, dtype, Hkv)
    kv_reads = 1 if block_m is None else math.ceil(Nq / block_m)
    total = ops["q"] + ops["o"] + kv_reads * (ops["k"] + ops["v"])
    if lse:
        total += B * H * Nq * 4
    return Traffic(operands=total, scores=0)


def seconds_at(nbytes: float, tbps: float = RECORDED_GPU["copy_tbps"]) -> float:
    """Time to move ``nbytes`` at ``tbps`` TB/s (decimal terabytes, as bandwidths are quoted)."""
    return nbytes / (tbps * 1e12)


def intensity(B: int, H: int, Nq: int, Nk: int, D: int, dtype: object = "float16", *, fused: bool = True,
              causal: bool = False, Hkv: int | None = None) -> float:
    """Arithmetic intensity (FLOP per HBM byte) of the fused or unfused forward."""
    t = (fused_traffic if fused else unfused_traffic)(B, H, Nq, Nk, D, dtype, Hkv=Hkv)
    return flops(B, H, Nq, Nk, D, causal=causal) / t.total


def ridge_point(peak_tflops: float, tbps: float) -> float:
    """The intensity (FLOP/byte) at which a kernel stops being bandwidth-bound."""
    return peak_tflops / tbps


def attainable_tflops(flop_per_byte: float, peak_tflops: float, tbps: float) -> float:
    """The roofline: ``min(peak, intensity * bandwidth)`` in TFLOP/s."""
    return min(peak_tflops, flop_per_byte * tbps)


def textbook_peak_extra(B: int, H: int, Nq: int, Nk: int, D: int, dtype: object = "bfloat16", *,
                        live_scores: int = 2) -> int:
    """Model of the textbook version's extra memory: ``live_scores`` score-sized tensors plus the output.

    At its peak the textbook version holds the scores and the softmax's output at once (2 matrices); the
    output is counted because benchmarks measure memory beyond the inputs.
    """
    return live_scores * score_bytes(B, H, Nq, Nk, dtype) + qkvo_bytes(B, H, Nq, Nk, D, dtype)["o"]


def fused_peak_extra(B: int, H: int, Nq: int, Nk: int, D: int, dtype: object = "bfloat16") -> int:
    """Model of a fused kernel's extra memory: the output and the float32 log-sum-exp."""
    return qkvo_bytes(B, H, Nq, Nk, D, dtype)["o"] + B * H * Nq * 4


def sweep(Ns, *, B: int = 1, H: int = 16, D: int = 128, dtype: object = "bfloat16", causal: bool = False,
          tbps: float = RECORDED_GPU["copy_tbps"], peak_tflops: float = RECORDED_GPU["bf16_tflops"]) -> pd.DataFrame:
    """One row per N (Nq = Nk = N): score bytes, traffic, modelled extra memory, time at ``tbps``,
    intensity and the roofline bound of both pipelines."""
    rows = []
    for n in Ns:
        un = unfused_traffic(B, H, n, n, D, dtype)
        fu = fused_traffic(B, H, n, n, D, dtype)
        f = flops(B, H, n, n, D, causal=causal)
        rows.append({
            "N": n,
            "score_bytes": score_bytes(B, H, n, n, dtype),
            "unfused_bytes": un.total,
            "fused_bytes": fu.total,
            "traffic_ratio": un.total / fu.total,
            "unfused_ms": 1e3 * seconds_at(un.total, tbps),
            "fused_ms": 1e3 * seconds_at(fu.total, tbps),
            "compute_ms": 1e3 * f / (peak_tflops * 1e12),
            "textbook_extra": textbook_peak_extra(B, H, n, n, D, dtype),
            "fused_extra": fused_peak_extra(B, H, n, n, D, dtype),
            "unfused_intensity": f / un.total,
            "fused_intensity": f / fu.total,
        })
    return pd.DataFrame(rows)


def anchors_vs_model(anchors: pd.DataFrame | None = None, dtype: object = "bfloat16", *,
                     live_scores: int = TEXTBOOK_LIVE_SCORES) -> pd.DataFrame | None:
    """The recorded extra memory (:func:`recorded_anchors`, or ``anchors``) next to the models: the textbook
    holds ``live_scores`` score-sized tensors and the output (:func:`textbook_peak_extra`), the fused kernel
    its output (no lse is asked for). ``textbook_model_error``: recorded / model - 1; ``measured_ratio``:
    textbook over fused."""
    a = recorded_anchors() if anchors is None else anchors.copy()
    if a is None:
        return None
    attrs = dict(a.attrs)
    a["textbook_model_mib"] = [
        textbook_peak_extra(r.B, r.H, r.N, r.N, r.D, dtype, live_scores=live_scores) / 2**20 for r in a.itertuples()
    ]
    a["fused_model_mib"] = [qkvo_bytes(r.B, r.H, r.N, r.N, r.D, dtype)["o"] / 2**20 for r in a.itertuples()]
    a["textbook_model_error"] = a["textbook_mib"] / a["textbook_model_mib"] - 1
    a["measured_ratio"] = a["textbook_mib"] / a["fused_mib"]
    a.attrs.update(attrs)
    return a


def measured_tflops(df: pd.DataFrame, *, B: int, H: int, N: int, D: int, dtype: str = "bfloat16",
                    causal: bool = False) -> pd.Series:
    """TFLOP/s recorded in a bench suite (``load_bench`` rows) for one square shape, by backend (ok rows)."""
    sel = ((df["B"] == B) & (df["Hq"] == H) & (df["Nq"] == N) & (df["Nk"] == N) & (df["D"] == D)
           & (df["dtype"].astype(str) == dtype) & (df["causal"] == causal) & (df["status"] == "ok"))
    return df[sel].set_index("backend")["tflops"]


def ratio_table(Ns, Ds, *, B: int = 1, H: int = 16, dtype: object = "bfloat16",
                live_scores: int = 2) -> pd.DataFrame:
    """Modelled textbook / fused extra memory beyond the inputs for each (N, D): ``k N / D + 1``, ``k`` =
    ``live_scores`` score-sized tensors and the output against the fused kernel's output (no lse asked for)."""
    return pd.DataFrame(
        {f"D={D}": [textbook_peak_extra(B, H, n, n, D, dtype, live_scores=live_scores)
                    / qkvo_bytes(B, H, n, n, D, dtype)["o"] for n in Ns]
         for D in Ds},
        index=pd.Index(list(Ns), name="N"),
    )
