"""Benchmark harness: every attnlab backend against PyTorch's best, side by side, in one run, checked first.

Command line (``python -m attnlab bench``)::

    python -m attnlab bench --suite dense                  # one suite on the GPU it finds
    python -m attnlab bench --suite all --deadline-s 540   # every suite except quick, stop starting work at 540 s
    python -m attnlab bench --suite quick --device cpu     # a smoke run of the harness logic on a CPU
    python -m attnlab bench --suite dense --estimate       # print the time estimate and exit

Suites (:data:`SUITES`): ``dense``, ``padding``, ``prefill``, ``decode``, ``fp32``, ``memory``, ``quick``
(``all`` = every suite but quick). Competitors (:func:`competitors`): each attnlab backend of the registry
(``torch`` is the textbook version; ``reference`` only when asked for), SDPA restricted to one of its
backends (``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-math``) and compiled FlexAttention
(``flex``).

What one measurement is
-----------------------
For each case (shapes, dtype, masks) the harness draws several input sets (q, k, v; masks shared), enough
that together they are at least 4x the L2 (60 MB on an H200; at least 2 sets, at most 8), so that rotating
among them keeps the timed calls from reading a warm L2. For each competitor:

1. the first call runs on set 0 (it also pays JIT, autotuning and compilation); its output is checked with
   :func:`attnlab.check.compare` against the float64 reference computed on the *same inputs*. Large cases
   are checked on a slice (batch entries {0, B-1} and the query heads of one or two kv heads; from
   Nq*Nk >= 2^28 one batch entry and one kv head; always every row and key: the slice is a consistent
   sub-problem because batch entries and heads are independent); the
   ``check_scope`` column says which. Half types also use the baseline criterion, the baseline being the
   textbook torch backend on the same slice. Rows with no allowed key are set to 0 in *competitors'*
   outputs before checking (the contract says 0; SDPA's backends and FlexAttention may not agree); attnlab
   backends are checked as they are. The suites have no such rows by construction.
2. only when the check passed: one more call on set 1 measures the peak extra memory
   (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated before
   the call, minus the output's own bytes) and gives a first time estimate; a few warm-up calls follow
   when a call is short.
3. ``reps`` timed calls rotate over the sets, each between two CUDA events (``time.perf_counter`` on a
   CPU): ``reps = clamp(budget_ms / estimate, min_reps, max_reps)``. ``ms`` is the median.

A failed check, an exception, an out-of-memory error, an unsupported configuration and an unavailable
backend each give a row with its ``status`` and no timing: nothing is dropped.

How the competitors are called
------------------------------
* attnlab backends: the :class:`~attnlab.problem.Problem` of each set is validated once, outside the timed
  region, and the timed call is ``backend.forward(problem, out, None)`` into a fresh output: the kernel
  path of :func:`attnlab.attention` without the argument validation (which costs a host sync when kv_len
  is a device tensor). Mask translation inside a backend (the attnlab ``sdpa`` backend materializes its
  mask) is timed.
* ``sdpa-*``: ``F.scaled_dot_product_attention`` under ``sdpa_kernel(backend)``, with the mask translated
  once by :func:`attnlab.sdpa.sdpa_inputs` (not timed; its bytes are in ``setup_mib``): ``is_causal`` for
  top-left causal with Nq == Nk, otherwise a materialized bool mask or bias. One exception: for pure
  bottom-right causal with Nq != Nk (the prefill suite), ``sdpa-flash`` and ``sdpa-efficient`` get
  ``torch.nn.attention.bias.causal_lower_right``, which they take natively (a materialized mask would make
  flash unsupported); the notes say so. GQA goes through
  ``enable_gqa=True``; where the chosen backend refuses that, K and V are repeated once outside the timed
  region and the notes say so. "No available kernel" is recorded as ``unsupported`` with SDPA's reasons.
* ``flex``: ``torch.compile(flex_attention, fullgraph=True, dynamic=False)`` with a block mask from
  ``create_block_mask`` of the equivalent ``mask_mod`` (lengths, causal/window with either alignment, an
  explicit bool mask) and a ``score_mod`` for a bias. *Compiled once per case*: ``torch._dynamo.reset()``
  before each case, so every case gets exactly one static compilation (the compile time is in the notes),
  and the recompile limit is raised with ``fail_on_recompile_limit_hit`` set where torch has it, so a
  silent fallback to eager cannot happen; in addition a row is marked ``fallback`` (no timing) if dynamo
  compiled a new graph during the timed calls or torch warned about the unfused eager path. On a CPU flex
  is recorded as unsupported (compiling it there costs more than a smoke run should).

Budget and robustness
---------------------
``--suite all`` runs fp32, padding, prefill, decode, memory, dense in that order and prints a crude
estimate first (:func:`estimate_seconds`). Each CSV is rewritten after every row, so an interrupted run
keeps what it measured. ``--deadline-s`` stops starting measurements after that many seconds (the rest
becomes ``skipped``); ``--resume`` keeps the rows already in the CSVs and runs the missing and skipped ones.
A competitor is skipped on a case when its closest smaller case of the suite predicts a call longer than
``--max-call-s`` (scaled by B*Hq*Nq*Nk*D), and in the memory suite once it ran out of memory at a smaller N.
After an exception the CUDA context is probed; if it is lost (an illegal address makes every later call
fail), the process re-executes itself with ``--resume`` and the culprit excluded (its rows say so), so one
broken kernel does not cost the rest of the run.

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
ms, ms_min, ms_iqr        median, minimum and interquartile range of the timed calls, milliseconds
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
========================  ==========================================================================

Beside each CSV, ``<suite>.json`` holds the environment: GPU name, driver, torch, CUDA, cuDNN, triton,
cupy, attnlab version and git commit, date, the command line, the options, and each backend's
availability. :func:`load` reads CSVs back into one DataFrame; :func:`ratios` gives per-suite median
speed ratios to a baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnlab.cases import ShapeDefaults, mask_keywords
from attnlab.masks import MaskSpec

# ---------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------

#: CSV columns, in file order. Stable: attnlab.plots and notebook 08 read them (module docstring).
COLUMNS = [
    "run_id", "suite", "case", "backend", "family", "status", "passed",
    "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "align", "window", "mask", "lengths",
    "allowed_frac", "flops", "bytes", "ms", "ms_min", "ms_iqr", "reps", "tflops", "gbps",
    "peak_extra_mib", "setup_mib", "max_abs_err", "rel_l2", "base_max_abs", "check_scope", "sets",
    "notes", "device", "gpu",
]

STATUSES = ("ok", "failed", "oom", "unsupported", "unavailable", "error", "fallback", "skipped")

#: attnlab backends DESIGN.md names; listed (as unavailable) even when their module is not in this build.
DESIGN_BACKENDS = ("torch", "sdpa", "triton", "cuda-naive", "cuda-tiled", "cuda-rowmax")

SDPA_KINDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-math": "MATH",
}

MIB = 2.0**20
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------------------
# Cases and suites
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchCase(ShapeDefaults):
    """One benchmark configuration: shapes, dtype and mask keywords (layout bhnd, contiguous inputs)."""

    suite: str
    name: str
    B: int
    Hq: int
    Nq: int
    D: int
    dtype: str = "bfloat16"
    Hkv: int | None = None
    Nk: int | None = None
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    align: str | None = None
    kv_len: tuple[int, ...] | None = None
    q_len: tuple[int, ...] | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def keywords(self, device: torch.device | str) -> dict[str, Any]:
        """Mask keywords for :func:`attnlab.attention` / :func:`attnlab.reference` (lengths on ``device``)."""
        return mask_keywords(self, device)

    def spec(self, device: torch.device | str = "cpu") -> MaskSpec:
        """The validated :class:`MaskSpec` of this case."""
        kw = self.keywords(device)
        return MaskSpec.build(self.B, self.Hq, self.Nq, self.nk, device=device, **kw)

    def describe(self) -> dict[str, Any]:
        """The case's columns of a CSV row."""
        win = "" if self.window is None else ":".join("" if w is None else str(w) for w in self.window)
        lengths = []
        if self.kv_len is not None:
            lengths.append("kv_len=" + ";".join(map(str, self.kv_len)))
        if self.q_len is not None:
            lengths.append("q_len=" + ";".join(map(str, self.q_len)))
        spec = self.spec()
        return {
            "suite": self.suite, "case": self.name, "B": self.B, "Hq": self.Hq, "Hkv": self.hkv,
            "Nq": self.Nq, "Nk": self.nk, "D": self.D, "dtype": self.dtype, "causal": self.causal,
            "align": spec.align, "window": win, "mask": spec.kind, "lengths": " ".join(lengths),
        }


