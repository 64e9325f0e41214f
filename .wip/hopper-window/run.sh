#!/usr/bin/env bash
# One device call (about 6 minutes on an H100), from the repository root with the series applied:
#   1. the Hopper GPU tests and test_contract's triton window cases (the conftest runs the Hopper forward from
#      the first call on a GPU);
#   2. the schedule A/B (four settings; the window rows are new), each output checked and bit-compared;
#   3. the suites' window rows (scoremod's GQA 64/8 window 128, dense's N 16384 window 1024) beside their rivals.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/attnlab-out}; mkdir -p "$out"
{
  echo "commit ${ATTNLAB_COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
S=$(date +%s)
timeout "${T_S:-150}" python3 -m pytest -m gpu -n 16 -v -rfEs -p no:cacheprovider tests/test_hopper.py \
  tests/test_contract.py -k "test_hopper or (triton and window)" > "$out/tests.txt" 2>&1
echo "tests rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/tests.txt"
grep -E "FAILED|ERROR" "$out/tests.txt" | head -20; tail -2 "$out/tests.txt"
S=$(date +%s)
timeout 170 python3 -m attnlab.bench.hopper_persistent_ab "$out/hopper-schedules-ab.json" > "$out/schedules.txt" 2>&1
echo "schedules rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/schedules.txt"; grep -E "window" "$out/schedules.txt"
S=$(date +%s)
timeout 120 python3 -m attnlab bench --suite scoremod dense --cases window --out "$out/bench" --deadline-s 100 \
  --no-progress > "$out/suites.txt" 2>&1
echo "suites rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/suites.txt"; tail -4 "$out/suites.txt"
tar czf "$out/bench.tgz" -C "$out" bench && rm -rf "$out/bench"
