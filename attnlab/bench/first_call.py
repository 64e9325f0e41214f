"""First-call time: how long a new problem's first call takes, as a user at a notebook meets it.

Each measurement runs in a new Python process whose compile caches (Triton's, attnlab's tuned configs, CuPy's,
Inductor's) point at a folder of its own. ``import attnlab``, the inputs on the device (the CUDA context up)
and torch's own autograd start-up (:func:`torch_startup`, timed on its own) come before the timer; the timer
runs from the call to the synchronized output, and for ``fwd+bwd`` to the synchronized gradients. The output
(and the gradients) is then checked against the float64 reference: a time is recorded only for a call that
passed.

Rows (``first_call.csv``: backend, case, kind, cold, first_call_s, status, passed, max_abs_err,
torch_startup_s, warm_start (what :mod:`attnlab.warm_start` did, as JSON), notes):

* ``cold=true``: the first process, its caches empty: everything the call needs is compiled in the timed call;
* ``cold=false``: a second process with the first one's caches kept;
* ``kind=warm-new-shape``: in each of those processes, after the first call and the work it left on worker
  threads (:func:`settle`; the wait is in the row's notes), a call of another shape that maps to an already
  compiled kernel variant (same dtypes, head dim, masks and divisibility).

``python -m attnlab.bench.first_call --out data/bench`` measures :data:`PROBLEMS` with attnlab's ``auto`` and
the rivals (:data:`RIVALS`); ``--device cpu`` is a smoke run of the harness.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.bench.suites import BenchCase


@dataclass(frozen=True)
class FirstCallProblem:
    """A problem whose first call is timed: its kind (``fwd``, ``fwd+bwd``, ``decode``), its case, and a case
    of another shape that maps to the same compiled kernel variants (the ``warm-new-shape`` row)."""

    kind: str
    case: BenchCase
    new_shape: BenchCase


def _problem(kind: str, name: str, new: dict[str, Any], **shape: Any) -> FirstCallProblem:
    case = BenchCase("first_call", name, backward=kind == "fwd+bwd", **shape)
    return FirstCallProblem(kind, case, dataclasses.replace(case, name=name + "_new", **new))


def _lengths(B: int, N: int) -> tuple[int, ...]:
    """Ragged lengths in (N/4, N]: every batch entry pads a different amount."""
    return tuple(N - (i * 3 * N) // (4 * B) for i in range(B))


#: The problems: D 64/96/128, bf16/fp16/fp32, causal, padding, an explicit mask (an ALiBi bias), GQA/MQA, windows,
#: decode. Each new shape keeps the divisibility by 16 of every size and stride (Triton specializes on it) and,
#: for the decode, the merge's split tile (16 splits or fewer on a 132-SM GPU), so it maps to the variants the
#: first call compiled.
PROBLEMS: tuple[FirstCallProblem, ...] = (
    _problem("fwd", "bf16_b2_h8_n777_d64_causal", dict(Nq=901), B=2, Hq=8, Nq=777, D=64, causal=True),
    _problem("fwd", "fp16_b2_h8_n3001_d128_causal", dict(Nq=2999), B=2, Hq=8, Nq=3001, D=128, dtype="float16",
             causal=True),
    _problem("fwd", "fp32_b1_h4_n500_d64_causal", dict(Nq=613), B=1, Hq=4, Nq=500, D=64, dtype="float32",
             causal=True),
    _problem("fwd", "bf16_b4_hq8_hkv2_n1000_d96_kvlen", dict(B=3, kv_len=_lengths(3, 1000)), B=4, Hq=8, Hkv=2,
             Nq=1000, D=96, kv_len=_lengths(4, 1000)),
    _problem("fwd", "bf16_b2_h8_n1000_d64_alibi", dict(Nq=1016), B=2, Hq=8, Nq=1000, D=64, bias="alibi"),
    _problem("fwd+bwd", "bf16_b2_hq8_hkv2_n777_d128_causal", dict(Nq=1001), B=2, Hq=8, Hkv=2, Nq=777, D=128,
             causal=True),
    _problem("fwd+bwd", "fp16_b2_hq8_hkv1_n1000_d96_window", dict(Nq=1048), B=2, Hq=8, Hkv=1, Nq=1000, D=96,
             dtype="float16", window=(256, 0)),
    _problem("fwd+bwd", "bf16_b2_h4_n640_d64_kvlen_causal", dict(B=3, kv_len=_lengths(3, 640)), B=2, Hq=4, Nq=640,
             D=64, causal=True, kv_len=_lengths(2, 640)),
    _problem("decode", "bf16_b4_hq32_hkv8_nk4096_d128_kvlen", dict(Nk=8192, kv_len=_lengths(4, 8192)), B=4, Hq=32,
             Hkv=8, Nq=1, Nk=4096, D=128, kv_len=_lengths(4, 4096), align="bottom_right"),
    _problem("decode", "fp16_b2_hq8_hkv8_nq4_nk3000_d64_causal", dict(Nk=3500), B=2, Hq=8, Hkv=8, Nq=4, Nk=3000, D=64,
             dtype="float16", causal=True, align="bottom_right"),
)

#: attnlab's competitor, and the rivals whose first call stands beside it.
ATTNLAB = "auto"
RIVALS = ("sdpa-flash", "sdpa-cudnn", "flex")

#: The variables that move each compile cache into the measurement's own folder.
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TRITON_HOME", "ATTNLAB_CACHE_DIR", "CUPY_CACHE_DIR",
                   "TORCHINDUCTOR_CACHE_DIR")


def cache_env(folder: Path) -> dict[str, str]:
    """The environment variables that point every compile cache under ``folder``."""
    return {var: str(folder / var.lower()) for var in CACHE_VARIABLES}


# ---------------------------------------------------------------------------------------------------------
# The child: one new process, one problem, one competitor
# ---------------------------------------------------------------------------------------------------------
def _call_and_check(prob: FirstCallProblem, case: BenchCase, competitor: str, device: str) -> dict[str, Any]:
    """Draw the case's inputs, time the competitor's first call (and backward), then check it."""
    import torch

    from attnlab.bench.competitors import competitors
    from attnlab.bench.grad import check_grads
    from attnlab.bench.runner import entered, prepare
    from attnlab.bench.timing import sync
    from attnlab.bench.truth import make_case_inputs, make_truth, take_slice
    from attnlab.check import compare

    dev = torch.device(device)
    inp = make_case_inputs(case, dev, seed=0, sets=1)
    leaves = None
    if case.backward:
        leaves = [t.detach().requires_grad_() for t in (inp.qs[0], inp.ks[0], inp.vs[0])]
        inp = dataclasses.replace(inp, qs=[leaves[0]], ks=[leaves[1]], vs=[leaves[2]])
    (comp,) = competitors([competitor])
    prep, why = prepare(comp, inp, dev)
    if prep is None:
        return {"status": why["status"], "notes": why["notes"]}
    sync(dev)
    profile_to = os.environ.get("ATTNLAB_FIRST_CALL_PROFILE")  # a file: the timed call's cProfile, as text
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        _trace_first_import("sympy", profile_to)
    with entered(prep):
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        out = prep.call(0)
        grads = torch.autograd.grad(out, leaves, inp.douts[0]) if leaves is not None else None
        sync(dev)
        seconds = time.perf_counter() - t0
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        with open(profile_to, "a") as f:
            f.write(f"==== {case.name} {competitor} {seconds:.3f} s\n{text.getvalue()}\n")
    truth = make_truth(inp)
    got = out.detach()
    if prep.zero_rows is not None and bool(prep.zero_rows.any()):
        got = got.masked_fill(prep.zero_rows, 0.0)
    rep = compare(take_slice(got, truth.sl), truth.ref, dtype=case.torch_dtype, base=truth.base)
    passed, notes = bool(rep.passed), [] if rep.passed else [f"out: {rep!r}"]
    if grads is not None:
        grads_ok, _, gnote = check_grads(grads, truth, case.torch_dtype)
        passed &= grads_ok
        notes.append(gnote)
    return {"status": "ok" if passed else "failed", "passed": passed, "max_abs_err": rep.max_abs,
            "first_call_s": seconds, "notes": "; ".join(notes)}


def _trace_first_import(module: str, path: str) -> None:
    """Append to ``path`` the stack that first imports ``module`` (profiling: who pays for it)."""
    import builtins
    import traceback

    real = builtins.__import__

    def spy(name, *args, **kwargs):
        if name.split(".")[0] == module and module not in sys.modules:
            builtins.__import__ = real
            with open(path, "a") as f:
                f.write(f"==== first import of {module}\n{''.join(traceback.format_stack(limit=25))}\n")
        return real(name, *args, **kwargs)

    if module not in sys.modules:
        builtins.__import__ = spy


def child(problem: str, competitor: str, device: str) -> list[dict[str, Any]]:
    """In this (new) process: the first call of ``problem``, then its new shape; one row each."""
    import torch

    import attnlab  # imported before the timer, as a notebook does

    prob = next(p for p in PROBLEMS if p.case.name == problem)
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context up before the timer
    startup_s = torch_startup()
    rows = []
    for kind, case in ((prob.kind, prob.case), ("warm-new-shape", prob.new_shape)):
        settled_s = settle() if kind == "warm-new-shape" else None
        got = _call_and_check(prob, case, competitor, device)
        if settled_s is not None:
            got["notes"] = "; ".join(n for n in (got.get("notes"), f"background settled in {settled_s:.3f} s") if n)
        rows.append({"backend": competitor, "case": prob.case.name, "kind": kind, **got,
                     "torch_startup_s": round(startup_s, 3), "warm_start": json.dumps(attnlab.warm_start.report())})
        if got["status"] != "ok":
            break
    return rows


def settle() -> float:
    """Wait for the work a first call left on attnlab's worker threads (compiles ahead, Triton's launchers being
    built), as a notebook's next cell finds it done: the warm-new-shape row times a warm process, not one still
    compiling. Returns the seconds waited (0 when the Triton backend was never imported)."""
    background = sys.modules.get("attnlab.backends.triton.background")
    t0 = time.perf_counter()
    if background is not None:
        background.drain()
    return time.perf_counter() - t0


def torch_startup() -> float:
    """torch's own once-per-process start-up that a first backward pays whatever computed the forward, done
    before the timer for every competitor alike; returns its seconds (the ``torch_startup_s`` column).

    ``torch.autograd.grad`` with a gradient tensor imports ``torch.fx.experimental.symbolic_shapes`` (and sympy
    with it) the first time it runs, as a CUDA context is made by the first CUDA tensor."""
    import torch

    t0 = time.perf_counter()
    x = torch.ones(1, requires_grad=True)
    torch.autograd.grad(x * 2, x, torch.ones(1))
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------
# The parent: a new process per measurement, caches in a folder of their own
# ---------------------------------------------------------------------------------------------------------
def _run_child(problem: str, competitor: str, device: str, env: dict[str, str], timeout_s: float) -> list[dict]:
    cmd = [sys.executable, "-m", "attnlab.bench.first_call", "--child", problem, competitor, "--device", device]
    try:
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [{"backend": competitor, "case": problem, "status": "error", "notes": f"timed out after {timeout_s} s"}]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [{"backend": competitor, "case": problem, "status": "error", "notes": tail[:300]}]
    return [json.loads(ln) for ln in lines]


def measure(problems: Sequence[FirstCallProblem], comps: Sequence[str], device: str, timeout_s: float = 300.0,
            env: dict[str, str] | None = None, progress: bool = True,
            write_to: Path | None = None, warm: bool = True) -> list[dict[str, Any]]:
    """Every (problem, competitor): a cold process (caches empty), then, with ``warm``, a warm one (caches
    kept). With ``write_to``, the CSV is rewritten after each process, so that a run cut short keeps what it
    measured."""
    rows = []
    for prob in problems:
        for comp in comps:
            with tempfile.TemporaryDirectory(prefix="attnlab-first-call-") as folder:
                for cold in (True, False) if warm else (True,):
                    got = _run_child(prob.case.name, comp, device, {**(env or {}), **cache_env(Path(folder))},
                                     timeout_s)
                    for r in got:
                        r.setdefault("kind", prob.kind)
                        r["cold"] = cold
                        rows.append(r)
                        if write_to is not None:
                            write_rows(write_to, rows)
                        if progress:
                            print(f"{r['backend']:>10} {r['case']:<42} {r['kind']:<14} cold={cold!s:<5} "
                                  f"{r.get('first_call_s', float('nan')):8.3f} s  {r['status']} {r.get('notes', '')}"
                                  [:200], flush=True)
    return rows


COLUMNS = ("backend", "case", "kind", "cold", "first_call_s", "status", "passed", "max_abs_err", "torch_startup_s",
           "warm_start", "notes")


def write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """The rows as a CSV of :data:`COLUMNS` (missing values empty)."""
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore", restval="")
        out.writeheader()
        out.writerows(rows)


def main(argv: Sequence[str] | None = None) -> int:
    from attnlab.cli import OneLineParser

    p = OneLineParser(prog="python -m attnlab.bench.first_call", description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=2, metavar=("PROBLEM", "COMPETITOR"), help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="root folder: writes <out>/<gpu-slug>/first_call.csv and .json")
    p.add_argument("--backends", nargs="+", default=[ATTNLAB, *RIVALS])
    p.add_argument("--problems", default=None, help="only problems whose name contains this text")
    p.add_argument("--timeout-s", type=float, default=300.0, help="most seconds one process may take")
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="extra environment of every process")
    p.add_argument("--cold-only", action="store_true", help="no second process with the caches kept")
    p.add_argument("--name", default="first_call", help="the stem of the CSV and JSON written under --out")
    args = p.parse_args(argv)
    if args.child:
        for row in child(*args.child, args.device):
            print(json.dumps(row), flush=True)
        return 0
    if args.timeout_s <= 0:
        p.error(f"--timeout-s must be positive; got {args.timeout_s}")
    if not args.name.replace("_", "").replace("-", "").isalnum():
        p.error(f"--name takes letters, digits, '_' and '-'; got {args.name!r}")
    bad = [e for e in args.env if "=" not in e]
    if bad:
        p.error(f"--env takes NAME=VALUE; got {bad[0]!r}")
    problems = [q for q in PROBLEMS if args.problems is None or args.problems in q.case.name]
    if not problems:
        p.error(f"no problem's name contains {args.problems!r}")
    folder = None
    if args.out is not None:  # the environment first, then the rows as they come
        from attnlab.bench.results import device_name, environment, gpu_slug

        folder = Path(args.out) / gpu_slug(device_name(args.device))
        folder.mkdir(parents=True, exist_ok=True)
        meta = environment(args.device, list(argv or sys.argv[1:]), prog=("python", "-m", "attnlab.bench.first_call"))
        (folder / f"{args.name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    csv_path = None if folder is None else folder / f"{args.name}.csv"
    measure(problems, args.backends, args.device, args.timeout_s, dict(e.split("=", 1) for e in args.env),
            write_to=csv_path, warm=not args.cold_only)
    if csv_path is not None:
        print(f"wrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
