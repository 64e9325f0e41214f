"""The tensor-core kernel's last steps toward FlashAttention-2, read from the A/B records behind them.

Each step was measured in one run: the kernel before and after the step, launched on the same packed parameters,
interleaved with SDPA's flash kernel, outputs compared bit for bit (the method of
:mod:`attnlab.bench.mma_patch_probe`, which made the last record; the decisions log names each file). A step's
speedup is the time before over the time after, both from the same run, so the flash times of different runs
never enter one ratio.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from attnlab.paths import DATA_DIR

_DIR = DATA_DIR / "experiments" / "nvidia-h100-80gb-hbm3"

#: step -> (file, mode before, mode after, head dims whose kernel the step changes): the modes are keys of each
#: row's ``flash_over`` (flash time over the mode's time), so after / before is the step's speedup.
STEPS = {
    "pair stores": ("mma-epilogue-stores-86cc476.json", "main", "pack2store", (64, 128)),
    "whole-row stores": ("mma-block-order-and-row-stores-036d062.json", "main", "smem_store", (64, 128)),
    "no rescale branch": ("mma-vote-at-d64-66aabce.json", "vote_at_d64", "main", (64,)),
}


def _dir(directory: Path | str | None) -> Path:
    return Path(directory) if directory is not None else _DIR


def _rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def _key(r: dict) -> tuple[int, int, str]:
    return r["D"], r["N"], "causal" if r["causal"] else "full"


def step_speedups(directory: Path | str | None = None) -> pd.DataFrame:
    """One row per bfloat16 shape every step's run measured (index ``D``, ``N``, ``mask``), one column per step
    (time before / time after, NaN where the step leaves the head dim's kernel as it was), and ``all steps`` (their
    product over the steps that apply). ValueError if a record's outputs were not equal bit for bit where it says
    so, or if it holds a shape twice."""
    d = _dir(directory)
    cols = {}
    for step, (name, before, after, dims) in STEPS.items():
        speed = {}
        for r in _rows(d / name):
            if r.get("dtype", "bfloat16") != "bfloat16":
                continue
            if not all(r.get("equal", {}).get(mode, True) for mode in (before, after)):
                raise ValueError(f"{name}: the outputs of {before!r} and {after!r} differ at {_key(r)}")
            if _key(r) in speed:
                raise ValueError(f"{name}: shape {_key(r)} is recorded twice")
            speed[_key(r)] = r["flash_over"][after] / r["flash_over"][before] if r["D"] in dims else float("nan")
        cols[step] = speed
    shared = sorted(set.intersection(*(set(c) for c in cols.values())), key=lambda k: (-k[0], k[1], k[2]))
    table = pd.DataFrame({step: [c[k] for k in shared] for step, c in cols.items()},
                         index=pd.MultiIndex.from_tuples(shared, names=["D", "N", "mask"]))
    table["all steps"] = table.prod(axis=1, skipna=True)
    return table


def same_code_spread(directory: Path | str | None = None) -> tuple[float, float]:
    """(lowest, highest) ratio between the two modes of the last record on the head dims its step leaves alone:
    the same kernel timed twice in one run, so how far a ratio strays from 1 with no change at all."""
    d = _dir(directory)
    name, before, after, dims = STEPS["no rescale branch"]
    same = [r["flash_over"][after] / r["flash_over"][before] for r in _rows(d / name) if r["D"] not in dims]
    return min(same), max(same)


def environments(directory: Path | str | None = None) -> dict[str, str]:
    """step -> 'GPU, commit' of the run that measured it."""
    d = _dir(directory)
    out = {}
    for step, (name, *_rest) in STEPS.items():
        record = json.loads((d / name).read_text())
        env = record.get("environment") or record.get("env") or {}  # (the older scripts wrote "env")
        commit = env.get("commit") or name.rsplit("-", 1)[-1].removesuffix(".json")
        out[step] = f"{env.get('gpu', 'unknown GPU')}, {commit[:7]}"
    return out
