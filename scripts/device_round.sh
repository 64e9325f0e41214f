#!/usr/bin/env bash
# One GPU call of this session's round: the launcher test on the GPU's Triton, the fast-path GPU tests, the
# launch-cost and call probes, then the latency and decode suites. Logs and a tarball of the suites under $OUT.
# Usage on the GPU machine: ATTNLAB_COMMIT=<sha> bash scripts/device_round.sh
set -u
export PYTHONPATH=.:scripts PYTHONUNBUFFERED=1
out=${OUT:-/tmp/attnlab-out}
mkdir -p "$out"
{
  echo "commit ${ATTNLAB_COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton.py -k "direct_c or no_hook" 2>&1 | tail -3
} > "$out/log.txt" 2>&1
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_public_call_gpu.py tests/test_triton_decode.py \
  -k "(fast_path or decode or graph or synchroniz or clamped or streams or held or busy) and not cuda" -rfE \
  > "$out/gpu-tests.txt" 2>&1
echo "rc=$?" >> "$out/gpu-tests.txt"
tail -3 "$out/gpu-tests.txt"
timeout 120 python3 scripts/launch_cost.py > "$out/launch-cost.txt" 2>&1
timeout 150 python3 scripts/call_probe.py > "$out/call-probe.txt" 2>&1
timeout 240 python3 -m attnlab bench --suite latency decode --no-progress --deadline-s 220 --out "$out/bench" \
  > "$out/bench.txt" 2>&1
echo "bench rc=$?" >> "$out/bench.txt"
tail -12 "$out/bench.txt"
tar czf "$out/bench.tgz" -C "$out" bench && rm -r "$out/bench"
