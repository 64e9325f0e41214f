"""The one-off experiments' shared edges (a model's training step, a client check: ``llama_sdpa``,
``varlen_attn_step``, ``hf_clients``, the Hopper probes): the short environment their JSON records, the loop over
a probe's cases, and their command line, ``python -m attnlab.bench.<name> OUT.json``, which runs the experiment,
writes the record and prints it."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def run_environment(device: str) -> dict[str, Any]:
    """torch, the GPU, the commit (``$ATTNLAB_COMMIT``: the device's checkout may not know it) and the date."""
    return {"torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None,
            "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"),
            "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def write(result: dict, out: str | None) -> dict:
    """Write ``result`` as JSON to ``out`` (nothing with None); returns it."""
    if out is not None:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def run_rows(cases: Iterable[tuple], one: Callable[..., dict], out: str | None, device: str = "cuda",
             extra: dict[str, Any] | None = None) -> dict:
    """``one(*case)`` for each case, each row printed as it comes (a cut run still shows what it measured), then
    the record ``{"environment", **extra, "rows"}`` written to ``out``."""
    rows = []
    for case in cases:
        rows.append(one(*case))
        print(rows[-1], flush=True)
    return write({"environment": run_environment(device), **(extra or {}), "rows": rows}, out)


def needs_sm90() -> str | None:
    """Why this machine cannot run a Hopper experiment (None: it has an sm_90 GPU)."""
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return None if ok else "needs an sm_90 GPU"


def main(module: str, doc: str, run: Callable[[str], dict], argv: Sequence[str] | None = None,
         needs: Callable[[], str | None] | None = None) -> int:
    """The command line of an experiment module: one argument, the JSON file; ``needs()`` says why this machine
    cannot run it (a one-line error, exit 2) or None; then ``run(out)``, its record printed."""
    from attnlab.cli import OneLineParser

    parser = OneLineParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    parser.add_argument("out", help="the JSON file to write")
    args = parser.parse_args(argv)
    why = needs() if needs is not None else None
    if why is not None:
        print(f"{parser.prog}: error: {why}", file=sys.stderr)
        return 2
    print(json.dumps(run(args.out), indent=1))
    return 0
