#!/usr/bin/env bash
# The GPU must-shows of issues 28 and 29 that one call can hold, as parts (each writes under $OUT):
#   tests [SHARD/SHARDS]  the whole `pytest -m gpu` suite (or one of SHARDS slices of its files), 8 workers
#   rivals                first calls of SDPA's flash and cuDNN and compiled Flex on every first-call problem
#   firstcall             attnlab's first calls (auto), cold and warm
#   tuning                the shipped table against attnlab.tune, beside sdpa-cudnn
#   before DIR            the dense and decode suites at the checkout in DIR and at this one, interleaved by suite
# Usage on the GPU machine: ATTNLAB_COMMIT=<sha> bash tools/house_checks.sh PART [ARGS]
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/attnlab-out}
mkdir -p "$out"
part=$1; shift
case "$part" in
  tests)
    files=$(ls tests/test_*.py)
    if [ $# -gt 0 ]; then
      shard=${1%/*}; shards=${1#*/}
      files=$(echo "$files" | awk -v s="$shard" -v n="$shards" 'NR % n == s % n')
    fi
    # shellcheck disable=SC2086
    timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 $files -rfE > "$out/gpu-tests.txt" 2>&1
    echo "pytest rc=$?" >> "$out/gpu-tests.txt"; tail -5 "$out/gpu-tests.txt" ;;
  rivals)
    timeout 560 python3 -m attnlab.bench.first_call --backends sdpa-flash sdpa-cudnn flex --out "$out/bench" \
      > "$out/first-call-rivals.txt" 2>&1; tail -3 "$out/first-call-rivals.txt" ;;
  firstcall)
    timeout 400 python3 -m attnlab.bench.first_call --backends auto --out "$out/bench" > "$out/first-call.txt" 2>&1
    tail -3 "$out/first-call.txt" ;;
  tuning)
    timeout 300 python3 -m attnlab bench --suite tuning --out "$out/bench" --no-progress > "$out/tuning.txt" 2>&1
    tail -6 "$out/tuning.txt" ;;
  before)
    dir=$1
    for suite in dense decode; do
      (cd "$dir" && PYTHONPATH=. timeout 250 python3 -m attnlab bench --suite "$suite" --backends triton-decode \
        triton sdpa-cudnn --out "$out/before" --no-progress > "$out/before-$suite.txt" 2>&1)
      timeout 250 python3 -m attnlab bench --suite "$suite" --backends triton-decode triton sdpa-cudnn \
        --out "$out/after" --no-progress > "$out/after-$suite.txt" 2>&1
    done
    tail -4 "$out"/before-*.txt "$out"/after-*.txt ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
