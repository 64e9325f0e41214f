"""Timing: CUDA events around each call (perf_counter on a CPU), peak memory of one call, how many calls a
measurement gets, robust statistics."""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from attnlab.bench.schema import MIB
from attnlab.bench.suites import SUITES, BenchCase


def eager_fallbacks(caught: list) -> list[str]:
    """The recorded warnings that say flex_attention ran eagerly (unfused) instead of compiled."""
    return [str(w.message) for w in caught if "without torch.compile" in str(w.message)]


def case_timing(case: BenchCase, opts: Options) -> tuple[int, float, int]:
    """(most timed calls, timing budget in ms, fewest timed calls) for ``case``: the suite's override, never
    more calls than the options allow."""
    suite = SUITES.get(case.suite)
    timing = suite.timing if suite is not None else None
    max_reps, budget, min_reps = timing or (opts.max_reps, opts.budget_ms, opts.min_reps)
    return min(max_reps, opts.max_reps), budget, min(min_reps, opts.min_reps)


#: Warm-up before the timed calls lasts about this long by the first estimate (as triton.testing.do_bench
#: warms up by time), at most MAX_WARMUP calls: a host that waited for the GPU (the memory call's
#: synchronize) runs its first calls slower, which times a host-bound call high.
WARMUP_MS, MAX_WARMUP = 25.0, 500


def reps_and_warmup(est_ms: float, max_reps: int, budget_ms: float, min_reps: int) -> tuple[int, int]:
    """Timed calls (the budget over the estimated call, clamped) and warm-up calls: none for calls over
    20 ms, else at least 2 (5 below 2 ms) and enough for WARMUP_MS by the estimate, at most MAX_WARMUP."""
    reps = int(min(max_reps, max(min_reps, budget_ms // max(est_ms, 1e-3))))
    if est_ms > 20:
        return reps, 0
    return reps, int(min(MAX_WARMUP, max(2 if est_ms > 2 else 5, math.ceil(WARMUP_MS / max(est_ms, 1e-3)))))


DEFAULT_REPS, DEFAULT_BUDGET_MS, DEFAULT_MIN_REPS = 30, 100.0, 3


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
    rounds: int = 5  #: interleaved rounds the timed calls of a case's forward competitors are cut into
    run_id: str = ""
    gpu: str = ""


# ---------------------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
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


_T = TypeVar("_T")

#: up to this many competitors :func:`next_round` weighs every order of a round; beyond, it builds one greedily
EXHAUSTIVE_UP_TO = 7


def next_round(names: Sequence[_T], last: _T | None, pairs: Counter) -> list[_T]:
    """The order of the next round of ``names``, ``last`` having run just before it: no one runs right after
    itself, and the pairs (a ran right before b, counted in ``pairs``, which is updated) that have run least so
    far come first. So no competitor keeps following the same other and paying for the state it leaves the GPU
    in (docs/decisions.md, "The bench's order of competitors"). Up to :data:`EXHAUSTIVE_UP_TO` names, the order
    whose most-run pair has run least (then whose pairs have run least in all) wins, the earliest of the orders
    of ``names`` on a tie; beyond, each place takes the name that has run least right after the one before."""
    names = list(names)
    if not names:
        return []

    def steps(order):
        return list(zip([last, *order], order))  # (who ran before, who runs) for each place

    if len(names) <= EXHAUSTIVE_UP_TO:
        def cost(order):
            ps = steps(order)
            return any(a == b for a, b in ps), max(pairs[p] for p in ps), sum(pairs[p] for p in ps)
        best = list(min(itertools.permutations(names), key=cost))
    else:
        best, left = [], list(names)
        for _ in names:
            before = best[-1] if best else last
            best.append(min(left, key=lambda b, a=before: (a == b, pairs[(a, b)])))
            left.remove(best[-1])
    pairs.update(steps(best))
    return best


def round_orders(names: Sequence[_T], rounds: int) -> Iterator[list[_T]]:
    """The order of each of ``rounds`` interleaved rounds run back to back: the first as given, each later one
    from :func:`next_round`."""
    order, pairs = list(names), Counter()
    for r in range(rounds):
        if r:
            order = next_round(names, order[-1] if order else None, pairs)
        yield order


def mean_gpu_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """Milliseconds per call of ``calls`` calls queued back to back on the current stream, between two CUDA
    events (the probes' interleaved rounds: no gap between calls, one synchronize)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def interleaved_ms(labels: Sequence[str], call_of: Callable[[str], Callable[[], Any]], rounds: int,
                   warmup: int = 3, calls: int = 20,
                   time_one: Callable[[Callable[[], Any], int], float] = mean_gpu_ms) -> dict[str, float]:
    """The probes' A/B timing: each label's milliseconds per call, the upper median over ``rounds`` rounds that
    follow one more, untimed, that warms up; the rounds in the orders of :func:`round_orders`. At each turn
    ``call_of(label)`` gives the call (a probe may switch a setting there), which runs ``warmup`` times and is
    then timed by ``time_one(call, calls)`` (:func:`mean_gpu_ms`: back-to-back calls between CUDA events)."""
    times: dict[str, list[float]] = {label: [] for label in labels}
    for order in round_orders(list(labels), rounds + 1):
        for label in order:
            fn = call_of(label)
            for _ in range(warmup):
                fn()
            times[label].append(time_one(fn, calls))
    return {label: sorted(t[1:])[len(t[1:]) // 2] for label, t in times.items()}


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
    outs = out if isinstance(out, (tuple, list)) else (out,)  # a backward returns its gradients
    out_bytes = sum(t.untyped_storage().nbytes() for t in outs if isinstance(t, torch.Tensor))
    del out, outs
    return a.elapsed_time(b), max(0.0, (peak - before - out_bytes) / MIB)


#: GPU clock cycles of the sleep queued before the host-time calls (about 10 ms at 2 GHz).
HOST_SLEEP_CYCLES = 20_000_000


def host_calls(est_ms: float) -> int:
    """How many calls the host time averages: 10 for short calls, fewer (at least 1) above 2 ms a call."""
    return int(min(10, max(1, 20.0 // max(est_ms, 1e-3))))


def measure_host(call: Callable[[int], Any], sets: int, n: int, device: torch.device,
                 start: int = 0) -> tuple[float, bool]:
    """(host microseconds per call, whether the GPU stayed busy throughout).

    On a GPU, ``n`` calls run back to back without a synchronize, queued behind a GPU sleep
    (:data:`HOST_SLEEP_CYCLES`): the host never waits for the GPU, unless a call synchronizes, which then
    shows as the sleep's length in the host time (and the GPU not busy at the end). On a CPU: wall time.
    """
    busy = True
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda._sleep(HOST_SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
    t0 = time.perf_counter()
    for r in range(n):
        call((start + r) % sets)
    host = time.perf_counter() - t0
    if device.type == "cuda":
        busy = not slept.query()
        torch.cuda.synchronize(device)
    return host / n * 1e6, busy


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def quantile(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    pos = p * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand torch's cached blocks back (between measurements)."""
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
