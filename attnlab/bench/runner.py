"""Running the competitors of one case: each is checked first, then its memory measured and warmed up; then
their timed calls run in interleaved rounds (the later ones in orders that vary whom each runs after), so that a
drift of the host or the GPU over the case's run (another process, a clock change) falls on every competitor
alike rather than on whichever ran at the time; then each one's host time. Every failure is a row."""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnlab.bench.competitors import Competitor, Unavailable, Unsupported
from attnlab.bench.counting import allowed_count, min_bytes
from attnlab.bench.schema import COLUMNS, MIB
from attnlab.bench.suites import BACKWARD_MODES, BenchCase, row_keys
from attnlab.bench.timing import (
    Options,
    eager_fallbacks,
    free_memory,
    host_calls,
    measure_host,
    measure_peak,
    median,
    next_round,
    quantile,
    reps_and_warmup,
    sync,
    time_calls,
)
from attnlab.bench.truth import CaseInputs, Truth, take_slice
from attnlab.masks import MaskSpec

# ---------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------


class ContextLost(Exception):
    """A CUDA error that poisons the context: nothing more can run in this process."""

    def __init__(self, backend: str, case: str, message: str):
        super().__init__(message)
        self.backend, self.case = backend, case


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return "out of memory" in msg and "shared memory" not in msg


