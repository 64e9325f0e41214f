#!/usr/bin/env bash
# From the repository root with the series applied. STEPS (default "tests dense ladder", about 8 minutes on an
# H100) picks what runs:
#   tests     the CUDA GPU tests and test_contract's cuda-mma cases, on the series' kernel;
#   dense     the dense suite: the series' kernel ("base") beside sdpa-flash, sdpa-cudnn and triton, then each
#             variant of var/ (a patch of the series' kernel; VARIANTS lists them) beside sdpa-flash in its own
#             process (head = main's kernel);
#   ladder    the CUDA ladder (cuda_ladder), whose cuda-mma rows the notebooks' CUDA chapter shows;
#   sanitize  compute-sanitizer memcheck and racecheck on tools/sanitize_cuda.py mma (a few minutes).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
here=$(dirname "$0")
steps=" ${STEPS:-tests dense ladder} "
out=${OUT:-/tmp/attnlab-out}; mkdir -p "$out"
{
  echo "commit ${ATTNLAB_COMMIT:-unknown} steps${steps}"; date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if [[ $steps == *" tests "* ]]; then
  S=$(date +%s)
  timeout "${T_S:-170}" python3 -m pytest -m gpu -n 16 -v -rfEs -p no:cacheprovider tests/test_cuda.py \
    tests/test_contract.py -k "mma or test_cuda" > "$out/tests.txt" 2>&1
  echo "tests rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/tests.txt"
  grep -E "FAILED|ERROR" "$out/tests.txt" | head -20; tail -2 "$out/tests.txt"
fi
if [[ $steps == *" dense "* ]]; then
  for v in base ${VARIANTS:-head ffma_skip bn64 bn64_noexplicit fa2tiles_noexplicit}; do
    S=$(date +%s)
    b="cuda-mma sdpa-flash"; [ "$v" = base ] && b="cuda-mma sdpa-flash sdpa-cudnn triton"
    timeout 120 python3 "$here/variant_run.py" "$v" bench --suite dense --backends $b --out "$out/var/$v" \
      --no-progress > "$out/var_$v.txt" 2>&1
    echo "variant $v rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/var_$v.txt"
  done
  python3 "$here/summarize.py" "$out/var" | tee "$out/variants.txt"
  tar czf "$out/var.tgz" -C "$out" var && rm -rf "$out/var"
fi
if [[ $steps == *" ladder "* ]]; then
  S=$(date +%s)
  timeout 80 python3 -m attnlab.lessons.cuda_ladder "$out/cuda-ladder.json" > "$out/ladder.txt" 2>&1
  echo "ladder rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/ladder.txt"
fi
if [[ $steps == *" sanitize "* ]]; then
  for tool in memcheck racecheck; do
    S=$(date +%s)
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 python3 tools/sanitize_cuda.py mma \
      > "$out/sanitize-$tool.txt" 2>&1
    echo "$tool rc=$? $(( $(date +%s) - S )) s" | tee -a "$out/sanitize-$tool.txt"; tail -2 "$out/sanitize-$tool.txt"
  done
fi
