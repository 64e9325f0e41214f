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
        from attnlab.backends.cuda.compile_check import compile_check_main

        return compile_check_main(argv[1:])
    if argv and argv[0] == "bench":
        from attnlab.bench import main as bench_main

        return bench_main(argv[1:])
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