def context_ok(device: torch.device) -> bool:
    """Whether the CUDA context still works after an exception (a sticky error makes every call fail)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        x = torch.ones(4, device=device) + 1
        return float(x.sum()) == 8.0
    except Exception:
        return False


def short_error(e: BaseException, n: int = 300) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:n]}"


def make_row(case: BenchCase, comp: Competitor, opts: Options, counts: dict[str, Any], /, **kw: Any) -> dict[str, Any]:
    row = {c: "" for c in COLUMNS}
    row.update(case.describe())
    row.update(counts)
    row.update(run_id=opts.run_id, backend=comp.name, family=comp.family, device=opts.device, gpu=opts.gpu,
               path=comp.path, mode="fwd")
    row.update(kw)
    return row


def status_rows(case: BenchCase, comp: Competitor, opts: Options, counts: dict[str, Any], /,
          **kw: Any) -> list[dict[str, Any]]:
    """The same status for every row of a case (:func:`row_keys`: one, or one per backward mode)."""
    if not case.backward:
        return [make_row(case, comp, opts, counts, **kw)]
    out = []
    for (name, mode), (_, _, mult) in zip(row_keys(case), BACKWARD_MODES):
        c = dict(counts, flops=counts["flops"] * mult, bytes="" if mode != "fwd" else counts["bytes"])
        out.append(make_row(case, comp, opts, c, **{**kw, "case": name, "mode": mode}))
    return out


#: The note of a row whose host-time calls outlasted the GPU sleep queued before them.
HOST_NOT_HIDDEN = ("host-time calls outlasted the GPU sleep queued before them (a device sync in the call, or "
                   "over 1 ms of host time a call)")


#: Untimed calls at the start of each interleaved round after the first (the other competitors ran since).
ROUND_WARMUP = 3


def measure(call: Callable[[int], Any], sets: int, dev: torch.device, timing: tuple[int, float, int],
            notes: list[str], mark: Callable[[], str | None] | None = None,
            after: Callable[[], str | None] | None = None,
            cold: Callable[[], None] | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """Memory and a first estimate, warm-up, the timed calls, then the host time of a call: (the row's
    timing columns, None), or (None, the reason) when the calls left the compiled path (flex). ``cold``
    (:attr:`Prepared.cold`) runs just before the memory measurement. :func:`measure_steps` in one go."""
    return interleave([measure_steps(call, sets, dev, timing, notes, mark, after, cold)])[0]


def measure_steps(call: Callable[[int], Any], sets: int, dev: torch.device, timing: tuple[int, float, int],
                  notes: list[str], mark: Callable[[], str | None] | None = None,
                  after: Callable[[], str | None] | None = None, cold: Callable[[], None] | None = None,
                  rounds: int = 1, context: Callable[[], contextlib.AbstractContextManager] | None = None,
                  graph: bool = False):
    """:func:`measure` as a generator that yields between ``rounds`` rounds of its timed calls (each round
    after the first starts with ROUND_WARMUP untimed calls), so that a caller can run other competitors'
    rounds in between; it returns (with StopIteration) what :func:`measure` returns. Each stretch runs in
    ``context()`` (the competitor's: e.g. SDPA restricted to one kernel), entered anew after every yield.
    ``graph`` (a GPU only) adds ``graph_ms``, the calls' time in CUDA-graph replay (:func:`graph_column`)."""
    max_reps, budget_ms, min_reps = timing
    enter = context or contextlib.nullcontext
    caught: list = []

    @contextlib.contextmanager
    def stretch():
        with enter(), warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            yield
        caught.extend(got)

    with stretch():
        if cold is not None:
            cold()
        est_ms, peak = measure_peak(call, 1 % sets, dev)
        reps, warm = reps_and_warmup(est_ms, max_reps, budget_ms, min_reps)
        if warm:
            time_calls(call, sets, warm, dev, start=2)
        if mark is not None:
            changed = mark()
            if changed:
                notes.append(changed)
    times: list[float] = []
    rounds = max(1, min(rounds, reps))
    at = 2 + warm
    for r in range(rounds):
        n = reps * (r + 1) // rounds - reps * r // rounds
        if r:
            yield
        k = min(warm, ROUND_WARMUP) if r else 0  # queued with the timed calls: the GPU is busy when they start
        with stretch():
            times += time_calls(call, sets, k + n, dev, start=at)[k:]
        at += k + n
    if rounds > 1:
        yield
    with stretch():
        host_us, busy = measure_host(call, sets, host_calls(est_ms), dev, start=at)
        bad = after() if after is not None else None
        graph_ms = graph_column(call, sets, dev, notes) if graph and dev.type == "cuda" and not bad else ""
    eager = eager_fallbacks(caught)
    if bad or eager:
        return None, bad or eager[0]
    other = sorted({str(w.message).split("\n")[0][:120] for w in caught})
    notes += [f"warning: {w}" for w in other[:2] if f"warning: {w}" not in notes]
    if not busy:
        notes.append(HOST_NOT_HIDDEN)
    return {"ms": median(times), "ms_min": min(times), "ms_iqr": quantile(times, 0.75) - quantile(times, 0.25),
            "reps": len(times), "peak_extra_mib": peak, "host_us": host_us, "graph_ms": graph_ms}, None


def graph_column(call: Callable[[int], Any], sets: int, dev: torch.device, notes: list[str]) -> float | str:
    """The row's ``graph_ms``: the median replay of the calls captured in a CUDA graph (the GPU time without
    the host's launches), or empty with a note when the call cannot be captured; a capture that broke the
    CUDA context raises, as any failed call does."""
    from attnlab.bench.replay import graph_times

    try:
        return median(graph_times(call, sets))
    except Exception as e:
        if not context_ok(dev):
            raise
        notes.append(f"graph replay: {short_error(e, 160)}")
        return ""


def interleave(steps: Sequence, on_done: Callable[[Any], None] | None = None) -> list:
    """Run generators one step each per turn to their ends: what each returned, in order; ``on_done`` gets each
    result as its generator ends (so that it is kept if a later step raises). The first turn runs them in the
    order given, each later one the live generators in the order :func:`~attnlab.bench.timing.next_round`
    picks, so that no competitor's rounds keep following the same other's."""
    results: list = [None] * len(steps)
    live = list(range(len(steps)))
    order, pairs = list(live), Counter()
    while live:
        for i in order:
            try:
                next(steps[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
                if on_done is not None:
                    on_done(done.value)
        order = next_round(live, order[-1], pairs) if live else []
    return results


def rates(counts: dict[str, Any], ms: float) -> dict[str, Any]:
    """tflops and gbps of a timed row (gbps empty where the row has no byte count)."""
    gbps = "" if counts.get("bytes") in ("", None) else counts["bytes"] / (ms * 1e-3) / 1e9
    return {"tflops": counts["flops"] / (ms * 1e-3) / 1e12, "gbps": gbps}


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
    return interleave([run_one_steps(comp, inp, truth, opts, counts, max_reps, budget_ms, min_reps)])[0]


def run_one_steps(
    comp: Competitor, inp: CaseInputs, truth: Truth, opts: Options, counts: dict[str, Any], max_reps: int,
    budget_ms: float, min_reps: int, rounds: int = 1, graph: bool = False,
):
    """:func:`run_one` as a generator that yields between its ``rounds`` rounds of timed calls
    (:func:`measure_steps`; ``graph``: with ``graph_ms``) and returns the row."""
    from attnlab.check import compare

    case, dev = inp.case, inp.device
    if opts.deadline is not None and time.time() > opts.deadline:  # checked as this competitor starts
        return make_row(case, comp, opts, counts, status="skipped", notes="deadline reached")
    base = {"sets": inp.sets, "check_scope": truth.scope}
    prep, why = prepare(comp, inp, dev)
    if prep is None:
        return make_row(case, comp, opts, counts, **why, **base)
    with entered(prep):  # e.g. SDPA restricted to one kernel: entered per stretch of calls, not per call
        notes = list(prep.notes)
        # 1. the checked call (set 0); for attnlab backends the output is poisoned first (every element written)
        try:
            out, _, first_s, fallback = first_call(prep, dev)
            if comp.name == "flex" and first_s > 1.0:
                notes.append(f"first call (compile) {first_s:.1f} s")
            got = out
            if prep.zero_rows is not None and bool(prep.zero_rows.any()):
                got = out.masked_fill(prep.zero_rows, 0.0)
                notes.append(f"{int(prep.zero_rows.sum())} empty rows zeroed before checking")
            rep = compare(take_slice(got, truth.sl), truth.ref, dtype=case.torch_dtype, base=truth.base)
            del out, got
        except Exception as e:
            return failure_row(case, comp, opts, counts, e, dev, "first call", base, notes)
        base.update(max_abs_err=rep.max_abs, rel_l2=rep.rel_l2, setup_mib=prep.setup_bytes / MIB,
                    base_max_abs="" if rep.base_max_abs is None else rep.base_max_abs)
        if fallback:
            return make_row(case, comp, opts, counts, status="fallback", passed=bool(rep.passed),
                        notes="; ".join(notes + fallback[:1]), **base)
        if not rep.passed:
            notes.append(repr(rep))
            return make_row(case, comp, opts, counts, status="failed", passed=False, notes="; ".join(notes), **base)
    # 2. memory and a first estimate; 3. warm-up, the timed calls (in rounds) and the host time
    try:
        timed, bad = yield from measure_steps(prep.call, inp.sets, dev, (max_reps, budget_ms, min_reps), notes,
                                              prep.mark, prep.after_timing, prep.cold, rounds=rounds,
                                              context=lambda: entered(prep), graph=graph)
        if bad:
            return make_row(case, comp, opts, counts, status="fallback", passed=True, notes="; ".join([*notes, bad]),
                        **base)
    except Exception as e:
        return failure_row(case, comp, opts, counts, e, dev, "timed calls", base, notes, passed=True)
    return make_row(case, comp, opts, counts, status="ok", passed=True, **timed, **rates(counts, timed["ms"]),
                notes="; ".join(notes), **base)


def failure(comp: Competitor, case: BenchCase, e: BaseException, dev: torch.device, where: str,
            notes: Sequence[str] = ()) -> dict[str, Any]:
    """The status and notes of a competitor that raised: oom or error; raises :class:`ContextLost` when CUDA
    is no longer usable."""
    # The traceback's frames hold the failed call's tensors (after an OOM, gigabytes): drop them first.
    traceback.clear_frames(e.__traceback__)
    e.__traceback__ = None
    if is_oom(e):
        free_memory(dev)
        return {"status": "oom", "notes": "; ".join([*notes, f"out of memory in {where}: {short_error(e, 160)}"])}
    if not context_ok(dev):
        raise ContextLost(comp.name, case.name, short_error(e)) from e
    free_memory(dev)
    return {"status": "error", "notes": "; ".join([*notes, f"{where}: {short_error(e)}"])}


def first_call(prep, dev: torch.device, then: Callable[[Any], Any] | None = None) -> tuple[Any, Any, float, str]:
    """The checked call of a prepared competitor (set 0; ``prep.check_call`` when it has one), and ``then`` of
    its output (the backward), timed together with their warnings: (output, what ``then`` returned,
    seconds, eager fallbacks seen). ``prep.mark`` runs after."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = (prep.check_call or prep.call)(0)
        extra = then(out) if then is not None else None
        sync(dev)
    first_s = time.perf_counter() - t0
    if prep.mark is not None:
        prep.mark()
    return out, extra, first_s, eager_fallbacks(caught)


def entered(prep) -> contextlib.AbstractContextManager:
    """The context a prepared competitor's calls run in (:attr:`Prepared.context`), or none."""
    return prep.context() if prep.context is not None else contextlib.nullcontext()


def prepare(comp: Competitor, inp, dev: torch.device) -> tuple[Any, dict[str, Any] | None]:
    """``(comp.prepare(inp), None)``, or ``(None, the status and notes of why it cannot run)``."""
    try:
        return comp.prepare(inp), None
    except Unavailable as e:
        return None, {"status": "unavailable", "notes": str(e)}
    except Unsupported as e:
        return None, {"status": "unsupported", "notes": str(e)}
    except Exception as e:
        return None, failure(comp, inp.case, e, dev, "setup")


def failure_row(case, comp, opts, counts, e, dev, where, base, notes=(), passed="") -> dict[str, Any]:
    """The row of a competitor that raised (:func:`failure`)."""
    return make_row(case, comp, opts, counts, passed=passed, **failure(comp, case, e, dev, where, notes), **base)
