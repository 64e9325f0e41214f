"""The shipped table of tuned Triton configs: what a GPU launch uses when nobody asked for tuning.

A first call must not wait for autotuning, so each kernel's config comes, in this order, from: this process's
memory; the persistent cache of configs the user tuned (:func:`attnlab.tune`, or ``ATTNLAB_AUTOTUNE=1``;
:mod:`~attnlab.backends.triton.tune_cache`); this table; the heuristic default (the first candidate of the
kernel's space). Only the kernel chosen is compiled.

The table (``tuned_table.json`` beside this module, made by ``tools/tune_table.py`` on a GPU) holds, per GPU
family (``sm90`` for Hopper: compute capability 9.0), the environment it was measured in and a list of entries
per kernel (``fwd``, ``bwd``): the tune key's fields and the config the tuner chose for them. A problem takes the
entry of its own dtype, padded head dim, TF32 setting (and, for the backward, GQA group) whose mask kind
matches, or failing that whose mask class matches (banded: causal or a window; full: anything else), nearest
in its size buckets (log2 distance of Nq, Nk and B*Hq). A family the table does not have, or a problem with no
matching entry, gets the heuristic default, and :func:`describe` says so.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch

#: The table's file, shipped inside the package.
TABLE_PATH = Path(__file__).with_name("tuned_table.json")
#: The table's layout version: a file of another version counts as empty.
FORMAT = 1
#: The key fields that must match exactly, per kernel; the size fields are matched by distance.
EXACT_FIELDS = {"fwd": ("dtype", "block_d", "tf32"), "bwd": ("dtype", "block_d", "group"),
                "bwd1": ("dtype", "block_d", "group")}
SIZE_FIELDS = ("nq", "nk", "bh")


def gpu_family(device: torch.device | int | None = None) -> str:
    """``sm<major><minor>`` of a CUDA device (``sm90`` for Hopper)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


@functools.cache
def load(path: Path = TABLE_PATH) -> dict[str, Any]:
    """The table's families ({} when the file is missing, unreadable or of another format)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("families"), dict):
        return {}
    return data["families"]


def mask_class(kind: str) -> str:
    """``banded`` for a causal or windowed mask kind, else ``full``."""
    return "banded" if ("causal" in kind or "window" in kind) else "full"


def key_fields(kernel: str, key: tuple) -> dict[str, Any]:
    """A tune key (without the device index) as the table's named fields.

    Forward keys are (dtype, block_d, kind, tf32, nq, nk, bh); backward keys (dtype, block_d, kind, group, nq, nk,
    bh) (:func:`attnlab.backends.triton.configs.tune_key`, :func:`attnlab.backends.triton.configs.bwd_tune_key`)."""
    dtype, block_d, kind, fourth, nq, nk, bh = key
    fields = {"dtype": str(dtype).replace("torch.", ""), "block_d": int(block_d), "kind": kind,
              "nq": int(nq), "nk": int(nk), "bh": int(bh)}
    fields["tf32" if kernel == "fwd" else "group"] = fourth if kernel == "fwd" else int(fourth)
    return fields


def _distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    return sum(abs(math.log2(max(1, a[f])) - math.log2(max(1, b[f]))) for f in SIZE_FIELDS)


def lookup(kernel: str, family: str, key: tuple, table: dict[str, Any] | None = None) -> Any | None:
    """The tuned config (as stored: a dict of fields, or a list of them) the table gives a problem of tune key
    ``key`` (without the device index) on GPU ``family``, or None when it has none."""
    families = load() if table is None else table
    entries = families.get(family, {}).get("entries", {}).get(kernel, [])
    want = key_fields(kernel, key)
    same = [e for e in entries if all(e.get("key", {}).get(f) == want[f] for f in EXACT_FIELDS[kernel])]
    for match in (lambda k: k == want["kind"], lambda k: mask_class(k) == mask_class(want["kind"])):
        fits = [e for e in same if match(e["key"].get("kind", ""))]
        if fits:
            return min(fits, key=lambda e: _distance(e["key"], want))["config"]
    return None


def describe(device: torch.device | int | None = None) -> str:
    """One line: where this GPU's Triton configs come from (the tuned table's family, or heuristic defaults)."""
    family = gpu_family(device)
    got = load().get(family)
    if not got:
        measured = ", ".join(sorted(load())) or "none"
        return (f"triton configs: heuristic defaults ({family} is not in the tuned table; it has {measured}); "
                "attnlab.tune() or ATTNLAB_AUTOTUNE=1 tunes")
    env = got.get("measured", {})
    counts = ", ".join(f"{len(v)} {k}" for k, v in got.get("entries", {}).items())
    return (f"triton configs: tuned table for {family} ({counts} entries, measured on {env.get('gpu', '?')} with "
            f"triton {env.get('triton', '?')}); attnlab.tune() or ATTNLAB_AUTOTUNE=1 tunes")
