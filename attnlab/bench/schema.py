"""The benchmark CSV's schema: its columns in file order, the statuses, and what every column means.

CSV schema (one file per suite: ``<out>/<gpu-slug>/<suite>.csv``; :data:`COLUMNS`, in this order)
--------------------------------------------------------------------------------------------------
========================  ==========================================================================
run_id                    id of the invocation that wrote the row (UTC timestamp)
suite, case               suite name; case name, unique within the suite
backend                   competitor name (attnlab registry name, ``sdpa-*``, ``flex``)
family                    ``attnlab`` or ``torch`` (SDPA-by-backend and FlexAttention)
status                    ``ok`` (checked, passed, timed) | ``failed`` (check failed: no timing) |
                          ``oom`` | ``unsupported`` | ``unavailable`` | ``error`` (raised) |
                          ``fallback`` (flex left the compiled path) | ``skipped`` (deadline, excluded,
                          or larger than a case that ran out of memory in the memory suite)
passed                    True/False when checked, empty when the output was never produced
B, Hq, Hkv, Nq, Nk, D     shapes (layout bhnd, contiguous)
dtype                     ``bfloat16`` | ``float16`` | ``float32``
causal, align, window     the mask keywords (align ``top_left``/``bottom_right``; window ``left:right``)
mask                      :attr:`attnlab.masks.MaskSpec.kind`, e.g. ``dense``, ``causal``, ``causal_br``,
                          ``kv_len``, ``causal+kv_len``
lengths                   ``kv_len=a;b;...`` / ``q_len=...`` when given, else empty
allowed_frac              allowed (query, key) pairs over Nq*Nk*B (structure: lengths and band)
flops                     useful FLOPs: 4 * D * (allowed score count, summed over batch and query heads);
                          FlashAttention's convention where only allowed scores count. The count is
                          exact, computed per row analytically from the lengths and the band
                          (:func:`allowed_count`), so causal is N(N+1)/2 per head rather than N^2/2
bytes                     fewest bytes a kernel must move: q and out once each, and the K and V rows of
                          the keys any query of that batch entry may attend (contiguous key range from
                          lengths and band), each once
ms, ms_min, ms_iqr        median, minimum and interquartile range of the timed calls, milliseconds (GPU
                          timeline between CUDA events: host launch gaps of back-to-back calls count)
reps                      number of timed calls
tflops                    flops / ms (10^12 FLOP/s, useful FLOPs only)
gbps                      bytes / ms (10^9 B/s); the figure of merit for decode
peak_extra_mib            peak memory beyond inputs and output during one call, MiB (CUDA only)
setup_mib                 memory held by the competitor's per-case setup (SDPA's materialized mask,
                          flex's block mask, repeated K/V), MiB, not counted in peak_extra_mib
max_abs_err, rel_l2       :class:`attnlab.check.Report` of the check (on the slice)
base_max_abs              max|textbook - reference| on the slice (half types), the baseline criterion
check_scope               ``full`` or ``slice b=[..] hq=[..]``
sets                      number of input sets rotated
notes                     free text: the reason of a non-ok status, compile time, warnings
device, gpu               ``cuda``/``cpu``; device name
path                      ``public``: the call a user makes (``attnlab.attention(...)``, a new Problem and
                          its validation every call; SDPA and flex as their own public calls);
                          ``kernel``: an attnlab ``<backend>-kernel`` row, ``backend.forward`` on a Problem
                          validated once outside the timed region. Empty in rows recorded before the
                          column existed (their attnlab rows were the kernel path)
mode                      ``fwd`` (every forward suite), ``fwd+bwd`` or ``bwd`` (backward suite: flops are
                          1x, 3.5x and 2.5x the forward's useful FLOPs); empty in older rows
host_us                   host time per call, microseconds: wall time of back-to-back calls, not
                          synchronized, queued behind a GPU sleep so the host never waits for the GPU
                          unless the call synchronizes (on a CPU: the wall time of the call)
graph_ms                  median GPU time per call in CUDA-graph replay (20 calls rotating over the input
                          sets in one graph, 10 replays), milliseconds: the kernels' time without the
                          host's launches. Suites with ``graph=True`` on a GPU (decode, scoremod-decode);
                          else empty, and empty with a note when the call cannot be captured
========================  ==========================================================================

Beside each CSV, ``<suite>.json`` holds the environment: GPU name, driver, torch, CUDA, cuDNN, triton,
cupy, attnlab version and git commit, date, the command line, the options, and each backend's
availability. :func:`load` reads CSVs back into one DataFrame; :func:`ratios` gives per-suite median
speed ratios to a baseline.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------

#: CSV columns, in file order. Stable: attnlab.bench.plots and notebook 08 read them (module docstring); new
#: columns go at the end, and :func:`attnlab.bench.load` fills the ones an older CSV lacks with empty values.
COLUMNS = [
    "run_id", "suite", "case", "backend", "family", "status", "passed",
    "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "align", "window", "mask", "lengths",
    "allowed_frac", "flops", "bytes", "ms", "ms_min", "ms_iqr", "reps", "tflops", "gbps",
    "peak_extra_mib", "setup_mib", "max_abs_err", "rel_l2", "base_max_abs", "check_scope", "sets",
    "notes", "device", "gpu", "path", "mode", "host_us", "graph_ms",
]

STATUSES = ("ok", "failed", "oom", "unsupported", "unavailable", "error", "fallback", "skipped")

#: attnlab backends docs/contract.md names; listed (as unavailable) even when their module is not in this build.
DESIGN_BACKENDS = ("torch", "sdpa", "triton", "cuda-naive", "cuda-tiled", "cuda-rowmax")

SDPA_KINDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-math": "MATH",
}

MIB = 2.0**20
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