def _seeded_lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """n lengths drawn uniformly from [lo, hi] with a fixed seed (the same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=g))


def dense_suite(device: str = "cuda") -> list[BenchCase]:
    """bf16 and fp16; D 64 and 128; (B, N) = (8, 1024), (4, 4096), (1, 16384), H 16; causal and not."""
    cases = []
    for dt in ("bfloat16", "float16"):
        for D in (64, 128):
            for B, N in ((8, 1024), (4, 4096), (1, 16384)):
                for causal in (False, True):
                    tag = "bf16" if dt == "bfloat16" else "fp16"
                    name = f"{tag}_b{B}_h16_n{N}_d{D}_{'causal' if causal else 'full'}"
                    cases.append(BenchCase("dense", name, B=B, Hq=16, Nq=N, D=D, dtype=dt, causal=causal))
    return cases


def padding_suite(device: str = "cuda") -> list[BenchCase]:
    """B8 H16 N4096 D128 bf16, kv_len seeded-uniform in [N/4, N]; with and without (top-left) causal."""
    N = 4096
    kv = _seeded_lengths(8, N // 4, N, seed=6)
    return [
        BenchCase("padding", f"bf16_b8_h16_n{N}_d128_kvlen{'_causal' if c else ''}", B=8, Hq=16, Nq=N, D=128,
                  kv_len=kv, causal=c)
        for c in (False, True)
    ]


def prefill_suite(device: str = "cuda") -> list[BenchCase]:
    """Chunked prefill: Nq 512 queries on Nk 8192 keys, bottom-right causal, B4 H16, D 64 and 128, bf16."""
    return [
        BenchCase("prefill", f"bf16_b4_h16_nq512_nk8192_d{D}_causal_br", B=4, Hq=16, Nq=512, Nk=8192, D=D,
                  causal=True, align="bottom_right")
        for D in (64, 128)
    ]


def decode_suite(device: str = "cuda") -> list[BenchCase]:
    """Decode: Nq 1, GQA Hq 32 / Hkv 8, D128 bf16, KV 8192 and 32768, B 1 and 8; one ragged-cache case."""
    cases = [
        BenchCase("decode", f"bf16_b{B}_hq32_hkv8_nk{Nk}_d128", B=B, Hq=32, Hkv=8, Nq=1, Nk=Nk, D=128)
        for B in (1, 8)
        for Nk in (8192, 32768)
    ]
    kv = _seeded_lengths(8, 32768 // 4, 32768, seed=7)
    cases.append(BenchCase("decode", "bf16_b8_hq32_hkv8_nk32768_d128_kvlen", B=8, Hq=32, Hkv=8, Nq=1, Nk=32768,
                           D=128, kv_len=kv))
    return cases


def fp32_suite(device: str = "cuda") -> list[BenchCase]:
    """IEEE float32 (TF32 off): the seed case B1 H8 N1024 D64 causal, and B8 H16 N2048 D64 causal."""
    return [
        BenchCase("fp32", "fp32_b1_h8_n1024_d64_causal", B=1, Hq=8, Nq=1024, D=64, dtype="float32", causal=True),
        BenchCase("fp32", "fp32_b8_h16_n2048_d64_causal", B=8, Hq=16, Nq=2048, D=64, dtype="float32", causal=True),
    ]


def memory_suite(device: str = "cuda") -> list[BenchCase]:
    """Peak extra memory against N (1024 .. 32768), B2 H16 D128 bf16, no mask; few timed calls.

    The textbook holds about three bf16 score copies at its peak: 3 x 16 GiB at N 16384 fits an H200,
    3 x 64 GiB at N 32768 does not, so it runs out within the range (B1 would not); once a backend has run
    out, the larger cases record it as skipped.
    """
    return [
        BenchCase("memory", f"bf16_b2_h16_n{N}_d128", B=2, Hq=16, Nq=N, D=128)
        for N in (1024, 2048, 4096, 8192, 16384, 32768)
    ]


def quick_suite(device: str = "cuda") -> list[BenchCase]:
    """A smoke run: a few small cases of every kind (smaller still on a CPU)."""
    if str(device).startswith("cpu"):
        n, d = 64, 32
        return [
            BenchCase("quick", "fp32_b1_h2_n64_d32_causal", B=1, Hq=2, Nq=n, D=d, dtype="float32", causal=True),
            BenchCase("quick", "bf16_b2_h2_n64_d32_kvlen", B=2, Hq=2, Nq=n, D=d, kv_len=(20, 64)),
            BenchCase("quick", "bf16_b1_hq4_hkv2_nq16_nk64_causal_br", B=1, Hq=4, Hkv=2, Nq=16, Nk=n, D=d,
                      causal=True, align="bottom_right"),
        ]
    return [
        BenchCase("quick", "bf16_b2_h4_n512_d64_full", B=2, Hq=4, Nq=512, D=64),
        BenchCase("quick", "fp16_b2_h4_n512_d128_causal", B=2, Hq=4, Nq=512, D=128, dtype="float16", causal=True),
        BenchCase("quick", "bf16_b2_h4_n512_d64_kvlen_causal", B=2, Hq=4, Nq=512, D=64, kv_len=(200, 512),
                  causal=True),
        BenchCase("quick", "bf16_b2_h4_nq64_nk1024_d64_causal_br", B=2, Hq=4, Nq=64, Nk=1024, D=64, causal=True,
                  align="bottom_right"),
        BenchCase("quick", "bf16_b2_hq8_hkv2_nq1_nk2048_d128", B=2, Hq=8, Hkv=2, Nq=1, Nk=2048, D=128),
        BenchCase("quick", "fp32_b1_h2_n256_d64_causal", B=1, Hq=2, Nq=256, D=64, dtype="float32", causal=True),
    ]


#: suite name -> function(device) -> cases. ``all`` runs every one but quick, in this order.
SUITES: dict[str, Callable[[str], list[BenchCase]]] = {
    "fp32": fp32_suite,
    "padding": padding_suite,
    "prefill": prefill_suite,
    "decode": decode_suite,
    "dense": dense_suite,
    "memory": memory_suite,
    "quick": quick_suite,
}
ALL_ORDER = ("fp32", "padding", "prefill", "decode", "memory", "dense")

#: Per-suite timing overrides: (most timed calls, timing budget per measurement in ms, fewest timed calls).
#: The memory suite is about bytes: a few calls suffice.
SUITE_TIMING = {"memory": (3, 50.0, 1)}


def _eager_fallbacks(caught: list) -> list[str]:
    """The recorded warnings that say flex_attention ran eagerly (unfused) instead of compiled."""
    return [str(w.message) for w in caught if "without torch.compile" in str(w.message)]


def _timing(case: BenchCase, opts: Options) -> tuple[int, float, int]:
    """(most timed calls, timing budget in ms, fewest timed calls) for ``case``: the suite's override, never
    more calls than the options allow."""
    max_reps, budget, min_reps = SUITE_TIMING.get(case.suite, (opts.max_reps, opts.budget_ms, opts.min_reps))
    return min(max_reps, opts.max_reps), budget, min(min_reps, opts.min_reps)


def _reps_and_warmup(est_ms: float, max_reps: int, budget_ms: float, min_reps: int) -> tuple[int, int]:
    """Timed calls (the budget over the estimated call, clamped) and warm-up calls (fewer for long calls)."""
    reps = int(min(max_reps, max(min_reps, budget_ms // max(est_ms, 1e-3))))
    return reps, 0 if est_ms > 20 else (2 if est_ms > 2 else 5)
DEFAULT_REPS, DEFAULT_BUDGET_MS, DEFAULT_MIN_REPS = 30, 100.0, 3


# ---------------------------------------------------------------------------------------------------------
# Counting: allowed scores, FLOPs, bytes
# ---------------------------------------------------------------------------------------------------------


def row_counts(spec: MaskSpec) -> torch.Tensor:
    """Allowed keys of each query row from the lengths and the band, analytically: int64 [B, Nq] (CPU).

    Row i of batch b (with ``i < Lq_b``) may see keys ``[lo, hi)`` with ``lo = max(0, diag - left)`` and
    ``hi = min(Lk_b, diag + right + 1)`` (unbounded sides give 0 and Lk_b), ``diag = i`` (top-left) or
    ``i + Lk_b - Lq_b`` (bottom-right). An explicit mask is not included (see :func:`allowed_count`).
    """
    lq, lk = (t.view(-1, 1) for t in spec.lengths("cpu"))
    i = torch.arange(spec.Nq, dtype=torch.long).view(1, -1)
    diag = i + spec.diag_offset("cpu").view(-1, 1)
    lo = torch.zeros_like(diag) if spec.left is None else (diag - spec.left).clamp_min(0)
    hi = lk.expand_as(diag) if spec.right is None else torch.minimum(lk, diag + spec.right + 1)
    return (hi - lo).clamp_min(0) * (i < lq)


def allowed_count(spec: MaskSpec, chunk_rows: int = 1024) -> int:
    """Number of allowed (b, h, i, j) scores summed over batch entries and query heads.

    Analytic per row (:func:`row_counts`) when there is no explicit mask; with a bool mask or a bias, the
    predicate (and the bias's -inf entries) is counted exactly, chunk by chunk over rows.
    """
    if spec.mask is None and spec.bias is None:
        return int(row_counts(spec).sum()) * spec.Hq
    total = 0
    for i0 in range(0, spec.Nq, chunk_rows):
        i1 = min(spec.Nq, i0 + chunk_rows)
        total += int(spec.allowed_with_bias(i0, i1).expand(spec.B, spec.Hq, i1 - i0, spec.Nk).sum())
    return total


def useful_flops(case: BenchCase, spec: MaskSpec | None = None) -> int:
    """FlashAttention-convention FLOPs counting only allowed scores: 4 * D * allowed_count."""
    return 4 * case.D * allowed_count(spec if spec is not None else case.spec())


def min_bytes(case: BenchCase, spec: MaskSpec | None = None) -> int:
    """q and out once, plus the K and V rows of the keys any query of a batch entry may attend."""
    spec = spec if spec is not None else case.spec()
    qo = 2 * case.B * case.Hq * case.Nq * case.D * case.elem_size
    keys = 0
    for b in range(case.B):
        lo, hi = spec.key_range(b, 0, case.Nq)
        keys += max(0, hi - lo)
    return qo + 2 * keys * case.hkv * case.D * case.elem_size


def empty_rows(spec: MaskSpec) -> torch.Tensor | None:
    """bool [B, Hm, Nq, 1] of rows with no allowed key (on the spec's device), or None when there is none."""
    if spec.mask is None and spec.bias is None:
        e = (row_counts(spec) == 0).view(spec.B, 1, spec.Nq, 1)
        return e.to(spec.device) if bool(e.any()) else None
    rows = [~spec.allowed_with_bias(i0, min(spec.Nq, i0 + 1024)).any(dim=-1, keepdim=True)
            for i0 in range(0, spec.Nq, 1024)]
    e = torch.cat(rows, dim=2)
    return e if bool(e.any()) else None


# ---------------------------------------------------------------------------------------------------------
# Inputs, the checked slice, the truth
# ---------------------------------------------------------------------------------------------------------


@dataclass
class CaseInputs:
    """The tensors of one case: ``sets`` input sets (q, k, v) and the shared mask keywords."""

    case: BenchCase
    device: torch.device
    qs: list[torch.Tensor]
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]
    kw: dict[str, Any]
    spec: MaskSpec

    @property
    def sets(self) -> int:
        return len(self.qs)


def _l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "L2_cache_size", 0) or 60 * 10**6)
    return 32 * 2**20


