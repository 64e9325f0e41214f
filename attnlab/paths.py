"""Where a checkout keeps its recorded data (a wheel has none): ``data/`` beside the package, with the
benchmarks under ``data/bench`` unless ``$ATTNLAB_BENCH_DIR`` points elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

#: The checkout's ``data/`` folder: benchmarks, GPU test logs (``gpu_tests``), notes.
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
#: Recorded benchmarks, one folder per GPU: ``$ATTNLAB_BENCH_DIR``, else ``data/bench``.
BENCH_DIR = Path(os.environ.get("ATTNLAB_BENCH_DIR") or DATA_DIR / "bench")
