#!/usr/bin/env bash
# One GPU call: the GPU tests, then the benchmark suites given as arguments (each a quoted argument list for
# `python -m attnlab bench`), each with its log under $OUT. Usage on the GPU machine:
#   ATTNLAB_COMMIT=<sha> bash tools/gpu_session.sh TEST_SECONDS "--suite latency ..." "--suite dense ..."
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/attnlab-out}
mkdir -p "$out"
test_s=$1; shift
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__)"
  echo "commit ${ATTNLAB_COMMIT:-unknown}"
} > "$out/env.txt" 2>&1
if [ "$test_s" -gt 0 ]; then
  timeout "$test_s" python3 -m pytest -m gpu -q -p no:cacheprovider -n 16 tests -rfE > "$out/gpu_tests.txt" 2>&1
  echo "pytest rc=$?" >> "$out/gpu_tests.txt"
  tail -5 "$out/gpu_tests.txt"
fi
i=0
for args in "$@"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  python3 -m attnlab bench $args --no-progress > "$out/bench_$i.txt" 2>&1
  echo "bench $i ($args) rc=$?" | tee -a "$out/bench_$i.txt"
  tail -3 "$out/bench_$i.txt"
done
mkdir -p "$out/data"
tar czf "$out/data/bench.tgz" data/bench