def n_sets_for(case: BenchCase, device: torch.device, max_sets: int = 8) -> int:
    """Input sets to rotate: together at least 4x the L2 (q, k, v and out), at least 2, at most ``max_sets``."""
    per = (2 * case.B * case.Hq * case.Nq + 2 * case.B * case.hkv * case.nk) * case.D * case.elem_size
    return int(min(max_sets, max(2, math.ceil(4 * _l2_bytes(device) / max(1, per)))))


def make_case_inputs(case: BenchCase, device: torch.device | str, seed: int = 0, sets: int | None = None) -> CaseInputs:
    """Draw ``sets`` seeded N(0, 1) input sets on ``device`` (generated there: no host copy)."""
    device = torch.device(device)
    sets = n_sets_for(case, device) if sets is None else sets
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = case.torch_dtype
    qs, ks, vs = [], [], []
    for _ in range(sets):
        qs.append(torch.randn(case.B, case.Hq, case.Nq, case.D, device=device, dtype=dt, generator=gen))
        ks.append(torch.randn(case.B, case.hkv, case.nk, case.D, device=device, dtype=dt, generator=gen))
        vs.append(torch.randn(case.B, case.hkv, case.nk, case.D, device=device, dtype=dt, generator=gen))
    kw = case.keywords(device)
    spec = MaskSpec.build(case.B, case.Hq, case.Nq, case.nk, device=device, **kw)
    return CaseInputs(case, device, qs, ks, vs, kw, spec)


#: Cases with at most this many scores (B*Hq*Nq*Nk) are checked whole; larger ones on a slice.
FULL_CHECK_SCORES = 2**26


def check_slice(case: BenchCase, full_scores: int = FULL_CHECK_SCORES) -> tuple[list[int], list[int], list[int]] | None:
    """(batch entries, query heads, kv heads) of the checked sub-problem, or None to check everything.

    Batch entries {0, B-1}; kv heads {0, Hkv-1} when each has at most 2 query heads, else {Hkv-1}; and all
    query heads of those kv heads (GQA stays consistent). From Nq*Nk >= 2^28 (N 16384) one batch entry
    (B-1) and one kv head (Hkv-1) only. Batch entries and heads are independent, so the slice of the
    output is the output of the sliced problem.
    """
    if case.B * case.Hq * case.Nq * case.nk <= full_scores:
        return None
    group = case.Hq // case.hkv
    if case.Nq * case.nk >= 2**28:
        bs, kvh = [case.B - 1], [case.hkv - 1]
    else:
        bs = sorted({0, case.B - 1})
        kvh = sorted({0, case.hkv - 1}) if group <= 2 else [case.hkv - 1]
    qh = [h * group + g for h in kvh for g in range(group)]
    return bs, qh, kvh


def slice_scope(sl: tuple[list[int], list[int], list[int]] | None) -> str:
    if sl is None:
        return "full"
    return f"slice b={sl[0]} hq={sl[1]}"


def take_slice(out: torch.Tensor, sl) -> torch.Tensor:
    """The checked part of an output [B, Hq, Nq, D]."""
    if sl is None:
        return out
    bs, qh, _ = sl
    dev = out.device
    return out.index_select(0, torch.tensor(bs, device=dev)).index_select(1, torch.tensor(qh, device=dev))


@dataclass
class Truth:
    """Float64 reference (and, for half types, the textbook baseline) on the checked part of set 0."""

    ref: torch.Tensor
    base: torch.Tensor | None
    scope: str
    sl: Any


