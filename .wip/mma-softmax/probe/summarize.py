"""Per variant folder under argv[1]: cuda-mma's ratio to sdpa-flash (their time over ours) over the dense suite's
rows, and the rows whose cuda-mma output did not pass the checker."""

import csv
import sys
from pathlib import Path

for f in sorted(Path(sys.argv[1]).glob("*/*/dense.csv")):
    by: dict[str, dict[str, tuple[float, str]]] = {}
    failed, kernel = [], {}
    for r in csv.DictReader(f.open()):
        if r["backend"] == "cuda-mma":
            kernel[r["case"]] = " ".join(n for n in r.get("notes", "").split("; ") if n.startswith("kernel "))
        if r["backend"] == "cuda-mma" and r["passed"] != "True":
            failed.append(f"{r['case']} ({r.get('status', '')})")
        if r["ms"] and r["passed"] == "True":
            by.setdefault(r["case"], {})[r["backend"]] = (float(r["ms"]), r["passed"])
    rows = {c: d["sdpa-flash"][0] / d["cuda-mma"][0] for c, d in by.items() if "cuda-mma" in d and "sdpa-flash" in d}
    ratios = sorted(rows.values())
    if not ratios:
        print(f.parts[-3], "no rows")
        continue
    print(f"{f.parts[-3]:10s} rows {len(ratios)} min {ratios[0]:.3f} median {ratios[len(ratios) // 2]:.3f} "
          f"max {ratios[-1]:.3f} not passed {failed}")
    for c, x in sorted(rows.items()):
        print(f"  {c:40s} {x:.3f} {kernel.get(c, '')}")
