"""Benchmark harness: every attnlab backend against PyTorch's best, side by side, in one run, checked first.

Command line (``python -m attnlab bench``)::

    python -m attnlab bench --suite dense                  # one suite on the GPU it finds
    python -m attnlab bench --suite all --deadline-s 540   # every suite except quick, stop starting work at 540 s
    python -m attnlab bench --suite quick --device cpu     # a smoke run of the harness logic on a CPU
    python -m attnlab bench --suite dense --estimate       # print the time estimate and exit (no GPU needed)
    python -m attnlab bench --suite dense --backends triton sdpa-flash --keep-others   # re-record two rivals

Suites (:data:`SUITES`): ``dense``, ``padding`` (kv_len, and ragged ``q_len = kv_len``, causal and not),
``prefill``, ``decode``, ``fp32``, ``memory``, ``latency`` (small host-bound problems), ``bias`` (an
ALiBi-style bf16 bias [1, H, N, N]), ``backward`` (fwd, fwd+bwd, bwd: :mod:`~attnlab.bench.grad`),
``quick`` (``all`` = every suite but quick). A suite may name its own rivals (used when ``--backends`` is
not given) and its own deadline (``--suite-deadline-s`` overrides it). Competitors (:func:`competitors`):
each attnlab backend of the registry (``torch`` is the textbook version; ``reference`` and ``auto`` only when
asked for), ``<backend>-kernel`` (asked for by name; the latency suite has ``triton-kernel``), SDPA
restricted to one of its backends (``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-math``) and
compiled FlexAttention (``flex``).

What one measurement is
-----------------------
For each case (shapes, dtype, masks) the harness draws several input sets (q, k, v; masks shared), enough
that together they are at least 4x the L2 (tens of MB on data-center GPUs; at least 2 sets, at most 8), so that rotating
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
   the call, minus the output's own bytes) and gives a first time estimate; warm-up calls follow when a
   call is short (about 25 ms of them by the estimate, at most 500 calls; ``triton.testing.do_bench`` also
   warms up by time).
3. ``reps`` timed calls rotate over the sets, each between two CUDA events (``time.perf_counter`` on a
   CPU): ``reps = clamp(budget_ms / estimate, min_reps, max_reps)``. ``ms`` is the median. The calls are
   queued back to back, so a call whose host time exceeds its GPU time is timed at its host time. A case's
   forward competitors run steps 1-2 one after another, then their timed calls in ``Options.rounds`` (5)
   interleaved rounds (each later round opens with a few untimed calls), so that a drift of a shared host or
   of the GPU over the case falls on every competitor alike; each later round runs in the order that spreads
   whom each competitor runs right after (``timing.next_round``), so that none keeps paying for the state the
   same other leaves the GPU in. Backward cases run each competitor whole.
4. host time (``host_us``): a GPU sleep of :data:`HOST_SLEEP_CYCLES` is queued, then up to 10 calls run
   back to back without a synchronize; their wall time over their number. The host never waits for the GPU
   there unless the call synchronizes, which shows as a host time near the sleep's and a note.
5. graph replay (``graph_ms``; suites of short calls, ``Suite.graph``: decode and scoremod-decode): 20 calls
   rotating over the sets are captured in one CUDA graph and replayed 10 times; the median replay over 20.
   It is the kernels' time with the host's launches gone, beside the event-timed ``ms`` that includes them.

A failed check, an exception, an out-of-memory error, an unsupported configuration and an unavailable
backend each give a row with its ``status`` and no timing: nothing is dropped.

How the competitors are called
------------------------------
* attnlab backends (``path`` = ``public``): the timed call is what a user calls,
  ``attnlab.attention(q, k, v, **keywords, backend=name)``: a new Problem every call, its validation and the
  backend's dispatch included (lengths are tensors on the inputs' device, as a model holds them); the
  checked call runs under :func:`attnlab.api.poison_outputs`, so an element the backend does not write is
  NaN and fails. ``auto`` is the same call with ``backend="auto"`` (its notes say what it picked).
* ``<backend>-kernel`` (``path`` = ``kernel``; only when asked for, and in the latency suite): the
  :class:`~attnlab.problem.Problem` of each set validated once, outside the timed region, and
  ``backend.forward(problem, out, None)`` into a fresh output: the kernel without the public call's
  validation and dispatch. Rows recorded before the ``path`` column existed were this path.
* ``sdpa-*``: ``F.scaled_dot_product_attention`` under ``sdpa_kernel(backend)``, with the mask translated
  once by :func:`attnlab.backends.sdpa.sdpa_inputs` (not timed; its bytes are in ``setup_mib``): ``is_causal`` for
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

The backward suite
------------------
See :mod:`attnlab.bench.grad`: leaves that require grad, a checked fwd+bwd (gradients against float64 with
FlashAttention's 2x-textbook rule), then three rows per competitor: ``fwd``, ``fwd+bwd`` (the forward and
``torch.autograd.grad``) and ``bwd`` (``torch.autograd.grad`` on a retained graph, timed alone), with
1x, 3.5x and 2.5x the forward's useful FLOPs.

Budget and robustness
---------------------
``--suite all`` runs fp32, padding, prefill, decode, memory, dense, latency, bias, backward in that order
and prints a crude estimate first (:func:`estimate_seconds`). Each CSV is rewritten after every row, so an
interrupted run keeps what it measured. ``--deadline-s`` stops starting measurements after that many seconds (the rest
becomes ``skipped``), for the whole run; each suite's own deadline (``Suite.deadline_s``, or
``--suite-deadline-s``) bounds it from its start. ``--resume`` keeps the rows already in the CSVs and runs
the missing and skipped ones; ``--keep-others`` keeps the rows of competitors this run does not measure.
A competitor is skipped on a case when its closest smaller case of the suite predicts a call longer than
``--max-call-s`` (scaled by B*Hq*Nq*Nk*D), and in the memory suite once it ran out of memory at a smaller N.
After an exception the CUDA context is probed; if it is lost (an illegal address makes every later call
fail), the process re-executes itself with ``--resume`` and the culprit excluded (its rows say so), so one
broken kernel does not cost the rest of the run.

Where the code is, in the order a run goes through it: :mod:`~attnlab.bench.schema` (the CSV columns
and statuses), :mod:`~attnlab.bench.suites` (cases, and the suites as data), :mod:`~attnlab.bench.counting`
(allowed scores, FLOPs, bytes), :mod:`~attnlab.bench.truth` (input sets, the float64 truth, check slices),
:mod:`~attnlab.bench.competitors`, :mod:`~attnlab.bench.timing`, :mod:`~attnlab.bench.runner` (check, memory,
time, host time: one row), :mod:`~attnlab.bench.grad` (the backward suite: three rows),
:mod:`~attnlab.bench.results` (CSV/JSON files, :func:`load`, the one :func:`ratios`),
:mod:`~attnlab.bench.case_run` (one case, every competitor), :mod:`~attnlab.bench.session` (an ``attnlab bench``
run over suites) and :mod:`~attnlab.bench.plots` (figures of recorded runs). The public names of each are
re-exported here; the command line's options are parsed in :mod:`attnlab.cli`.
"""