def make_truth(inp: CaseInputs, full_scores: int = FULL_CHECK_SCORES) -> Truth:
    """Reference (float64, chunked, on the inputs' device) and baseline on set 0, sliced as :func:`check_slice`."""
    from attnlab.api import attention
    from attnlab.reference import reference

    case, dev = inp.case, inp.device
    sl = check_slice(case, full_scores)
    q, k, v, kw = inp.qs[0], inp.ks[0], inp.vs[0], dict(inp.kw)
    if sl is not None:
        bs, qh, kvh = (torch.tensor(x, device=dev) for x in sl)
        q = q.index_select(0, bs).index_select(1, qh)
        k = k.index_select(0, bs).index_select(1, kvh)
        v = v.index_select(0, bs).index_select(1, kvh)
        for key in ("kv_len", "q_len"):
            if key in kw:
                kw[key] = kw[key].index_select(0, bs)
    ref, _ = reference(q, k, v, **kw)
    base, scope = None, slice_scope(sl)
    if case.torch_dtype != torch.float32:
        try:
            base = attention(q, k, v, backend="torch", **kw)
        except torch.cuda.OutOfMemoryError:
            scope += " (no baseline criterion: the textbook baseline ran out of memory)"
            _free(dev)
    return Truth(ref=ref, base=base, scope=scope, sl=sl)


# ---------------------------------------------------------------------------------------------------------
# Competitors
# ---------------------------------------------------------------------------------------------------------


class Unsupported(Exception):
    """The competitor cannot run this case (status ``unsupported``)."""


class Unavailable(Exception):
    """The competitor cannot run on this machine at all (status ``unavailable``)."""


@dataclass
class Prepared:
    """A competitor set up for one case: ``call(i)`` runs on input set i and returns out [B, Hq, Nq, D]."""

    call: Callable[[int], torch.Tensor]
    setup_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    #: rows with no allowed key, zeroed in the output before checking (competitors only)
    zero_rows: torch.Tensor | None = None
    #: called after the timed calls: a reason the timing is not valid (e.g. flex fell back to eager), or None
    after_timing: Callable[[], str | None] | None = None
    #: the first (checked) call, when it differs from ``call`` (attnlab backends: NaN-poisoned output)
    check_call: Callable[[int], torch.Tensor] | None = None
    #: called after the first call and again just before the timed calls (flex: remember dynamo's graph
    #: count; returns a note when it changed since the last mark)
    mark: Callable[[], str | None] | None = None


@dataclass
class Competitor:
    """A named way to compute attention. ``prepare(inputs)`` returns a :class:`Prepared` or raises
    :class:`Unsupported` / :class:`Unavailable`."""

    name: str
    family: str
    prepare: Callable[[CaseInputs], Prepared]


def _attnlab_competitor(name: str) -> Competitor:
    def prepare(inp: CaseInputs) -> Prepared:
        from attnlab import backends as _b
        from attnlab.problem import make_problem

        reg = _b.registry()
        if name not in reg:
            raise Unavailable(f"backend {name!r} is not in this build (its module is missing)")
        be = reg[name]
        avail = be.availability()
        if not avail.available:
            raise Unavailable(avail.reason)
        probs = [make_problem(q, k, v, **inp.kw) for q, k, v in zip(inp.qs, inp.ks, inp.vs)]
        why = be.unsupported(probs[0])
        if why is not None:
            raise Unsupported(why)

        def call(i: int) -> torch.Tensor:
            prob = probs[i]
            out, ob = prob.new_out()
            be.forward(prob, ob, None)
            return out

        def check_call(i: int) -> torch.Tensor:
            prob = probs[i]
            out, ob = prob.new_out()
            out.fill_(float("nan"))  # an element the backend does not write fails the check as NaN
            be.forward(prob, ob, None)
            return out

        return Prepared(call=call, check_call=check_call)

    return Competitor(name, "attnlab", prepare)


def _sdpa_competitor(name: str) -> Competitor:
    kind = SDPA_KINDS[name]

    def prepare(inp: CaseInputs) -> Prepared:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from attnlab.problem import make_problem
        from attnlab.backends.sdpa import sdpa_inputs

        if not hasattr(SDPBackend, kind):
            raise Unavailable(f"this torch has no SDPBackend.{kind}")
        sdp = getattr(SDPBackend, kind)
        prob = make_problem(inp.qs[0], inp.ks[0], inp.vs[0], **inp.kw)
        notes: list[str] = []
        if name in ("sdpa-flash", "sdpa-efficient") and prob.spec.kind == "causal_br" and prob.Nq != prob.Nk:
            # Bottom-right causal without a materialized mask: the way flash and efficient take it natively.
            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "NaNs when seq_len_q > seq_len_kv": those rows are zeroed
                attn_mask = causal_lower_right(prob.Nq, prob.Nk)
            is_causal, empty = False, empty_rows(prob.spec)
            setup = 0
            notes.append("bottom-right causal as torch.nn.attention.bias.causal_lower_right")
        else:
            attn_mask, is_causal, empty = sdpa_inputs(prob)
            setup = attn_mask.numel() * attn_mask.element_size() if attn_mask is not None else 0
        group = prob.group
        ks, vs = inp.ks, inp.vs

        def run(q, k, v, gqa: bool) -> torch.Tensor:
            kw = {"enable_gqa": True} if gqa else {}
            with sdpa_kernel(sdp):
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=prob.scale, **kw
                )

        def attempt(k, v, gqa):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    run(inp.qs[0], k, v, gqa)
                    return None
                except RuntimeError as e:
                    if "No available kernel" not in str(e) and "No viable backend" not in str(e):
                        raise
                    why = "; ".join(sorted({str(w.message).split("\n")[0][:160] for w in caught}))
                    return why or str(e)[:200]

        use_gqa = group > 1
        why = attempt(ks[0], vs[0], use_gqa)
        if why is not None and use_gqa:
            kr = [k.repeat_interleave(group, dim=1) for k in ks]
            vr = [v.repeat_interleave(group, dim=1) for v in vs]
            why2 = attempt(kr[0], vr[0], False)
            if why2 is None:
                ks, vs, use_gqa = kr, vr, False
                setup += sum(t.numel() * t.element_size() for t in kr + vr)
                notes.append("enable_gqa refused: K/V repeated outside the timed region")
                why = None
            else:
                why = f"{why} | with K/V repeated: {why2}"
        if why is not None:
            raise Unsupported(f"SDPA {kind}: no available kernel: {why}")

        def call(i: int) -> torch.Tensor:
            return run(inp.qs[i], ks[i], vs[i], use_gqa)

        return Prepared(call=call, setup_bytes=setup, notes=notes, zero_rows=empty)

    return Competitor(name, "torch", prepare)


def _set_dynamo_limits() -> None:
    """Raise dynamo's recompile limit and make hitting it an error, not a silent fallback to eager."""
    import torch._dynamo.config as dcfg

    names = getattr(dcfg, "_config", {})
    for attr in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if attr in names or hasattr(dcfg, attr):
            with contextlib.suppress(Exception):
                setattr(dcfg, attr, max(int(getattr(dcfg, attr)), 256))
    for attr in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if attr in names or hasattr(dcfg, attr):
            with contextlib.suppress(Exception):
                setattr(dcfg, attr, True)


def flex_mods(spec: MaskSpec) -> tuple[Callable | None, Callable | None, bool, bool]:
    """(mask_mod, score_mod, depends on b, depends on h): FlexAttention's form of ``spec``.

    mask_mod: ``kv_idx < kv_len[b]``, ``q_idx < q_len[b]``, and the band around ``diag = q_idx + offset``
    (offset 0 top-left; ``Lk_b - Lq_b`` bottom-right, per batch entry when lengths are given), and the
    explicit bool mask; score_mod adds the bias. None when there is nothing to express.
    """
    kvl = spec.kv_len.long() if spec.kv_len is not None else None
    ql = spec.q_len.long() if spec.q_len is not None else None
    per_b = kvl is not None or ql is not None
    off_b = None
    const_off = 0
    if spec.align == "bottom_right":
        if per_b:
            off_b = spec.diag_offset()
        else:
            const_off = spec.Nk - spec.Nq
    left, right, mask, bias = spec.left, spec.right, spec.mask, spec.bias
    mask_mod = None
    if spec.banded or per_b or mask is not None:

        def mask_mod(b, h, q_idx, kv_idx):
            ok = q_idx >= 0
            if kvl is not None:
                ok = ok & (kv_idx < kvl[b])
            if ql is not None:
                ok = ok & (q_idx < ql[b])
            if left is not None or right is not None:
                diag = q_idx + (off_b[b] if off_b is not None else const_off)
                if left is not None:
                    ok = ok & (kv_idx >= diag - left)
                if right is not None:
                    ok = ok & (kv_idx <= diag + right)
            if mask is not None:
                ok = ok & mask[b, h, q_idx, kv_idx]
            return ok

    score_mod = None
    if bias is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, q_idx, kv_idx]

    return mask_mod, score_mod, per_b or mask is not None, mask is not None


