"""How fast the exponentials of a softmax are on the GPU: ``exp`` against ``exp2``, in CUDA C and in Triton.

A softmax computes one exponential per score. The GPU's special-function unit computes only ``2^x``
(``ex2.approx``); every other exponential is built on it. CUDA's accurate ``expf`` adds range reduction and a
correction around it, its fast ``__expf`` is one multiply by log2(e) and ``ex2.approx``, and ``exp2f`` is
``ex2.approx`` itself. Triton's ``tl.exp`` on float32 lowers to the multiply and ``ex2.approx.f32``, which keeps
denormals (more instructions than the flush-to-zero form), and ``tl.math.exp2`` to ``ex2.approx.ftz.f32`` alone.
attnlab's kernels fold log2(e) into the score scale and call ``exp2``, so they pay neither the correction nor
the extra multiply.

Each variant runs the same loop: every thread sums ``REPS`` exponentials of independent arguments, so the
exponential's throughput, not memory, sets the time. :func:`measure` times them on a GPU
(``python -m attnlab.lessons.exp_speed OUT.json``) and writes one JSON file with its environment;
:func:`recorded` reads it back where there is no GPU (notebook 04).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd
import torch

from attnlab.paths import DATA_DIR

#: Where the recorded GPU's measurement is kept.
RECORDED = DATA_DIR / "experiments" / "nvidia-h200" / "exp-speed.json"
#: Exponentials per thread, and threads (one per element).
REPS, N = 512, 1 << 22

#: The CUDA C variants: the name as a notebook says it, and the expression for ``e^v`` (or ``2^v``).
CUDA_VARIANTS = {"CUDA expf (accurate)": "expf(v)", "CUDA __expf (fast)": "__expf(v)",
                 "CUDA exp2f": "exp2f(v)"}

_CUDA_SOURCE = r"""
extern "C" __global__ void exp_loop(const float* x, float* y, int n, int reps) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i], total = 0.0f;
    for (int r = 0; r < reps; ++r) {
        total += EXPR;
        v -= 0.0009765625f;  // the next argument: independent of the last exponential
    }
    y[i] = total;
}
"""


def _cuda_kernels() -> dict:
    import cupy

    return {name: cupy.RawKernel(_CUDA_SOURCE.replace("EXPR", expr), "exp_loop")
            for name, expr in CUDA_VARIANTS.items()}


def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def exp_loop(X, Y, n, reps, USE_EXP2: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(X + offs, mask=offs < n, other=0.0)
        total = tl.zeros([BLOCK], tl.float32)
        for _ in range(reps):
            if USE_EXP2:
                total += tl.math.exp2(v)
            else:
                total += tl.exp(v)
            v = v - 0.0009765625
        tl.store(Y + offs, total, mask=offs < n)

    return exp_loop


def _time_ms(fn, reps: int = 20) -> float:
    """The median of ``reps`` runs timed by CUDA events (``attnlab.bench.timing``) after two warm-up runs."""
    from attnlab.bench.timing import median, time_calls

    for _ in range(2):
        fn()
    return median(time_calls(lambda _: fn(), 1, reps, torch.device("cuda")))


def measure(out: Path | str) -> list[dict]:
    """Time every variant on this GPU (each result checked against float64 sums first); write the rows and
    their environment to ``out``."""
    import cupy

    g = torch.Generator(device="cuda").manual_seed(0)
    x = -8.0 * torch.rand(N, device="cuda", generator=g)  # softmax arguments: s - m <= 0
    y = torch.empty_like(x)
    steps = torch.arange(REPS, device="cuda", dtype=torch.float64) * 0.0009765625
    args = x.double()[:4096, None] - steps[None, :]
    want = {"e": torch.exp(args).sum(1), "2": torch.exp2(args).sum(1)}
    rows = []
    kernels = _cuda_kernels()
    for name, expr in CUDA_VARIANTS.items():
        def run(k=kernels[name]):
            k(((N + 255) // 256,), (256,), (cupy.asarray(x), cupy.asarray(y), cupy.int32(N), cupy.int32(REPS)))
        rows.append(_row(name, run, y, want["2" if "exp2" in expr else "e"]))
    tk = _triton_kernel()
    for name, use_exp2 in (("Triton tl.exp", False), ("Triton tl.math.exp2", True)):
        def run(use_exp2=use_exp2):
            tk[((N + 1023) // 1024,)](x, y, N, REPS, USE_EXP2=use_exp2, BLOCK=1024, num_warps=4)
        rows.append(_row(name, run, y, want["2" if use_exp2 else "e"]))
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cupy": cupy.__version__,
           "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"), "reps": REPS, "n": N}
    Path(out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return rows


def _row(name: str, run, y: torch.Tensor, want: torch.Tensor) -> dict:
    run()
    torch.cuda.synchronize()
    rel = float(((y[: want.numel()].double() - want).abs() / want).max())
    row = {"variant": name, "max_rel_err": rel, "passed": rel < 1e-4}
    if row["passed"]:  # a time only for a result that passed on these inputs
        ms = _time_ms(run)
        row.update(ms=round(ms, 4), g_exp_per_s=round(N * REPS / ms / 1e6, 1))
    print(row, flush=True)
    return row


def recorded(path: Path | str | None = None) -> pd.DataFrame | None:
    """The recorded rows (variant, ms, G exponentials per second, max relative error of the sums, passed) with
    each variant's time over CUDA exp2f's (``x exp2f``); None when nothing is recorded."""
    p = Path(path) if path is not None else RECORDED
    if not p.exists():
        return None
    df = pd.DataFrame(json.loads(p.read_text())["rows"]).set_index("variant")
    if "ms" in df and "CUDA exp2f" in df.index:
        df["x exp2f"] = df["ms"] / df.loc["CUDA exp2f", "ms"]
    return df


def environment(path: Path | str | None = None) -> dict:
    """Where and at which commit the recorded timing was measured (empty when nothing is recorded)."""
    p = Path(path) if path is not None else RECORDED
    return json.loads(p.read_text())["environment"] if p.exists() else {}


if __name__ == "__main__":
    measure(sys.argv[1])
