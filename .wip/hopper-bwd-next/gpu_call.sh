#!/usr/bin/env bash
# With the series applied (git am .wip/hopper-bwd-next/*.patch): the Hopper backward's GPU tests (every order, ALiBi, D 64),
# then the orders' times beside the portable backward and sdpa-cudnn, and ALiBi's beside the portable one and Flex.
# Usage: ATTNLAB_COMMIT=<sha> bash .wip/hopper-bwd-next/gpu_call.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
{ echo "commit ${ATTNLAB_COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
S=$(date +%s)
timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs tests/test_hopper_backward.py > "$out/gpu-tests.txt" 2>&1
echo "rc=$? $(( $(date +%s) - S )) s" >> "$out/gpu-tests.txt"; grep -E "FAIL|ERROR|passed|failed|rc=" "$out/gpu-tests.txt" | tail -8
S=$(date +%s)
timeout 330 python3 .wip/hopper-bwd-next/next_ab.py "$out/next-ab.json" > "$out/next-ab.txt" 2>&1
echo "rc=$? $(( $(date +%s) - S )) s" >> "$out/next-ab.txt"; tail -8 "$out/next-ab.txt" | cut -c1-700