#: Compile and run flex on CPU tensors too (off: compiling there is slow; on for debugging the harness).
FLEX_ON_CPU = False


def _flex_competitor() -> Competitor:
    def prepare(inp: CaseInputs) -> Prepared:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as e:
            raise Unavailable(f"torch.nn.attention.flex_attention not importable: {e}") from None
        if inp.device.type != "cuda" and not FLEX_ON_CPU:
            raise Unsupported("flex is benchmarked on CUDA only (compiling it on a CPU costs more than a smoke run)")
        import torch._dynamo

        case, spec = inp.case, inp.spec
        mask_mod, score_mod, by_b, by_h = flex_mods(spec)
        torch._dynamo.reset()  # one static compilation per case
        _set_dynamo_limits()
        block_mask = None
        setup = 0
        if mask_mod is not None:
            block_mask = create_block_mask(
                mask_mod, case.B if by_b else None, case.Hq if by_h else None, case.Nq, case.nk, device=inp.device
            )
            with contextlib.suppress(Exception):
                setup = sum(t.numel() * t.element_size() for t in block_mask.as_tuple() if isinstance(t, torch.Tensor))
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        gqa = case.Hq != case.hkv
        scale = 1.0 / math.sqrt(case.D)

        def call(i: int) -> torch.Tensor:
            kw = {"enable_gqa": True} if gqa else {}
            return compiled(inp.qs[i], inp.ks[i], inp.vs[i], score_mod=score_mod, block_mask=block_mask,
                            scale=scale, **kw)

        from torch._dynamo.utils import counters

        state: dict[str, int | None] = {"graphs": None}

        def graphs() -> int:
            return int(counters["stats"]["unique_graphs"])

        def mark() -> str | None:
            old, state["graphs"] = state["graphs"], graphs()
            if old is not None and state["graphs"] != old:
                return f"dynamo compiled {state['graphs'] - old} more graph(s) after the first call (before timing)"
            return None

        def after_timing() -> str | None:
            if state["graphs"] is not None and graphs() != state["graphs"]:
                return "dynamo compiled a new graph during the timed calls (recompilation)"
            return None

        return Prepared(call=call, setup_bytes=setup, zero_rows=empty_rows(spec), after_timing=after_timing,
                        mark=mark)

    return Competitor("flex", "torch", prepare)


def competitors(names: Iterable[str] | None = None) -> list[Competitor]:
    """The competitors by name (default: every attnlab backend DESIGN.md lists or the registry holds,
    except ``reference``; then ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-math``, ``flex``)."""
    from attnlab import backends as _b

    attn = list(DESIGN_BACKENDS) + [n for n in _b.registry() if n not in DESIGN_BACKENDS and n != "reference"]
    known = [*attn, "reference", *SDPA_KINDS, "flex"]
    names = [*attn, *SDPA_KINDS, "flex"] if names is None else list(names)
    out = []
    for n in names:
        if n in SDPA_KINDS:
            out.append(_sdpa_competitor(n))
        elif n == "flex":
            out.append(_flex_competitor())
        elif n in known or n in _b.registry():
            out.append(_attnlab_competitor(n))
        else:
            raise ValueError(f"unknown competitor {n!r}; choose from {known}")
    return out


# ---------------------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(call: Callable[[int], Any], sets: int, reps: int, device: torch.device, start: int = 0) -> list[float]:
    """Milliseconds of ``reps`` calls rotating over ``sets`` input sets: CUDA events around each call on a
    GPU (the calls are queued back to back; one synchronize at the end), ``perf_counter`` on a CPU."""
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for r in range(reps):
            ev[r][0].record()
            call((start + r) % sets)
            ev[r][1].record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in ev]
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        call((start + r) % sets)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_peak(call: Callable[[int], torch.Tensor], i: int, device: torch.device) -> tuple[float, float]:
    """(ms of one call, peak extra MiB beyond what was allocated before and the output); MiB is NaN on CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        call(i)
        return (time.perf_counter() - t0) * 1e3, float("nan")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = call(i)
    b.record()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    out_bytes = out.untyped_storage().nbytes() if isinstance(out, torch.Tensor) else 0
    del out
    return a.elapsed_time(b), max(0.0, (peak - before - out_bytes) / MIB)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _quantile(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    pos = p * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Options:
    """How to measure (see the module docstring)."""

    device: str = "cuda"
    max_reps: int = DEFAULT_REPS
    min_reps: int = DEFAULT_MIN_REPS
    budget_ms: float = DEFAULT_BUDGET_MS
    seed: int = 0
    deadline: float | None = None  #: time.time() after which no new measurement starts
    max_call_s: float = 2.5  #: skip a competitor whose smaller cases predict a longer call (see main)
    run_id: str = ""
    gpu: str = ""


class ContextLost(Exception):
    """A CUDA error that poisons the context: nothing more can run in this process."""

    def __init__(self, backend: str, case: str, message: str):
        super().__init__(message)
        self.backend, self.case = backend, case


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return "out of memory" in msg and "shared memory" not in msg


def _context_ok(device: torch.device) -> bool:
    """Whether the CUDA context still works after an exception (a sticky error makes every call fail)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        x = torch.ones(4, device=device) + 1
        return float(x.sum()) == 8.0
    except Exception:
        return False


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def _short(e: BaseException, n: int = 300) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:n]}"


def _row(case: BenchCase, comp: Competitor, opts: Options, counts: dict[str, Any], **kw: Any) -> dict[str, Any]:
    row = {c: "" for c in COLUMNS}
    row.update(case.describe())
    row.update(counts)
    row.update(run_id=opts.run_id, backend=comp.name, family=comp.family, device=opts.device, gpu=opts.gpu)
    row.update(kw)
    return row


def case_counts(case: BenchCase, spec: MaskSpec | None = None) -> dict[str, Any]:
    """flops, bytes and allowed_frac of a case (see :func:`useful_flops`, :func:`min_bytes`)."""
    spec = spec if spec is not None else case.spec()
    n = allowed_count(spec)
    total = case.B * case.Hq * case.Nq * case.nk
    return {"flops": 4 * case.D * n, "bytes": min_bytes(case, spec), "allowed_frac": n / total if total else 0.0}


