"""What the order of competitors in a run does to a side-by-side ratio, read from one H100 experiment (the decisions
log's "The bench's order of competitors"). The benchmark cuts each competitor's timed calls into rounds and
interleaves them; when every round runs in the same order, each competitor always follows the same other one and
pays for the state it leaves the GPU in. Each run of the record is the dense suite's D 128 rows in one process,
the competitors in a chosen order and under one rule: the same order every round (``fixed``), rotated a place per
round, or shuffled after the first round (what the harness does now). Nothing is timed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from attnlab.paths import DATA_DIR

FILE = DATA_DIR / "experiments" / "nvidia-h100-80gb-hbm3" / "competitor-order-8e640f1.json"
#: attnlab backend -> the rival whose time over it the table shows
PAIRS = {"cuda-mma": "sdpa-flash", "triton": "sdpa-cudnn"}
#: the rows the order moves (long calls); column label -> case name
CASES = {"bf16 N16384 full": "bf16_b1_h16_n16384_d128_full", "fp16 N16384 full": "fp16_b1_h16_n16384_d128_full"}
#: the record's order rules, as the table says them
RULES = {"fixed": "fixed", "rotated by one place per turn": "rotated", "shuffled per turn": "shuffled"}


def _ms(run: dict, case: str, backend: str) -> float | None:
    """The median ms of ``backend`` on ``case`` in one run: full CSV rows (``backend``, ``ms``) or, where only a
    summary per case came back, ``{case, backend: {ms}}``."""
    for r in run["rows"]:
        if r.get("case") != case:
            continue
        if "backend" in r:
            if r["backend"] == backend:
                return float(r["ms"])
        elif backend in r:
            return float(r[backend]["ms"])
    return None


def predecessor(backends: list[str], name: str, rule: str) -> str:
    """Whom ``name`` runs right after in the rounds after the first: under a fixed order the one before it,
    cyclically (the last one's round ends just before); rotating a place per round keeps that for all but one
    round in ``len(backends)``; a shuffle varies it."""
    if rule == "shuffled":
        return "varies"
    return backends[backends.index(name) - 1]


def order_table(path: Path | str | None = None) -> pd.DataFrame:
    """One row per (run, attnlab backend of :data:`PAIRS` in it with its rival): the run's order and rule, whom
    each of the two follows, and the rival's time over attnlab's on each of :data:`CASES` (> 1: attnlab faster).
    A pair is read where the run recorded both on every case; ValueError for a run with no such pair."""
    record = json.loads(Path(path or FILE).read_text())
    rows = []
    for run in record["runs"]:
        rule = RULES[run["order"]]
        found = 0
        for ours, rival in PAIRS.items():
            ms = {label: (_ms(run, case, ours), _ms(run, case, rival)) for label, case in CASES.items()}
            if any(a is None or b is None for a, b in ms.values()):
                continue  # (a run of the first call kept the cuda-mma and flash rows alone)
            found += 1
            row = {"attnlab": ours, "rival": rival, "rule": rule, "order": " ".join(run["backends"]),
                   "attnlab follows": predecessor(run["backends"], ours, rule),
                   "rival follows": predecessor(run["backends"], rival, rule)}
            rows.append(row | {label: b / a for label, (a, b) in ms.items()})
        if not found:
            raise ValueError(f"run {run['name']!r} times no pair of {PAIRS} on every case of {list(CASES.values())}")
    return pd.DataFrame(rows).sort_values(["attnlab", "rule", "order"], kind="stable").reset_index(drop=True)


def summary(t: pd.DataFrame) -> str:
    """One markdown line per attnlab backend: the range of its ratio on the first of :data:`CASES` over the
    fixed orders, against the range over the shuffled runs."""
    label = next(iter(CASES))
    out = []
    for ours, g in t.groupby("attnlab", sort=False):
        fixed, shuffled = g[g["rule"] == "fixed"][label], g[g["rule"] == "shuffled"][label]
        line = (f"* `{ours}` against {g['rival'].iloc[0]} ({label}): {fixed.min():.3f}x to {fixed.max():.3f}x "
                f"over {len(fixed)} runs in a fixed order")
        if len(shuffled):
            line += f"; {shuffled.min():.3f}x to {shuffled.max():.3f}x over {len(shuffled)} shuffled runs"
        out.append(line + ".")
    return "\n".join(out)