from __future__ import annotations

from attnlab.bench.case_run import run_case  # noqa: F401
from attnlab.bench.competitors import (  # noqa: F401
    FLEX_ON_CPU,
    KERNEL_SUFFIX,
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
    case_counts,
    interleave,
    run_one,
    run_one_steps,
)
from attnlab.bench.schema import (  # noqa: F401
    COLUMNS,
    DESIGN_BACKENDS,
    MIB,
    SDPA_KINDS,
    STATUSES,
)
from attnlab.bench.session import (  # noqa: F401
    FLEX_COMPILE_S,
    TRITON_TUNE_S,
    case_line,
    estimate_seconds,
    summary,
)
from attnlab.bench.suites import (  # noqa: F401
    ALL_ORDER,
    BACKWARD_MODES,
    SUITES,
    BenchCase,
    Suite,
    alibi_bias,
    backward_suite,
    bias_suite,
    decode_suite,
    dense_suite,
    fp32_suite,
    latency_suite,
    memory_suite,
    padding_suite,
    prefill_suite,
    quick_suite,
    recorded_suites,
    row_keys,
    scoremod_decode_suite,
    scoremod_suite,
    suite_cases,
)
from attnlab.bench.timing import (  # noqa: F401
    DEFAULT_BUDGET_MS,
    DEFAULT_MIN_REPS,
    DEFAULT_REPS,
    HOST_SLEEP_CYCLES,
    Options,
    measure_host,
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
    slice_inputs,
    slice_scope,
    take_slice,
)
