"""Make the shipped table of tuned Triton configs (attnlab/backends/triton/tuned_table.json) on a GPU.

Tunes each problem of :data:`PROBLEMS` with ``attnlab.tune`` (every candidate compiled, then timed; the fastest
kept) and writes the chosen configs under this GPU's family, with the environment they were measured in. Other
families already in the file are kept. Run on the GPU whose family the table should hold:

    PYTHONPATH=. python tools/tune_table.py [--commit SHA] [--out PATH] [--missing]

``--missing`` tunes only the problems whose key this family's entries lack, and adds them to the entries kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

#: (dtype, B, H, N, D, mask keywords, backward): the dense and backward suites' shapes, the padding suite's
#: lengths, and smaller problems, so that every size bucket the notebooks meet has an entry near it.
PROBLEMS = [
    *[(dt_, b, 16, n, d, {"causal": c}, False) for dt_ in ("bfloat16", "float16") for d in (64, 128)
      for b, n in ((8, 1024), (4, 1024), (4, 4096), (1, 16384), (2, 512)) for c in (False, True)],
    *[("float32", b, 8, n, d, {"causal": c}, False) for d in (64, 128) for b, n in ((1, 1024), (8, 2048))
      for c in (False, True)],
    *[(dt_, b, 16, n, 128, {"causal": c}, True) for dt_ in ("bfloat16", "float16")
      for b, n in ((4, 4096), (1, 16384)) for c in (False, True)],
    *[("bfloat16", b, 16, n, 64, {"causal": c}, True) for b, n in ((4, 4096), (8, 1024)) for c in (False, True)],
    ("bfloat16", 8, 16, 4096, 128, {"kv_len": "ragged"}, True),
    ("bfloat16", 8, 16, 4096, 128, {"kv_len": "ragged", "causal": True}, False),
]


def _inputs(dtype: str, B: int, H: int, N: int, D: int, kw: dict, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=getattr(torch, dtype), generator=gen) for _ in range(3))
    kw = dict(kw)
    if kw.get("kv_len") == "ragged":
        kw["kv_len"] = torch.randint(N // 4, N + 1, (B,), device="cuda", generator=gen)
    return q, k, v, kw


def main(argv: list[str] | None = None) -> int:
    import attnlab
    from attnlab.backends.triton import backward, configs, tuned_table
    from attnlab.bench.results import environment
    from attnlab.problem import make_problem

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(tuned_table.TABLE_PATH))
    p.add_argument("--commit", default=None, help="the commit measured (the device's .git may be stale)")
    p.add_argument("--missing", action="store_true", help="tune only the problems this family's entries lack")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_table: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ["ATTNLAB_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnlab-tune-table-")  # tune anew, touch no cache
    backward.DQ_MODE = "pass"  # the table's "bwd" entries are two-pass pairs, whatever ATTNLAB_BWD_DQ says
    path = Path(args.out)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    families = data.get("families", {}) if data.get("format") == tuned_table.FORMAT else {}
    family = tuned_table.gpu_family()
    kept = families.get(family, {}) if args.missing else {}
    # entries by their key's fields as sorted JSON (a dict is no dict key)
    fwd = {json.dumps(e["key"], sort_keys=True): e["config"] for e in kept.get("entries", {}).get("fwd", [])}
    bwd = {json.dumps(e["key"], sort_keys=True): e["config"] for e in kept.get("entries", {}).get("bwd", [])}
    t_all = time.perf_counter()
    for i, (dtype, B, H, N, D, kw, grad) in enumerate(PROBLEMS):
        q, k, v, kw = _inputs(dtype, B, H, N, D, kw, seed=i)
        prob = make_problem(q, k, v, **kw)
        fwd_key = json.dumps(tuned_table.key_fields("fwd", configs.tune_key(prob)[1:]), sort_keys=True)
        bwd_key = json.dumps(tuned_table.key_fields("bwd", configs.bwd_tune_key(prob)[1:]), sort_keys=True)
        if fwd_key in fwd and (not grad or bwd_key in bwd):
            continue
        t0 = time.perf_counter()
        chosen = attnlab.tune(q, k, v, backward=grad, **kw)
        fwd[fwd_key] = dataclasses.asdict(chosen["fwd"])
        if grad:
            bwd[bwd_key] = [dataclasses.asdict(c) for c in chosen["bwd"]]
        print(f"{dtype:>8} B{B} H{H} N{N} D{D} {kw if not isinstance(kw.get('kv_len'), torch.Tensor) else 'kv_len'} "
              f"{'fwd+bwd' if grad else 'fwd'}: {time.perf_counter() - t0:5.1f} s  {chosen}", flush=True)
    env = environment("cuda", ["tools/tune_table.py", *(argv or sys.argv[1:])])
    measured = {k: env.get(k) for k in ("gpu", "sm", "torch", "triton", "cuda", "date_utc")}
    measured["commit"] = args.commit or env.get("commit")
    measured["tune_seconds"] = seconds = round(time.perf_counter() - t_all, 1)
    if kept:  # the earlier run's record stays, this one is added to it
        measured = {**kept["measured"], "extended": [*kept["measured"].get("extended", []), measured]}
    families[family] = {"measured": measured, "entries": {
        "fwd": [{"key": json.loads(k), "config": c} for k, c in fwd.items()],
        "bwd": [{"key": json.loads(k), "config": c} for k, c in bwd.items()],
    }}
    path.write_text(json.dumps({"format": tuned_table.FORMAT, "made_by": "tools/tune_table.py",
                                "made_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                "families": families}, indent=1) + "\n")
    print(f"wrote {path}: {family} with {len(fwd)} fwd and {len(bwd)} bwd entries ({seconds} s of tuning)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