def run_one(
    comp: Competitor, inp: CaseInputs, truth: Truth, opts: Options, counts: dict[str, Any], max_reps: int,
    budget_ms: float, min_reps: int,
) -> dict[str, Any]:
    """Check, then (only if it passed) measure memory and time one competitor on one case: one CSV row."""
    from attnlab.check import compare

    case, dev = inp.case, inp.device
    base = {"sets": inp.sets, "check_scope": truth.scope}
    try:
        prep = comp.prepare(inp)
    except Unavailable as e:
        return _row(case, comp, opts, counts, status="unavailable", notes=str(e), **base)
    except Unsupported as e:
        return _row(case, comp, opts, counts, status="unsupported", notes=str(e), **base)
    except Exception as e:
        return _failure_row(case, comp, opts, counts, e, dev, "setup", base)
    notes = list(prep.notes)
    # 1. the checked call (set 0); for attnlab backends the output is poisoned first (every element written)
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = (prep.check_call or prep.call)(0)
            _sync(dev)
        first_s = time.perf_counter() - t0
        if prep.mark is not None:
            prep.mark()
        fallback = _eager_fallbacks(caught)
        if comp.name == "flex" and first_s > 1.0:
            notes.append(f"first call (compile) {first_s:.1f} s")
        got = out
        if prep.zero_rows is not None and bool(prep.zero_rows.any()):
            got = out.masked_fill(prep.zero_rows, 0.0)
            notes.append(f"{int(prep.zero_rows.sum())} empty rows zeroed before checking")
        rep = compare(take_slice(got, truth.sl), truth.ref, dtype=case.torch_dtype, base=truth.base)
        del out, got
    except Exception as e:
        return _failure_row(case, comp, opts, counts, e, dev, "first call", base, notes)
    base.update(max_abs_err=rep.max_abs, rel_l2=rep.rel_l2, setup_mib=prep.setup_bytes / MIB,
                base_max_abs="" if rep.base_max_abs is None else rep.base_max_abs)
    if fallback:
        return _row(case, comp, opts, counts, status="fallback", passed=bool(rep.passed),
                    notes="; ".join(notes + fallback[:1]), **base)
    if not rep.passed:
        notes.append(repr(rep))
        return _row(case, comp, opts, counts, status="failed", passed=False, notes="; ".join(notes), **base)
    # 2. memory and a first estimate; 3. warm-up and the timed calls
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est_ms, peak = measure_peak(prep.call, 1 % inp.sets, dev)
            reps, warm = _reps_and_warmup(est_ms, max_reps, budget_ms, min_reps)
            if warm:
                time_calls(prep.call, inp.sets, warm, dev, start=2)
            if prep.mark is not None:
                changed = prep.mark()
                if changed:
                    notes.append(changed)
            times = time_calls(prep.call, inp.sets, reps, dev, start=2 + warm)
        bad = prep.after_timing() if prep.after_timing is not None else None
        eager = _eager_fallbacks(caught)
        if bad or eager:
            return _row(case, comp, opts, counts, status="fallback", passed=True,
                        notes="; ".join([*notes, bad or eager[0]]), **base)
        other = sorted({str(w.message).split("\n")[0][:120] for w in caught})
        notes += [f"warning: {w}" for w in other[:2]]
    except Exception as e:
        return _failure_row(case, comp, opts, counts, e, dev, "timed calls", base, notes, passed=True)
    ms = _median(times)
    row = _row(
        case, comp, opts, counts, status="ok", passed=True, ms=ms, ms_min=min(times),
        ms_iqr=_quantile(times, 0.75) - _quantile(times, 0.25), reps=len(times),
        tflops=counts["flops"] / (ms * 1e-3) / 1e12, gbps=counts["bytes"] / (ms * 1e-3) / 1e9,
        peak_extra_mib=peak, notes="; ".join(notes), **base,
    )
    return row


def _failure_row(case, comp, opts, counts, e, dev, where, base, notes=(), passed="") -> dict[str, Any]:
    """The row of a competitor that raised: oom, error, or :class:`ContextLost` when CUDA is unusable."""
    notes = list(notes)
    # The traceback's frames hold the failed call's tensors (after an OOM, gigabytes): drop them first.
    traceback.clear_frames(e.__traceback__)
    e.__traceback__ = None
    if _is_oom(e):
        _free(dev)
        return _row(case, comp, opts, counts, status="oom", passed=passed,
                    notes="; ".join([*notes, f"out of memory in {where}: {_short(e, 160)}"]), **base)
    if not _context_ok(dev):
        raise ContextLost(comp.name, case.name, _short(e)) from e
    _free(dev)
    return _row(case, comp, opts, counts, status="error", passed=passed,
                notes="; ".join([*notes, f"{where}: {_short(e)}"]), **base)


