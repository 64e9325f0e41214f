"""The CUDA ladder timed without the host: textbook PyTorch, naive, tiled, rowmax in float32, and the same
ladder plus the tensor-core kernel (``cuda-mma``) in bfloat16, with ``triton`` and SDPA's FlashAttention-2
beside them, on the CUDA blog's case (B1 H8 N1024 D64 causal) and on B8 H16 N2048 D64 causal.

Every call goes through :func:`attnlab.attention` (or SDPA), is first checked against the float64 reference on
the same inputs, and is then timed twice: GPU time per call in CUDA-graph replay (the best of several replays
of a graph of several calls) and the host's time to issue one call (the bench's ``measure_host``: calls queued
behind a GPU sleep, so that the host never waits).

:func:`measure` runs on a GPU (``python -m attnlab.lessons.cuda_ladder OUT.json``) and writes one JSON file with
its environment; :func:`recorded` reads it back where there is no GPU (the notebooks' CUDA chapter).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd
import torch

import attnlab
from attnlab.bench.replay import graph_us
from attnlab.bench.timing import host_calls, measure_host
from attnlab.paths import DATA_DIR

#: Where the recorded GPU's measurement is kept.
RECORDED = DATA_DIR / "experiments" / "nvidia-h200" / "cuda-ladder.json"
#: The newest measurement of the kernels as they are, on whichever GPU measured them last (the recorded GPU's may
#: predate later steps of a kernel); move it with each new record.
NEWEST = DATA_DIR / "experiments" / "nvidia-h100-80gb-hbm3" / "cuda-ladder-ab1131d.json"

CASES = {"blog_b1_h8_n1024_d64_causal": (1, 8, 1024, 64), "b8_h16_n2048_d64_causal": (8, 16, 2048, 64)}
LADDER = {torch.float32: ("torch", "cuda-naive", "cuda-tiled", "cuda-rowmax", "triton"),
          torch.bfloat16: ("torch", "cuda-naive", "cuda-tiled", "cuda-rowmax", "cuda-mma", "triton", "sdpa-flash")}


def _call(backend: str, q, k, v):
    if backend == "sdpa-flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return flash
    return lambda: attnlab.attention(q, k, v, causal=True, backend=backend)


def measure(out: Path | str) -> list[dict]:
    """Check and time every rung on both cases (GPU only); write the rows and their environment to ``out``."""
    rows = []
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT", "unknown")}
    for case, (B, H, N, D) in CASES.items():
        for dtype, ladder in LADDER.items():
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
            ref, _ = attnlab.reference(q, k, v, causal=True)
            for backend in ladder:
                call = _call(backend, q, k, v)
                row = {"case": case, "dtype": str(dtype).replace("torch.", ""), "backend": backend}
                try:
                    row["passed"] = bool(attnlab.check.compare(call(), ref).passed)
                    if row["passed"]:  # a time only for an output that passed on these inputs
                        slow = backend in ("torch", "cuda-naive")
                        row["graph_us"] = round(graph_us(call, calls=3 if slow else 10, reps=5 if slow else 20), 2)
                        n = host_calls(row["graph_us"] / 1e3)
                        row["host_us"] = round(measure_host(lambda _, c=call: c(), 1, n, q.device)[0], 2)
                except Exception as e:  # recorded, not hidden
                    row.update(passed=False, error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(row)
                print(row, flush=True)
    Path(out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return rows


def environment(path: Path | str | None = None) -> dict:
    """Where and at which commit the recorded ladder was measured (empty when nothing is recorded)."""
    p = Path(path) if path is not None else RECORDED
    return json.loads(p.read_text())["environment"] if p.exists() else {}


def recorded(path: Path | str | None = None) -> pd.DataFrame | None:
    """The recorded ladder: one row per (case, dtype, backend) with ``graph_us``, ``host_us``, the time over
    rowmax's of the same case and dtype (``x_rowmax``) and FlashAttention-2's time over this one
    (``flash_over_this``, bf16 only); None when nothing is recorded."""
    p = Path(path) if path is not None else RECORDED
    if not p.exists():
        return None
    df = pd.DataFrame(json.loads(p.read_text())["rows"])
    if "graph_us" not in df:
        df["graph_us"] = float("nan")
    groups = [df["case"], df["dtype"]]
    rowmax = df["graph_us"].where(df["backend"] == "cuda-rowmax").groupby(groups).transform("max")
    flash = df["graph_us"].where(df["backend"] == "sdpa-flash").groupby(groups).transform("max")
    df["x_rowmax"] = df["graph_us"] / rowmax
    df["flash_over_this"] = flash / df["graph_us"]
    return df


def top_rungs(path: Path | str | None = None, case: str = "b8_h16_n2048_d64_causal") -> str | None:
    """One markdown sentence on the bfloat16 top of a recorded ladder (default :data:`NEWEST`): where and at which
    commit, and the tensor-core kernel's, FlashAttention-2's and the Triton kernel's GPU times on ``case``; None
    when the record is missing or lacks one of the three with an output that passed."""
    p = Path(path) if path is not None else NEWEST
    lad = recorded(p)
    if lad is None:
        return None
    top = lad[(lad["case"] == case) & (lad["dtype"] == "bfloat16") & lad["passed"].eq(True)]
    top = top.set_index("backend")["graph_us"]
    if any(b not in top or pd.isna(top[b]) for b in ("cuda-mma", "sdpa-flash", "triton")):
        return None
    env = environment(p)
    mma, flash, tri = top["cuda-mma"], top["sdpa-flash"], top["triton"]
    return (f"On the {env.get('gpu')} at commit {str(env.get('commit'))[:7]}, {case} in bfloat16: `cuda-mma` "
            f"{mma / 1e3:.3f} ms, FlashAttention-2 {flash / 1e3:.3f} ms, the Triton kernel {tri / 1e3:.3f} ms: "
            f"`cuda-mma` runs at {flash / mma:.2f}x FlashAttention-2's speed and {tri / mma:.2f}x the Triton "
            "kernel's.")


def over_rowmax(case: str, dtype: str = "float32", lad: pd.DataFrame | None = None) -> pd.Series | None:
    """Each backend's GPU time alone (graph replay) over the rowmax kernel's on one recorded case and dtype
    (:func:`recorded`, or ``lad``): backend -> ratio; None when the case is not recorded."""
    lad = recorded() if lad is None else lad
    if lad is None:
        return None
    got = lad[(lad["case"] == case) & (lad["dtype"] == dtype)].dropna(subset=["x_rowmax"])
    return got.set_index("backend")["x_rowmax"] if len(got) else None


if __name__ == "__main__":
    measure(sys.argv[1])
