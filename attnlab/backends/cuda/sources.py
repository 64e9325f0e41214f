"""Where the CUDA sources are, and the one text NVRTC compiles for a kernel family.

Each ``kernels/attn_<family>.cu`` includes the headers it needs (``attn_params.cuh``, ``attn_dtype.cuh``,
``attn_mask.cuh``, ``attn_softmax.cuh``; each ``#pragma once``) and compiles alone with nvcc. NVRTC gets the
same file with every ``#include "..."`` replaced by the header's text, each header once, in include order:
one text, so NVRTC needs no include path and CuPy's on-disk cache key (the source text) changes whenever a
header does. The explicit instantiations at the end of each ``.cu`` are for nvcc (``#ifndef
__CUDACC_RTC__``); NVRTC instantiates the one variant it is asked for by name expression.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

NVRTC_OPTIONS = ("-std=c++17",)

_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$')


def kernels_dir():
    """Where the .cu files are: the package ``attnlab.kernels`` of an installed wheel, else ``kernels/``
    beside ``attnlab/`` in a source checkout (``PYTHONPATH=.``)."""
    try:
        return resources.files("attnlab.kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[3] / "kernels"


def resolve_includes(name: str, seen: set[str] | None = None) -> str:
    """The text of ``kernels/<name>`` with each ``#include "header"`` replaced by that header's resolved text
    (a header already included is dropped, as ``#pragma once`` does; the pragma lines themselves stay)."""
    seen = set() if seen is None else seen
    seen.add(name)
    out = []
    for line in kernels_dir().joinpath(name).read_text().splitlines():
        m = _INCLUDE.match(line)
        if m is None:
            out.append(line)
        elif m.group(1) not in seen:
            out.append(f"// ---- {m.group(1)} (inlined) ----")
            out.append(resolve_includes(m.group(1), seen))
            out.append(f"// ---- end of {m.group(1)} ----")
    return "\n".join(out) + "\n"


def kernel_source(family: str) -> str:
    """The CUDA source of ``family`` with its headers inlined: what NVRTC compiles."""
    return resolve_includes(f"attn_{family}.cu")
