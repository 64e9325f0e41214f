#!/usr/bin/env bash
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/attnlab-out}; mkdir -p "$out"
{ echo "commit ${ATTNLAB_COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__)"; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
S=$(date +%s)
timeout 120 python3 -m pytest -m gpu -n 16 -v -rfEs -p no:cacheprovider tests/test_cuda.py tests/test_contract.py -k "mma or either_sign" > "$out/tests.txt" 2>&1
echo "tests rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/tests.txt"; grep -E "FAILED|ERROR" "$out/tests.txt" | head -20; tail -2 "$out/tests.txt"
S=$(date +%s)
timeout 150 python3 -m attnlab bench --suite dense --backends cuda-mma sdpa-flash sdpa-cudnn triton --out "$out/dense" --no-progress > "$out/dense.txt" 2>&1
echo "dense rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/dense.txt"
python3 .wip/mma-softmax/probe/summarize.py "$out" 2>&1 | head -40
tar czf "$out/dense.tgz" -C "$out" dense && rm -rf "$out/dense"
for tool in memcheck racecheck; do
  S=$(date +%s)
  timeout 85 compute-sanitizer --tool $tool --error-exitcode 3 python3 tools/sanitize_cuda.py mma > "$out/sanitize-$tool.txt" 2>&1
  echo "$tool rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/sanitize-$tool.txt"; tail -2 "$out/sanitize-$tool.txt"
done
