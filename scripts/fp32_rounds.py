"""The fp32 suite's cuda-rowmax vs sdpa-efficient comparison, repeated (the margin on B8 H16 N2048 is thin).

ROUNDS full harness measurements (bench.run_case: checked call, memory call, warm-up, timed median) per case,
the two competitors side by side in each round, alternating which goes first. Writes $OUT/fp32_rounds.json.
Run on a GPU from the repository root: PYTHONPATH=. ROUNDS=6 python3 scripts/fp32_rounds.py
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

from attnlab import bench

ROUNDS = int(os.environ.get("ROUNDS", "6"))
out = {"rounds": ROUNDS, "environment": bench.environment("cuda", sys.argv), "cases": {}}
opts = bench.Options(device="cuda", gpu=bench.device_name("cuda"), run_id="rounds")
comps = bench.competitors(["cuda-rowmax", "sdpa-efficient"])
t0 = time.time()
for case in bench.fp32_suite("cuda"):
    res = {"cuda-rowmax": [], "sdpa-efficient": [], "ratio": []}
    for r in range(ROUNDS):
        order = comps if r % 2 == 0 else comps[::-1]
        rows = bench.run_case(case, order, opts)
        ms = {row["backend"]: row["ms"] for row in rows}
        if any(row["status"] != "ok" for row in rows):  # "ok": the output passed the checker and was timed
            print("NOT OK", case.name, [(row["backend"], row["status"], row.get("notes")) for row in rows])
            sys.exit(1)
        res["cuda-rowmax"].append(ms["cuda-rowmax"])
        res["sdpa-efficient"].append(ms["sdpa-efficient"])
        res["ratio"].append(ms["sdpa-efficient"] / ms["cuda-rowmax"])
        print(f"{case.name} round {r}: rowmax {ms['cuda-rowmax']:.4f} ms  efficient {ms['sdpa-efficient']:.4f} ms"
              f"  ratio {res['ratio'][-1]:.4f}  ({time.time() - t0:.0f} s)", flush=True)
    res["ratio_median"] = statistics.median(res["ratio"])
    res["ratio_min"], res["ratio_max"] = min(res["ratio"]), max(res["ratio"])
    out["cases"][case.name] = res
    print(case.name, "median ratio", round(res["ratio_median"], 4), "range", round(res["ratio_min"], 4),
          round(res["ratio_max"], 4), flush=True)
Path(os.environ.get("OUT", "/tmp"), "fp32_rounds.json").write_text(json.dumps(out, indent=2, default=str))
