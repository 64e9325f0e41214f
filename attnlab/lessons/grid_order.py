"""Which program starts when: the backward's grid order, read from the H100 A/B records of
``python -m attnlab.bench.bwd_grid_order`` and drawn from its scheduling model (the decisions log's "The
backward's grid order"). Nothing is timed here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from attnlab.bench.bwd_grid_order import finish_times, ideal_time, modeled_time
from attnlab.paths import DATA_DIR

#: The A/B records, in the order they were measured.
FILES = tuple(DATA_DIR / "experiments" / "nvidia-h100-80gb-hbm3" / f"bwd-grid-order-{commit}.json"
              for commit in ("bdd0553", "bfd58f2", "b7b613e", "3453bb6"))
#: The dK/dV key tile and the dQ row tile of the shipped configs at D 64 and 128, and the H100's SMs: a case's
#: programs per SM in either grid.
TILE, SMS = 128, 132
#: The first record's labels, as the second names the same settings.
_LABELS = {"tiles-inner": "none", "tiles-outer": "all"}


def ab_table(paths: tuple[Path | str, ...] | None = None) -> pd.DataFrame:
    """One row per (record, case): the time with a head's tiles side by side over the time with the tiles outermost
    in the dK/dV grid alone (``dkdv``) and in both grids (``all``), where the record has them (> 1: outermost
    faster), and sdpa-cudnn's time over the side-by-side one; each grid's programs per SM with :data:`TILE`-key
    (or row) tiles on :data:`SMS` SMs. Only cases whose orders gave equal gradients."""
    rows = []
    for p in paths or FILES:
        record = json.loads(Path(p).read_text())
        for r in record["rows"]:
            if not r["equal"] or not r["ms"]:
                continue
            ms = {_LABELS.get(k, k): v for k, v in r["ms"].items()}
            dims = dict(re.findall(r"\b(b|hq|hkv|n)(\d+)", r["case"]))
            tiles = -(-int(dims["n"]) // TILE) * int(dims["b"])
            rows.append({"commit": record["environment"]["commit"], "case": r["case"],
                         "group": int(dims["hq"]) // int(dims["hkv"]),
                         "dK/dV programs per SM": tiles * int(dims["hkv"]) / SMS,
                         "dQ programs per SM": tiles * int(dims["hq"]) / SMS,
                         **{mode: ms["none"] / ms[mode] if mode in ms else float("nan") for mode in ("dkdv", "all")},
                         "cudnn over none": ms["sdpa-cudnn"] / ms["none"]})
    return pd.DataFrame(rows)


def _auto_reorders(case: str) -> tuple[bool, bool]:
    """Whether ``bwd_grid.auto_rule`` reorders the dK/dV grid and the dQ grid of a record's case on :data:`SMS` SMs
    (a shape-only problem: meta tensors)."""
    import torch

    from attnlab.backends.triton.bwd_grid import auto_rule
    from attnlab.problem import make_problem

    dims = {k: int(v) for k, v in re.findall(r"\b(b|hq|hkv|n|d)(\d+)", case)}
    q, kv = (torch.empty(dims["b"], h, dims["n"], dims["d"], device="meta") for h in (dims["hq"], dims["hkv"]))
    prob = make_problem(q, kv, kv, causal=case.endswith("causal"))
    return auto_rule(prob, "dkdv", TILE, SMS), auto_rule(prob, "dq", TILE, SMS)


def summary(t: pd.DataFrame) -> str:
    """One markdown sentence: on the rows ``auto`` reorders (``bwd_grid.auto_rule``, asked for each case), the
    setting it takes (``all`` where both grids are short, else ``dkdv``), where the record measured it; on the
    other rows, both settings."""
    from attnlab.backends.triton.bwd_grid import MIN_WAVES

    picks = t["case"].map(_auto_reorders)
    ruled_rows, both = picks.map(any), picks.map(all)
    ruled = pd.concat([t[ruled_rows & ~both]["dkdv"], t[both]["all"]]).dropna()
    rest = t[~ruled_rows][["dkdv", "all"]].stack()
    return (f"On the causal rows whose dK/dV grid holds fewer than {MIN_WAVES} programs per SM, the setting `auto` "
            f"takes (the tiles outermost in each grid that short) read {ruled.min():.3f}x to {ruled.max():.3f}x "
            f"({len(ruled)} rows); on the other rows either setting read {rest.min():.3f}x to {rest.max():.3f}x.")


def model_table(shapes: dict[str, tuple[int, int, int]]) -> pd.DataFrame:
    """label -> (heads, key tiles, group): the modeled pass's time over its ideal in either order."""
    return pd.DataFrame([{"case": label, "programs": heads * tiles,
                          "side by side": modeled_time(heads, tiles, group, False),
                          "tiles outermost": modeled_time(heads, tiles, group, True)}
                         for label, (heads, tiles, group) in shapes.items()]).set_index("case")


def plot_tails(heads: int, tiles: int, group: int, title: str = "", sms: int = 132):
    """When each SM runs out of work in the model, sorted, in either order, against the ideal (all work / SMs)."""
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ideal = ideal_time(heads, tiles, group, sms)
    for outer, label in ((False, "a head's tiles side by side"), (True, "tiles outermost")):
        done = finish_times(heads, tiles, group, outer, sms)
        ax.plot(range(1, sms + 1), [d / ideal for d in done], label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="ideal")
    ax.set(xlabel="SM (sorted by when it runs out of work)", ylabel="finish / ideal", title=title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig
