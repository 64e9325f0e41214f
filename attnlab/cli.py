"""Command line: ``attnlab info | check | compile-check | bench`` (also ``python -m attnlab``), one front door."""

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
        try:
            from attnlab.backends.triton.tuned_table import describe

            lines.append(describe(0))
        except ImportError:
            pass
    else:
        lines.append("device  CPU only (torch.cuda.is_available() is False)")
    from attnlab import sdpa_provider

    if sdpa_provider.available():
        state = "active" if sdpa_provider.active() else "inactive: attnlab.sdpa_provider.activate() turns it on"
        lines.append(f"sdpa    attnlab is a registered flash provider of SDPA ({state})")
    else:
        lines.append("sdpa    this torch has no flash-attention registry (torch 2.11 and newer): no SDPA provider")
    lines.append("backends:")
    lines += ["  " + line for line in repr(status()).splitlines()]
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """An argparse type: an int of at least 1 (else a one-line error naming what is allowed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line on stderr (exit 2), never a usage block or a traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def compile_check_parser() -> OneLineParser:
    """``attnlab compile-check [--strict] [--arch sm_80 sm_90] [--family ...] [--jobs N] [--nvcc]``."""
    import os

    from attnlab.backends.cuda.variant import FAMILIES

    ap = OneLineParser(prog="attnlab compile-check",
                                 description="compile every CUDA kernel variant with NVRTC (no GPU needed)")
    ap.add_argument("--strict", action="store_true",
                    help="fail on a spill in mma or in tiled/rowmax for D <= 128, or shared memory over the "
                         "arch limit")
    ap.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    ap.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--jobs", type=positive_int, default=min(4, os.cpu_count() or 2))
    ap.add_argument("--nvcc", nargs="?", const="nvcc", default=None, metavar="PATH",
                    help="also compile each kernels/*.cu alone with nvcc (default: the one on PATH) and compare")
    return ap


def bench_parser() -> OneLineParser:
    """``attnlab bench``'s options (:func:`attnlab.bench.session.run` takes them)."""
    from attnlab.bench.suites import SUITES
    from attnlab.bench.timing import DEFAULT_BUDGET_MS, DEFAULT_MIN_REPS, DEFAULT_REPS

    p = OneLineParser(prog="attnlab bench", description="Benchmark attnlab backends against SDPA and "
                                "FlexAttention; results in <out>/<gpu>/<suite>.csv and .json")
    p.add_argument("--suite", required=True, nargs="+", choices=[*SUITES, "all"],
                   help="suites to run, in this order, in one process (all = every one but quick)")
    p.add_argument("--backends", nargs="+", default=None, help="competitors (default: every one)")
    p.add_argument("--exclude", nargs="+", default=[], help="competitors recorded as skipped")
    p.add_argument("--out", default=None,
                   help="root folder; files go to <out>/<gpu-slug>/ (default: data/bench on a GPU; a --device cpu "
                        "smoke run goes to <tmp>/attnlab-bench, never into the recorded data)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--reps", type=positive_int, default=DEFAULT_REPS,
                   help="most timed calls per measurement (default 30)")
    p.add_argument("--min-reps", type=positive_int, default=DEFAULT_MIN_REPS, help="fewest timed calls (default 3)")
    p.add_argument("--budget-ms", type=float, default=DEFAULT_BUDGET_MS,
                   help="timed milliseconds aimed at per measurement (default 100)")
    p.add_argument("--max-call-s", type=float, default=2.5,
                   help="skip a competitor on a case where its smaller cases predict a call longer than this "
                        "(default 2.5 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default=None, help="only cases whose name contains this text")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no measurement after this many seconds; the rest is recorded as skipped")
    p.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--suite-deadline-s", type=float, default=None,
                   help="start no measurement after this many seconds of each suite (default: the suite's own, "
                        "e.g. latency 60, backward 300; 0: none); --deadline-s still bounds the whole run")
    p.add_argument("--resume", action="store_true", help="keep rows already in the CSVs, run only the missing ones")
    p.add_argument("--keep-others", action="store_true",
                   help="keep the CSV's rows of competitors this run does not measure (e.g. re-record only attnlab "
                        "with --backends triton sdpa-flash); their run_id says when they were measured")
    p.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    p.add_argument("--estimate", action="store_true", help="print the estimated duration and exit")
    p.add_argument("--no-progress", action="store_true")
    return p


def _parser() -> OneLineParser:
    from attnlab import __version__

    parser = OneLineParser(prog="attnlab", description="attnlab: masked attention kernels, checked and measured.")
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    sub.add_parser("info", help="versions, device and backend availability")
    pc = sub.add_parser("check", help="run attnlab.check.verify on the available backends")
    pc.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                    help="backends to check (default: every available one)")
    pc.add_argument("--seed", type=int, default=None)
    pc.add_argument("--scale", type=positive_int, default=1, help="multiply the default case lengths (>= 1)")
    # These two parse their own options (attnlab compile-check --help, attnlab bench --help).
    sub.add_parser("compile-check", help="compile every CUDA kernel variant for sm_80 and sm_90 (no GPU needed)",
                   add_help=False)
    sub.add_parser("bench", help="run a benchmark suite (on a GPU; --device cpu for a smoke run)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``attnlab COMMAND ...``: mistakes in the arguments are reported in one line with exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except (ValueError, TypeError) as e:  # a bad value the parser could not see (a backend name, a suite's case)
        cmd = argv[0] if argv and not argv[0].startswith("-") else ""
        print(f"attnlab{' ' + cmd if cmd else ''}: error: {e}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    parser = _parser()
    if argv and argv[0] == "compile-check":
        from attnlab.backends.cuda.compile_check import compile_check_command

        return compile_check_command(compile_check_parser().parse_args(argv[1:]))
    if argv and argv[0] == "bench":
        from attnlab.bench.session import run

        return run(bench_parser().parse_args(argv[1:]), argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
        return 0
    import pandas as pd

    from attnlab.backends import names, status
    from attnlab.cases import default_cases
    from attnlab.check import all_passed, summarize, verify

    unknown = [b for b in args.backends or [] if b not in names()]
    if unknown:
        parser.exit(2, f"attnlab check: error: unknown backend {unknown[0]!r}; choose from {', '.join(names())}\n")
    here = status()
    off = [b for b in args.backends or [] if b in here and not here[b].available]
    if off:
        parser.exit(2, f"attnlab check: error: backend {off[0]!r} is unavailable here: {here[off[0]].reason}\n")
    df = verify(backends=args.backends, cases=default_cases(args.scale), seed=args.seed, progress=True)
    cols = ["backend", "case", "dtype", "Nq", "Nk", "D", "max_abs", "base_max_abs", "status", "error"]
    with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 60):
        print(df[[c for c in cols if c in df]].to_string(index=False))
    print(summarize(df))
    print(f"seed {df.attrs['seed']}")
    return 0 if all_passed(df) else 1
