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

Where the code is, in the order a run goes through it: :mod:`~attnlab.bench.schema` (the CSV columns
and statuses), :mod:`~attnlab.bench.suites` (cases, and the suites as data), :mod:`~attnlab.bench.counting`
(allowed scores, FLOPs, bytes), :mod:`~attnlab.bench.truth` (input sets, the float64 truth, check slices),
:mod:`~attnlab.bench.competitors`, :mod:`~attnlab.bench.timing`, :mod:`~attnlab.bench.runner` (check, memory,
time: one row), :mod:`~attnlab.bench.results` (CSV/JSON files, :func:`load`, the one :func:`ratios`),
:mod:`~attnlab.bench.cli` (``python -m attnlab bench``) and :mod:`~attnlab.bench.plots` (figures of recorded
runs). The public names of each are re-exported here.
"""

from __future__ import annotations

from attnlab.bench.cli import (  # noqa: F401
    FLEX_COMPILE_S,
    TRITON_TUNE_S,
    case_line,
    estimate_seconds,
    main,
    summary,
)
from attnlab.bench.competitors import (  # noqa: F401
    FLEX_ON_CPU,
    Competitor,
    Prepared,
    Unavailable,
    Unsupported,
    competitors,
)
from attnlab.bench.counting import (  # noqa: F401
    allowed_count,
    empty_rows,
    min_bytes,
    row_counts,
    useful_flops,
)
from attnlab.bench.results import (  # noqa: F401
    device_name,
    environment,
    gpu_slug,
    load,
    mask_label,
    pick_backend,
    ratios,
    write_csv,
)
from attnlab.bench.runner import (  # noqa: F401
    ContextLost,
    Options,
    case_counts,
    run_case,
    run_one,
)
from attnlab.bench.schema import (  # noqa: F401
    COLUMNS,
    DESIGN_BACKENDS,
    MIB,
    SDPA_KINDS,
    STATUSES,
)
from attnlab.bench.suites import (  # noqa: F401
    ALL_ORDER,
    SUITES,
    BenchCase,
    Suite,
    decode_suite,
    dense_suite,
    fp32_suite,
    memory_suite,
    padding_suite,
    prefill_suite,
    quick_suite,
    recorded_suites,
    suite_cases,
)
from attnlab.bench.timing import (  # noqa: F401
    DEFAULT_BUDGET_MS,
    DEFAULT_MIN_REPS,
    DEFAULT_REPS,
    measure_peak,
    time_calls,
)
from attnlab.bench.truth import (  # noqa: F401
    FULL_CHECK_SCORES,
    CaseInputs,
    Truth,
    check_slice,
    make_case_inputs,
    make_truth,
    n_sets_for,
    slice_scope,
    take_slice,
)