def run_case(
    case: BenchCase, comps: Sequence[Competitor], opts: Options, *, skip: Callable[[str], str | None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every competitor on one case; ``skip(name)`` returns a reason to record a competitor as skipped."""
    dev = torch.device(opts.device)
    max_reps, budget, min_reps = _timing(case, opts)
    counts = case_counts(case)
    rows: list[dict[str, Any]] = []

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    todo = []
    for comp in comps:
        why = skip(comp.name) if skip is not None else None
        if why is not None:
            emit(_row(case, comp, opts, counts, status="skipped", notes=why))
        else:
            todo.append(comp)
    if not todo:
        return rows
    strict = torch.float32 == case.torch_dtype
    from attnlab.check import strict_fp32

    with strict_fp32() if strict else contextlib.nullcontext():
        try:
            inp = make_case_inputs(case, dev, seed=opts.seed)
            truth = make_truth(inp)
        except Exception as e:
            if not _is_oom(e) and not _context_ok(dev):
                raise ContextLost("(inputs/reference)", case.name, _short(e)) from e
            _free(dev)
            status = "oom" if _is_oom(e) else "error"
            for comp in todo:
                emit(_row(case, comp, opts, counts, status=status, notes=f"inputs/reference: {_short(e)}"))
            return rows
        for comp in todo:
            if opts.deadline is not None and time.time() > opts.deadline:
                emit(_row(case, comp, opts, counts, status="skipped", notes="deadline reached"))
                continue
            emit(run_one(comp, inp, truth, opts, counts, max_reps, budget, min_reps))
        del inp, truth
    _free(dev)
    return rows


# ---------------------------------------------------------------------------------------------------------
# Files: CSV, JSON, load, ratios
# ---------------------------------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the folder under data/bench)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def _cmd(args: Sequence[str], timeout: float = 10.0) -> str:
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
        return r.stdout.strip() if r.returncode == 0 else ""
    except Exception:
        return ""


def _version(mod: str) -> str:
    try:
        m = __import__(mod)
    except Exception as e:
        return f"not importable ({type(e).__name__})"
    return str(getattr(m, "__version__", "?"))


def environment(device: str, argv: Sequence[str]) -> dict[str, Any]:
    """The environment a result depends on: device, driver, library versions, commit, date, command."""
    from attnlab import __version__
    from attnlab import backends as _b

    root = Path(__file__).resolve().parent.parent
    commit = os.environ.get("ATTNLAB_COMMIT") or _cmd(["git", "-C", str(root), "rev-parse", "HEAD"]) or "unknown"
    dirty = None
    if commit != "unknown" and not os.environ.get("ATTNLAB_COMMIT"):
        dirty = bool(_cmd(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]))
    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": os.environ.get("ATTNLAB_BENCH_COMMAND") or shlex.join(["python", "-m", "attnlab", "bench", *argv]),
        "attnlab": __version__,
        "commit": commit,
        "commit_dirty": dirty,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "triton": _version("triton"),
        "cupy": _version("cupy"),
        "device": device,
        "tf32_matmul_default": _tf32(),
    }
    if os.environ.get("ATTNLAB_BENCH_COMMAND"):
        env["restarted_as"] = shlex.join(["python", "-m", "attnlab", "bench", *argv])
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        q = _cmd(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"])
        env.update(
            gpu=p.name, sm=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1), l2_bytes=_l2_bytes(torch.device(device)),
            driver=q.split(",")[0].strip() if q else "unknown", nvidia_smi=q,
        )
    else:
        env.update(gpu="cpu", driver="none")
    env["backends"] = {n: repr(a) for n, a in _b.status().items()}
    return env


def _tf32() -> bool:
    from attnlab.check import tf32_enabled

    return tf32_enabled()


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.6g}"
    return v


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write rows with :data:`COLUMNS` (atomically: a temporary file renamed over the target)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c, "")) for c in COLUMNS})
    os.replace(tmp, path)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


_BOOL_COLS = ("causal", "passed")
_INT_COLS = ("B", "Hq", "Hkv", "Nq", "Nk", "D", "reps", "sets")
_FLOAT_COLS = ("allowed_frac", "flops", "bytes", "ms", "ms_min", "ms_iqr", "tflops", "gbps", "peak_extra_mib",
               "setup_mib", "max_abs_err", "rel_l2", "base_max_abs")


def load(paths: str | os.PathLike | Iterable[str | os.PathLike]):
    """Read benchmark CSVs into one pandas DataFrame with typed columns (:data:`COLUMNS`).

    ``paths``: a folder (every ``*.csv`` below it, e.g. ``data/bench`` or ``data/bench/nvidia-h200``), one
    CSV, or a list of either. ``passed`` and ``causal`` are pandas nullable booleans (``passed`` is <NA>
    when the output was never produced); numbers are floats (NaN where not measured). The JSON beside each
    CSV is in ``df.attrs["meta"]`` (path -> dict).
    """
    import pandas as pd

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        files += sorted(p.rglob("*.csv")) if p.is_dir() else [p]
    frames, meta = [], {}
    for f in files:
        frames.append(pd.read_csv(f, dtype=str, keep_default_na=False))
        j = f.with_suffix(".json")
        if j.exists():
            meta[str(f)] = json.loads(j.read_text())
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    for c in COLUMNS:
        if c not in df:
            df[c] = ""
    for c in _BOOL_COLS:
        df[c] = df[c].map({"True": True, "False": False, "true": True, "false": False}).astype("boolean")
    for c in _INT_COLS + _FLOAT_COLS:
        df[c] = pd.to_numeric(df[c].replace("", float("nan")), errors="coerce")
    for c in _INT_COLS:
        if df[c].notna().all():
            df[c] = df[c].astype("int64")
    df.attrs["meta"] = meta
    return df


def ratios(df, baseline: str = "sdpa-flash", metric: str = "ms"):
    """Per-suite median speed ratio of each backend to ``baseline``: ``baseline_ms / backend_ms`` over the
    cases where both have an ``ok`` timing (> 1: faster than the baseline). Returns a DataFrame indexed by
    suite with one column per backend; ``.attrs["counts"]`` holds the number of cases behind each median."""
    import pandas as pd

    ok = df[df["status"] == "ok"]
    key = ["suite", "case"]
    if "gpu" in ok:
        key = ["gpu", *key]
    base = ok[ok["backend"] == baseline].set_index(key)[metric]
    out, counts = {}, {}
    for (suite, backend), g in ok.groupby(["suite", "backend"], sort=False):
        mine = g.set_index(key)[metric]
        both = mine.index.intersection(base.index)
        if len(both) == 0:
            continue
        r = (base.loc[both] / mine.loc[both]).median()
        out.setdefault(backend, {})[suite] = float(r)
        counts.setdefault(backend, {})[suite] = len(both)
    res = pd.DataFrame(out)
    res.index.name = "suite"
    res.attrs["counts"] = pd.DataFrame(counts)
    res.attrs["baseline"] = baseline
    return res


# ---------------------------------------------------------------------------------------------------------
# Estimate
# ---------------------------------------------------------------------------------------------------------

#: Assumed throughputs for the estimate only (TFLOP/s of useful work, half types / float32). Guesses.
_RATE = {"fused": (250.0, 20.0), "torch": (40.0, 15.0), "sdpa-math": (30.0, 10.0), "cuda-naive": (4.0, 4.0),
         "cuda-tiled": (15.0, 10.0), "cuda-rowmax": (15.0, 10.0)}


#: Assumed seconds to compile flex for one case (dynamo trace, Inductor, Triton), for the estimate only.
FLEX_COMPILE_S = 6.0
#: Assumed seconds of attnlab's Triton autotuning and compilation per case (amortized), estimate only.
TRITON_TUNE_S = 1.5


def estimate_seconds(cases: Sequence[BenchCase], names: Sequence[str], opts: Options) -> float:
    """A crude wall-clock estimate: per case inputs and reference, flex's compilation, and per competitor
    the checked call, the memory call, warm-up and the timed calls at assumed rates (:data:`_RATE`)."""
    total = 0.0
    for case in cases:
        c = case_counts(case)
        gpu = opts.device.startswith("cuda")
        total += 0.5 + (FLEX_COMPILE_S if "flex" in names and gpu else 0.0)
        total += TRITON_TUNE_S if "triton" in names and gpu else 0.0
        max_reps, budget, min_reps = _timing(case, opts)
        for n in names:
            half = case.dtype != "float32"
            rate = _RATE.get(n, _RATE["fused"])[0 if half else 1]
            if n in ("torch", "sdpa-math"):  # dense work whatever the mask
                ms = 4 * case.D * case.B * case.Hq * case.Nq * case.nk / (rate * 1e9)
            else:
                ms = c["flops"] / (rate * 1e9)
            ms = max(ms, c["bytes"] / 3e9, 0.02)
            if ms > opts.max_call_s * 1e3:
                continue  # skipped as predicted too slow (see --max-call-s)
            reps, warm = _reps_and_warmup(ms, max_reps, budget, min_reps)
            total += 0.15 + (2 + warm + reps) * ms / 1e3
    return total


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnlab bench", description="Benchmark attnlab backends against SDPA and "
                                "FlexAttention; results in <out>/<gpu>/<suite>.csv and .json")
    p.add_argument("--suite", required=True, choices=[*SUITES, "all"], help="suite to run (all = every one but quick)")
    p.add_argument("--backends", nargs="+", default=None, help="competitors (default: every one)")
    p.add_argument("--exclude", nargs="+", default=[], help="competitors recorded as skipped")
    p.add_argument("--out", default="data/bench",
                   help="root folder; files go to <out>/<gpu-slug>/ (default data/bench)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS, help="most timed calls per measurement (default 30)")
    p.add_argument("--min-reps", type=int, default=DEFAULT_MIN_REPS, help="fewest timed calls (default 3)")
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
    p.add_argument("--resume", action="store_true", help="keep rows already in the CSVs, run only the missing ones")
    p.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    p.add_argument("--estimate", action="store_true", help="print the estimated duration and exit")
    p.add_argument("--no-progress", action="store_true")
    return p


def _restart_argv(argv: Sequence[str], run_id: str, deadline: float | None, exclude: Sequence[str]) -> list[str]:
    """The command line of a restart after a lost CUDA context: same run, resumed, the culprit excluded."""
    drop_val = {"--exclude", "--run-id", "--deadline-s", "--deadline-at"}
    out, skip_vals = [], False
    for a in argv:
        if a in drop_val:
            skip_vals = True
            continue
        if a.startswith("--"):
            skip_vals = False
        if skip_vals or a == "--resume":
            continue
        out.append(a)
    out += ["--resume", "--run-id", run_id]
    if deadline is not None:
        out += ["--deadline-at", repr(deadline)]
    if exclude:
        out += ["--exclude", *exclude]
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m attnlab bench``: run suites, write CSV and JSON per suite, print a summary."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("attnlab bench: no CUDA GPU here (torch.cuda.is_available() is False). Use --device cpu for a "
              "smoke run of the harness, e.g. `python -m attnlab bench --suite quick --device cpu`.", file=sys.stderr)
        return 2
    if not (device.startswith("cuda") or device == "cpu"):
        print(f"attnlab bench: --device must be cuda or cpu; got {device!r}", file=sys.stderr)
        return 2
    t_start = time.time()
    deadline = args.deadline_at if args.deadline_at is not None else (
        t_start + args.deadline_s if args.deadline_s is not None else None)
    run_id = args.run_id or _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    gpu = device_name(device)
    opts = Options(device=device, max_reps=args.reps, min_reps=args.min_reps, budget_ms=args.budget_ms,
                   seed=args.seed, deadline=deadline, run_id=run_id, gpu=gpu, max_call_s=args.max_call_s)
    try:
        comps = competitors(args.backends)
    except ValueError as e:
        print(f"attnlab bench: {e}", file=sys.stderr)
        return 2
    names = [c.name for c in comps]
    suites = list(ALL_ORDER) if args.suite == "all" else [args.suite]
    plan = []
    for s in suites:
        cases = SUITES[s](device)
        if args.cases:
            cases = [c for c in cases if args.cases in c.name]
        plan.append((s, cases))
    est = {s: estimate_seconds(cases, names, opts) for s, cases in plan}
    first_flex = 15.0 if "flex" in names and device.startswith("cuda") else 0.0  # Inductor's cold start
    print(f"attnlab bench on {gpu} ({device}), run {run_id}: " + ", ".join(
        f"{s} {len(c)} cases ~{est[s]:.0f} s" for s, c in plan) + f"; total ~{sum(est.values()) + first_flex:.0f} s "
        f"(crude estimate: assumed rates, flex compile {FLEX_COMPILE_S:g} s and Triton tuning {TRITON_TUNE_S:g} s "
        "per case)", flush=True)
    if args.estimate:
        return 0
    folder = Path(args.out) / gpu_slug(gpu)
    env = environment(device, argv)
    env.update(run_id=run_id, options={
        "max_reps": opts.max_reps, "min_reps": opts.min_reps, "budget_ms": opts.budget_ms, "seed": opts.seed,
        "suite_timing": SUITE_TIMING, "competitors": names, "excluded": args.exclude,
        "flex": "torch.compile(flex_attention, fullgraph=True, dynamic=False); torch._dynamo.reset() per case; "
                "recompile limit raised, fail_on_recompile_limit_hit",
        "timing": "median of CUDA-event-timed calls rotating over input sets >= 4x L2, after a checked call, "
                  "a memory call and warm-up",
    })
    total_pairs = sum(len(c) for _, c in plan) * len(comps)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_pairs, desc="bench", unit="run", dynamic_ncols=True, file=sys.stderr)
    all_rows: list[dict[str, Any]] = []
    status = 0
    for suite, cases in plan:
        path = folder / f"{suite}.csv"
        kept: list[dict[str, Any]] = []
        if args.resume and path.exists():
            # skipped rows (deadline, exclusions) are decided again; everything else that ran is kept
            kept = [r for r in _read_rows(path) if (args.run_id is None or r.get("run_id") == args.run_id)
                    and r.get("status") != "skipped"]
        done = {(r["case"], r["backend"]) for r in kept}
        rows = list(kept)
        senv = dict(env, suite=suite, cases=[c.name for c in cases], started_utc=env["date_utc"])
        jpath = path.with_suffix(".json")
        folder.mkdir(parents=True, exist_ok=True)
        if args.resume and jpath.exists():
            old = json.loads(jpath.read_text())
            senv["restarts"] = old.get("restarts", []) + ([old.get("aborted")] if old.get("aborted") else [])
            senv["started_utc"] = old.get("started_utc", senv["started_utc"])
            prev = old.get("previous_commands", [])
            if old.get("command") and old.get("command") != senv["command"]:
                prev = [*prev, old["command"]]
            if prev:
                senv["previous_commands"] = prev
        jpath.write_text(json.dumps(senv, indent=2, default=str))
        t_suite = time.time()

        def on_row(row, rows=rows, path=path, cases=cases):
            rows.append(row)
            write_csv(path, _ordered(rows, cases, names))
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{row['case'][:34]} {row['backend']} {row['status']}")

        for case in cases:
            if bar is not None:
                bar.set_description(f"{suite}")
                bar.update(sum(1 for n in names if (case.name, n) in done))

            def skip(name, case=case, suite=suite, rows=rows):
                if deadline is not None and time.time() > deadline:
                    return "deadline reached"
                if name in args.exclude:
                    return "excluded" + (" (it broke the CUDA context earlier in this run)" if args.run_id else "")
                if suite == "memory" and _oomed_before(rows, name, case):
                    return "ran out of memory at a smaller N"
                pred = _predicted_ms(rows, name, case)
                if pred is not None and pred > opts.max_call_s * 1e3:
                    return f"predicted {pred / 1e3:.1f} s a call (from smaller cases) > --max-call-s {opts.max_call_s}"
                return None

            todo = [c for c in comps if (case.name, c.name) not in done]
            try:
                case_rows = run_case(case, todo, opts, skip=skip, on_row=on_row)
                line = f"[{time.time() - t_start:5.0f} s] {suite}/{case.name}: {case_line(case_rows)}"
                if bar is not None:
                    bar.write(line)
                elif case_rows:
                    print(line, flush=True)
            except ContextLost as e:
                msg = f"the CUDA context was lost: {e}"
                if e.backend in names:
                    culprit = next(c for c in comps if c.name == e.backend)
                    on_row(_row(case, culprit, opts, case_counts(case), status="error", notes=msg))
                senv["aborted"] = {"backend": e.backend, "case": e.case, "message": str(e)}
                jpath.write_text(json.dumps(senv, indent=2, default=str))
                if bar is not None:
                    bar.close()
                excl = list(args.exclude) + ([e.backend] if e.backend in names else [])
                if e.backend not in names or len(excl) > 6:
                    print(f"attnlab bench: {msg}; cannot continue", file=sys.stderr)
                    return 3
                new = _restart_argv(argv, run_id, deadline, excl)
                print(f"attnlab bench: {msg}; restarting without {e.backend!r}: {shlex.join(new)}", file=sys.stderr,
                      flush=True)
                sys.stdout.flush()
                sys.stderr.flush()
                os.environ.setdefault("ATTNLAB_BENCH_COMMAND", env["command"])
                os.execv(sys.executable, [sys.executable, "-m", "attnlab", "bench", *new])
        senv["finished_utc"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        senv["seconds"] = round(time.time() - t_suite, 1)
        senv["estimate_seconds"] = round(est[suite], 1)
        jpath.write_text(json.dumps(senv, indent=2, default=str))
        write_csv(path, _ordered(rows, cases, names))
        all_rows += rows
        if bar is not None:
            bar.write(f"{suite}: {len(rows)} rows -> {path} ({senv['seconds']} s)")
        else:
            print(f"{suite}: {len(rows)} rows -> {path} ({senv['seconds']} s)", flush=True)
    if bar is not None:
        bar.close()
    print(summary(all_rows), flush=True)
    print(f"total {time.time() - t_start:.0f} s", flush=True)
    return status


def case_line(rows: Sequence[dict[str, Any]]) -> str:
    """One line for a case's rows: each timed backend's TFLOP/s (or GB/s for decode) and the other statuses."""
    parts = []
    for r in rows:
        if r["status"] == "ok":
            val = f"{r['gbps']:.4g} GB/s" if r["Nq"] == 1 else f"{r['tflops']:.4g} TF/s"
            parts.append(f"{r['backend']} {val}")
        else:
            parts.append(f"{r['backend']} {r['status'].upper()}")
    return ", ".join(parts)


def _ordered(rows: list[dict[str, Any]], cases: Sequence[BenchCase], names: Sequence[str]) -> list[dict[str, Any]]:
    """Rows sorted by case order then competitor order (rows of unknown cases/competitors last)."""
    ci = {c.name: i for i, c in enumerate(cases)}
    ni = {n: i for i, n in enumerate(names)}
    return sorted(rows, key=lambda r: (ci.get(r["case"], len(ci)), ni.get(r["backend"], len(ni))))


def _predicted_ms(rows: Sequence[dict[str, Any]], name: str, case: BenchCase) -> float | None:
    """A backend's time per call on ``case`` predicted from its largest smaller timed case of the same dtype
    so far (the slowest of those, if several), scaled by the dense work B*Hq*Nq*Nk*D; None without one."""
    work = case.B * case.Hq * case.Nq * case.nk * case.D
    best_w, best = 0, None
    for r in rows:
        if r["backend"] != name or r["status"] != "ok" or r["dtype"] != case.dtype or r["ms"] in ("", None):
            continue
        w = int(r["B"]) * int(r["Hq"]) * int(r["Nq"]) * int(r["Nk"]) * int(r["D"])
        if w <= 0 or w >= work or w < best_w:
            continue
        p = float(r["ms"]) / w * work
        best = p if (w > best_w or best is None) else max(best, p)
        best_w = w
    return best


def _oomed_before(rows: Sequence[dict[str, Any]], name: str, case: BenchCase) -> bool:
    for r in rows:
        if r["backend"] == name and r["status"] == "oom" and int(r["Nq"]) * int(r["Nk"]) < case.Nq * case.nk:
            return True
    return False


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """A short text table: status counts per backend, then the median speed ratios to sdpa-flash,
    sdpa-cudnn, flex and sdpa-efficient per suite."""
    import pandas as pd

    if not rows:
        return "no rows"
    df = pd.DataFrame(rows)
    lines = []
    st = df.pivot_table(index="backend", columns="status", values="case", aggfunc="count", fill_value=0)
    lines.append("status counts:\n" + st.to_string())
    typed = df.copy()
    typed["ms"] = pd.to_numeric(typed["ms"].replace("", float("nan")), errors="coerce")
    for b in ("sdpa-flash", "sdpa-cudnn", "flex", "sdpa-efficient"):
        r = ratios(typed, baseline=b)
        if not r.empty:
            lines.append(f"median speed ratio to {b} (baseline_ms / ms; > 1 is faster):\n{r.round(3).to_string()}")
    return "\n\n".join(lines)
