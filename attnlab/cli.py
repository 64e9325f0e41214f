"""Command line: ``python -m attnlab info | check | compile-check | bench``."""

from __future__ import annotations

import argparse
import platform
import sys

import torch


def _version(mod: str) -> str:
    try:
        m = __import__(mod)
    except Exception as e:  # any import failure is information here, not an error
        return f"not importable ({type(e).__name__})"
    return getattr(m, "__version__", "?")


def info() -> str:
    """Versions, the device, and each backend's availability with the reason."""
    from attnlab import __version__
    from attnlab.backends import status

    lines = [
        f"attnlab {__version__}  python {platform.python_version()}  {platform.machine()}",
        f"torch   {torch.__version__}  (CUDA build {torch.version.cuda or 'none'})",
        f"triton  {_version('triton')}",
        f"cupy    {_version('cupy')}",
    ]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(
            f"device  {p.name}  sm_{p.major}{p.minor}  {p.multi_processor_count} SMs  "
            f"{p.total_memory / 2**30:.0f} GiB  driver CUDA {torch.version.cuda}"
        )
    else:
        lines.append("device  CPU only (torch.cuda.is_available() is False)")
    lines.append("backends:")
    lines += ["  " + line for line in repr(status()).splitlines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, device and backend availability")
    pc = sub.add_parser("check", help="run attnlab.check.verify on the available backends")
    pc.add_argument("--backends", nargs="*", default=None)
    pc.add_argument("--seed", type=int, default=None)
    pc.add_argument("--scale", type=int, default=1, help="multiply the default case lengths")
    sub.add_parser("compile-check", help="compile every CUDA kernel variant for sm_80 and sm_90", add_help=False)
    sub.add_parser("bench", help="run a benchmark suite on the GPU", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "compile-check":
        from attnlab.backends.cuda.compile_check import compile_check_main

        return compile_check_main(argv[1:])
    if argv and argv[0] == "bench":
        from attnlab.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.cmd == "info":
        print(info())
        return 0
    import pandas as pd

    from attnlab.cases import default_cases
    from attnlab.check import summarize, verify

    df = verify(backends=args.backends, cases=default_cases(args.scale), seed=args.seed, progress=True)
    cols = ["backend", "case", "dtype", "Nq", "Nk", "D", "max_abs", "base_max_abs", "passed", "error"]
    with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 60):
        print(df[[c for c in cols if c in df]].to_string(index=False))
    print(summarize(df))
    print(f"seed {df.attrs['seed']}")
    return 0 if bool(df["passed"].all()) else 1
