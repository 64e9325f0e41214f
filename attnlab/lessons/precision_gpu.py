"""The GPU's own precision, measured beside notebook 07's emulations: CUDA's ``expf`` and ``__expf`` on the inputs
of :func:`attnlab.lessons.precision.exp_error_table`, and float32 attention with IEEE products against TF32 ones
and with ``expf`` against ``__expf`` (through attnlab's own kernels), each checked against the float64 reference.

:func:`measure` runs on a GPU (``python -m attnlab.lessons.precision_gpu OUT.json``) and writes one JSON file with
its environment; :func:`recorded` reads it back where there is no GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from attnlab import check
from attnlab.lessons import precision
from attnlab.paths import DATA_DIR
from attnlab.reference import reference

#: Where the H200's measurement is kept.
RECORDED = DATA_DIR / "experiments" / "nvidia-h200" / "precision-gpu.json"

_EXPS = r"""
extern "C" __global__ void exps(const float* x, float* accurate, float* fast, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        accurate[i] = expf(x[i]);
        fast[i] = __expf(x[i]);
    }
}
"""


def exp_errors() -> pd.DataFrame:
    """Max relative error in ulps (2^-23) against float64 of CUDA's ``expf`` and ``__expf`` (one CuPy kernel)
    and of ``torch.exp`` on the GPU, beside the CPU's ``torch.exp`` and the emulated ``__expf``, per magnitude."""
    import cupy

    kernel = cupy.RawKernel(_EXPS, "exps")
    rows = []
    for x0, x in precision.exp_inputs():
        exact = torch.exp(x.double())
        xg = cupy.asarray(x.numpy())
        accurate, fast = cupy.empty_like(xg), cupy.empty_like(xg)
        kernel(((x.numel() + 255) // 256,), (256,), (xg, accurate, fast, cupy.int32(x.numel())))
        ulp = lambda y, e=exact: precision.ulp_error(y, e)
        rows.append({"x": x0, "cuda_expf_ulp": ulp(cupy.asnumpy(accurate)),
                     "cuda_fast_expf_ulp": ulp(cupy.asnumpy(fast)),
                     "torch_cuda_exp_ulp": ulp(torch.exp(x.cuda()).cpu()), "cpu_exp_ulp": ulp(torch.exp(x)),
                     "fast_exp_emulated_ulp": ulp(precision.fast_exp(x))})
    return pd.DataFrame(rows)


def _tf32_matmuls(enabled: bool):
    """Set float32 matmuls on the GPU to TF32 (or IEEE); returns a function that restores the setting."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        old = m.fp32_precision
        m.fp32_precision = "tf32" if enabled else "ieee"
        return lambda: setattr(m, "fp32_precision", old)
    old = m.allow_tf32
    m.allow_tf32 = enabled
    return lambda: setattr(m, "allow_tf32", old)


def attention_errors(B: int = 1, H: int = 4, N: int = 256, D: int = 64, seed: int = 0) -> pd.DataFrame:
    """float32 causal attention on the GPU against the float64 reference, judged by the float32 tolerance:
    torch's matmuls (the emulation's formula) with IEEE and with TF32 products, attnlab's Triton kernel without
    and with TF32, and attnlab's CUDA kernels with ``expf`` and ``__expf``, the latter at two softmax
    sharpnesses (q scaled by ``spread``) as :func:`attnlab.lessons.precision.fast_exp_effect` emulates."""
    import attnlab
    from attnlab.backends import cuda
    from attnlab.backends.triton import allow_tf32

    rows = []

    def add(what: str, spread: float, out: torch.Tensor, ref: torch.Tensor) -> None:
        rep = check.compare(out.cpu(), ref)
        rows.append({"computation": what, "spread": spread, "max_abs": rep.max_abs, "rel_l2": rep.rel_l2,
                     "passed": rep.passed})

    for spread in (1.0, 4.0):
        q, k, v = precision.attention_inputs(B, H, N, D, seed)
        q = q * spread
        ref, _ = reference(q, k, v, causal=True)
        qg, kg, vg = q.cuda(), k.cuda(), v.cuda()
        for tf32 in (False, True):
            restore = _tf32_matmuls(tf32)
            try:
                out = precision.attention_fp32(qg, kg, vg, matmul=lambda a, b: a @ b, causal=True)
            finally:
                restore()
            add(f"torch matmuls, {'TF32' if tf32 else 'IEEE'} products", spread, out, ref)
        add("attnlab triton, IEEE products", spread, attnlab.attention(qg, kg, vg, causal=True, backend="triton"), ref)
        with allow_tf32():
            add("attnlab triton, TF32 products", spread,
                attnlab.attention(qg, kg, vg, causal=True, backend="triton"), ref)
        for family in ("cuda-tiled", "cuda-rowmax"):
            for fast in (False, True):
                with cuda.fast_exp(fast):
                    out = attnlab.attention(qg, kg, vg, causal=True, backend=family)
                add(f"attnlab {family}, {'__expf' if fast else 'expf'}", spread, out, ref)
    return pd.DataFrame(rows)


def measure(out: Path | str) -> dict[str, Any]:
    """Both tables on this GPU, with the environment, written to ``out`` (JSON)."""
    from attnlab.bench.results import environment

    env = environment("cuda", ["precision-gpu"])
    env["command"] = f"python -m attnlab.lessons.precision_gpu {out}"
    result = {"environment": env, "exp": exp_errors().to_dict("records"),
              "attention": attention_errors().to_dict("records")}
    Path(out).write_text(json.dumps(result, indent=1))
    return result


def recorded(path: Path | str | None = None) -> dict[str, Any] | None:
    """The recorded measurement: ``{"environment": dict, "exp": DataFrame, "attention": DataFrame}``, or None
    when there is none."""
    path = Path(path if path is not None else RECORDED)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return {"environment": data["environment"], "exp": pd.DataFrame(data["exp"]),
            "attention": pd.DataFrame(data["attention"])}


def verdict(rec: dict[str, Any]) -> str:
    """What the recorded measurement says, in sentences generated from it."""
    env, exp, att = rec["environment"], rec["exp"], rec["attention"]
    bound = 2 + 1.173 * exp["x"].abs()
    worst = exp.loc[exp["cuda_fast_expf_ulp"].idxmax()]
    over = (exp["fast_exp_emulated_ulp"] - exp["cuda_fast_expf_ulp"])
    ieee = att[att["computation"] == "torch matmuls, IEEE products"]["max_abs"].max()
    tf32 = att[att["computation"].str.contains("TF32")]
    accurate = att[att["computation"].str.endswith(", expf")].set_index(["computation", "spread"])["max_abs"]
    fast = att[att["computation"].str.endswith("__expf")]
    fast_vs = [x / accurate[(c.replace("__expf", "expf"), sp)] for c, sp, x in
               zip(fast["computation"], fast["spread"], fast["max_abs"])]
    return (
        f"{env.get('gpu', 'GPU')}, commit {str(env.get('commit', '?'))[:7]}, torch {env.get('torch', '?')}. "
        f"CUDA's expf: at most {exp['cuda_expf_ulp'].max():.2f} ulp (CUDA's programming guide allows 2). "
        f"__expf: at most {worst['cuda_fast_expf_ulp']:.1f} ulp (at x = {worst['x']:g}), within that guide's "
        f"2 + 1.173|x| at every x: {bool((exp['cuda_fast_expf_ulp'] <= bound).all())}; the emulation is "
        f"{'above' if (over >= 0).all() else 'not always above'} it, by {over.min():.1f} to {over.max():.1f} ulp. "
        f"float32 attention with TF32 products: max error {tf32['max_abs'].min():.1e} to {tf32['max_abs'].max():.1e} "
        f"against {ieee:.1e} with IEEE products; {int((~tf32['passed']).sum())} of {len(tf32)} TF32 runs fail the "
        f"float32 tolerance. attnlab's CUDA kernels with __expf: max error {min(fast_vs):.3f}x to "
        f"{max(fast_vs):.3f}x that with expf, every run passing: {bool(fast['passed'].all())}."
    )


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1])["attention"], indent=1))
