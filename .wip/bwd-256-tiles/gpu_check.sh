#!/usr/bin/env bash
# The GPU checks of .wip/bwd-256-tiles/ (git am its two patches first, then set ATTNLAB_COMMIT): the portable
# backward's GPU tests, among them D 256 and D 192 / Dv 128 at 8x the CPU lengths, and the packed ones; then the
# product's new tiles against the old default pair and two others, beside compiled Flex on the varlen suite's MLA
# case and SDPA on dense D 256 and D 192 calls (.wip/bwd-0712d/bwd256_ab.py). About 5 minutes on an H100.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
{ echo "commit ${ATTNLAB_COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
S=$(date +%s)
timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider -n 8 -rfE tests/test_triton_bwd.py tests/test_varlen.py > "$out/gpu-tests.txt" 2>&1
echo "pytest rc=$? $(( $(date +%s) - S )) s" >> "$out/gpu-tests.txt"; tail -2 "$out/gpu-tests.txt" | cut -c1-300
grep -E "^FAILED|^ERROR" "$out/gpu-tests.txt" | head -5 | cut -c1-250
S=$(date +%s)
timeout 240 python3 .wip/bwd-0712d/bwd256_ab.py "$out/bwd256-ab.json" > "$out/bwd256-ab.txt" 2>&1
echo "bwd256 rc=$? $(( $(date +%s) - S )) s"; grep -v Warn "$out/bwd256-ab.txt" | tail -5 | cut -c1-330
