"""Where the recorded data lives: ``$ATTNLAB_DATA_DIR`` if set, else ``data/`` beside the package (a checkout).

A wheel carries no data: point ``ATTNLAB_DATA_DIR`` at a checkout's ``data/`` folder (benchmarks, GPU logs, notes)
and every notebook and lesson reads from there. ``$ATTNLAB_BENCH_DIR`` moves only the benchmarks.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The recorded data: benchmarks (``bench``), experiments and GPU test logs, notes.
DATA_DIR = Path(os.environ.get("ATTNLAB_DATA_DIR") or Path(__file__).resolve().parents[1] / "data")
#: Recorded benchmarks, one folder per GPU: ``$ATTNLAB_BENCH_DIR``, else ``<DATA_DIR>/bench``.
BENCH_DIR = Path(os.environ.get("ATTNLAB_BENCH_DIR") or DATA_DIR / "bench")


def data_file(*parts: str) -> Path:
    """A file of the recorded data; a FileNotFoundError that says how to point attnlab at the data when it is
    missing (a wheel install has none)."""
    path = DATA_DIR.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: attnlab's recorded data is not installed with the package. Set "
            "ATTNLAB_DATA_DIR to the data/ folder of a checkout (git clone the repository) and restart the kernel")
    return path
