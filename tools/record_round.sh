#!/usr/bin/env bash
# One GPU call that re-records benchmark suites and, optionally, runs GPU tests first; logs and a tarball of
# the suites under $OUT. Usage on the GPU machine:
#   ATTNLAB_COMMIT=<sha> bash tools/record_round.sh "<suites>" <bench deadline s> [pytest args...]
# Write the sha out as computed on your own checkout: the device machine's copy of .git may be stale, so
# $(git rev-parse HEAD) evaluated there can name an older commit than the working tree it runs.
# REQUIRE_GPU=H200 records only on a GPU whose name contains it (a call for an H200 may get an H100): on another
# it logs the GPU and exits 0 at once, so the call costs its start alone.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/attnlab-out}
suites=$1 deadline=$2
shift 2
mkdir -p "$out"
{
  echo "commit ${ATTNLAB_COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__)"
} > "$out/log.txt" 2>&1
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)
if [ -n "${REQUIRE_GPU:-}" ] && ! echo "$gpu_name" | grep -qiF "$REQUIRE_GPU"; then
  echo "the GPU is not $REQUIRE_GPU: nothing recorded"; head -3 "$out/log.txt"; exit 0
fi
if [ $# -gt 0 ]; then
  timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$@" > "$out/gpu-tests.txt" 2>&1
  echo "rc=$?" >> "$out/gpu-tests.txt"
  tail -4 "$out/gpu-tests.txt"
fi
# shellcheck disable=SC2086
python3 -m attnlab bench --suite $suites --no-progress --deadline-s "$deadline" --out "$out/bench" > "$out/bench.txt" 2>&1
echo "bench rc=$?" >> "$out/bench.txt"
tail -40 "$out/bench.txt"
tar czf "$out/bench.tgz" -C "$out" bench && rm -r "$out/bench"
