"""What the order of competitors in a run does to a side-by-side ratio, read from one H100 experiment (the decisions
log's "The bench's order of competitors"). The benchmark cuts each competitor's timed calls into rounds and
interleaves them; a competitor that always runs right after the same other one pays for the state that one
leaves the GPU in. Each run of the record is the dense suite's D 128 rows in one process, the competitors in a
chosen order, the rounds under the harness's rule at the time: the same order every round (``fixed``), rotated a
place per round, one seeded shuffle drawn for every case, or the rule the harness keeps (``spread``:
:func:`attnlab.bench.timing.next_round`); the records keep each run's order of rounds. Nothing is timed here.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd

from attnlab.paths import DATA_DIR

#: the records, read in this order: the rules tried (8e640f1), then the rule kept, on a GPU (ab1131d)
FILES = tuple(DATA_DIR / "experiments" / "nvidia-h100-80gb-hbm3" / f"competitor-order-{commit}.json"
              for commit in ("8e640f1", "ab1131d"))
#: attnlab backend -> the rival whose time over it the table shows
PAIRS = {"cuda-mma": "sdpa-flash", "triton": "sdpa-cudnn"}
#: the rows the order moves (long calls); column label -> case name
CASES = {"bf16 N16384 full": "bf16_b1_h16_n16384_d128_full", "fp16 N16384 full": "fp16_b1_h16_n16384_d128_full"}
#: the record's rules for the rounds' order, as the table says them
RULES = {"fixed": "fixed", "rotated by one place per turn": "rotated",
         "shuffled per turn, seed 0 for every case": "one shuffle", "spread (next_round)": "spread"}


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


def predecessors(turns: list[list[str]], name: str) -> list[str]:
    """Whom ``name``'s timed rounds after the first ran right after: the competitor before it in its turn, or the
    last of the turn before. (Its first round follows its own warm-up.)"""
    out = []
    for t in range(1, len(turns)):
        k = turns[t].index(name)
        out.append(turns[t][k - 1] if k else turns[t - 1][-1])
    return out


def _says(names: list[str]) -> str:
    """``['triton', 'triton', 'sdpa-flash']`` as ``'triton x2, sdpa-flash'``, the most frequent first."""
    return ", ".join(n if c == 1 else f"{n} x{c}" for n, c in Counter(names).most_common())


def order_table(paths: Path | str | list[Path | str] | None = None) -> pd.DataFrame:
    """One row per (run, attnlab backend of :data:`PAIRS` with its rival, both timed on every case of
    :data:`CASES`) over the records ``paths`` (default :data:`FILES`): the rule, the order given, whom each of the
    two ran right after in its later rounds, and the rival's time over attnlab's per case (> 1: attnlab faster).
    ValueError for a run with no such pair."""
    paths = FILES if paths is None else [paths] if isinstance(paths, (str, Path)) else paths
    rows = []
    for run in (run for p in paths for run in json.loads(Path(p).read_text())["runs"]):
        found = 0
        for ours, rival in PAIRS.items():
            ms = {label: (_ms(run, case, ours), _ms(run, case, rival)) for label, case in CASES.items()}
            if any(a is None or b is None for a, b in ms.values()):
                continue  # (a run of the first call kept the cuda-mma and flash rows alone)
            found += 1
            turns = run["turn_orders"]
            rows.append({"attnlab": ours, "rival": rival, "rule": RULES[run["order"]],
                         "order": " ".join(run["backends"]),
                         "attnlab follows": _says(predecessors(turns, ours)),
                         "rival follows": _says(predecessors(turns, rival)),
                         **{label: b / a for label, (a, b) in ms.items()}})
        if not found:
            raise ValueError(f"run {run['name']!r} times no pair of {PAIRS} on every case of {list(CASES.values())}")
    return pd.DataFrame(rows).sort_values(["attnlab", "rule", "order"], kind="stable").reset_index(drop=True)


def summary(t: pd.DataFrame) -> str:
    """One markdown line per attnlab backend: the range of its ratio on the first of :data:`CASES` over the runs
    in which every round ran in one order, and over the runs under the harness's rule (``spread``)."""
    label = next(iter(CASES))
    out = []
    for ours, g in t.groupby("attnlab", sort=False):
        fixed, spread = (g[g["rule"] == rule][label] for rule in ("fixed", "spread"))
        line = (f"* `{ours}` against {g['rival'].iloc[0]} ({label}): {fixed.min():.3f}x to {fixed.max():.3f}x "
                f"over {len(fixed)} runs, each in one fixed order")
        if len(spread):
            line += f"; {spread.min():.3f}x to {spread.max():.3f}x over {len(spread)} runs with the rounds spread"
        out.append(line + ".")
    return "\n".join(out)
