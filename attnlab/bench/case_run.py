"""One benchmark case: every competitor on it, the forward ones' timed calls interleaved in rounds
(:mod:`attnlab.bench.runner`), the backward suite's through :mod:`attnlab.bench.grad`; a row per competitor (and
per mode), emitted as each run ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnlab.bench.competitors import Competitor
from attnlab.bench.grad import run_backward
from attnlab.bench.runner import (
    ContextLost,
    case_counts,
    context_ok,
    interleave,
    is_oom,
    run_one_steps,
    short_error,
    status_rows,
)
from attnlab.bench.suites import SUITES, BenchCase
from attnlab.bench.timing import Options, case_timing, free_memory
from attnlab.bench.truth import make_case_inputs, make_truth


def run_case(
    case: BenchCase, comps: Sequence[Competitor], opts: Options, *, skip: Callable[[str], str | None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every competitor on one case; ``skip(name)`` returns a reason to record a competitor as skipped."""
    dev = torch.device(opts.device)
    max_reps, budget, min_reps = case_timing(case, opts)
    counts = case_counts(case)
    suite = SUITES.get(case.suite)
    graph = suite is not None and suite.graph
    rows: list[dict[str, Any]] = []

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    todo = []
    for comp in comps:
        why = skip(comp.name) if skip is not None else None
        if why is not None:
            for r in status_rows(case, comp, opts, counts, status="skipped", notes=why):
                emit(r)
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
            if not is_oom(e) and not context_ok(dev):
                raise ContextLost("(inputs/reference)", case.name, short_error(e)) from e
            free_memory(dev)
            status = "oom" if is_oom(e) else "error"
            for comp in todo:
                notes = f"inputs/reference: {short_error(e)}"
                for r in status_rows(case, comp, opts, counts, status=status, notes=notes):
                    emit(r)
            return rows
        # The forward competitors' runs, their timed calls interleaved in rounds: each one's prepared state
        # (inputs in another layout, masks, compiled functions) lives until its run ends, so a case holds all
        # of them at once; rows are emitted as each run ends.
        # (A forward run checks the deadline itself, as it starts.)
        forward = []
        for comp in todo:
            if not case.backward:
                forward.append(run_one_steps(comp, inp, truth, opts, counts, max_reps, budget, min_reps,
                                             rounds=opts.rounds, graph=graph))
            elif opts.deadline is not None and time.time() > opts.deadline:
                for r in status_rows(case, comp, opts, counts, status="skipped", notes="deadline reached"):
                    emit(r)
            else:
                for r in run_backward(comp, inp, truth, opts, counts, (max_reps, budget, min_reps)):
                    emit(r)
        interleave(forward, on_done=emit)
        del inp, truth, forward
    free_memory(dev)
    return rows
