#!/usr/bin/env bash
# the Hopper backward's GPU tests, then its time beside the portable backward and sdpa-cudnn
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
{ echo "commit ${ATTNLAB_COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
S=$(date +%s)
timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_hopper_backward.py > "$out/gpu-tests-bwd.txt" 2>&1
echo "rc=$? $(( $(date +%s) - S )) s" >> "$out/gpu-tests-bwd.txt"; tail -12 "$out/gpu-tests-bwd.txt"
S=$(date +%s)
timeout 110 python3 .wip/hopper-bwd/bwd_ab.py "$out/bwd-ab.json" > "$out/bwd-ab.txt" 2>&1
echo "rc=$? $(( $(date +%s) - S )) s" >> "$out/bwd-ab.txt"; tail -8 "$out/bwd-ab.txt" | cut -c1-600
