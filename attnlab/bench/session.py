"""One ``attnlab bench`` session: the estimate, the run loop over suites and cases, restarts after a lost CUDA
context, and the summary. Its options are parsed by :func:`attnlab.cli.bench_parser`."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from attnlab.backends.triton import hopper_forward as hopper
from attnlab.bench.case_run import run_case
from attnlab.bench.competitors import competitors
from attnlab.bench.results import device_name, environment, gpu_slug, ratios, read_rows, write_csv
from attnlab.bench.runner import ROUND_WARMUP, ContextLost, case_counts, status_rows
from attnlab.bench.suites import BACKWARD_MODES, SUITES, BenchCase, recorded_suites, row_keys
from attnlab.bench.timing import (
    HOST_SLEEP_CYCLES,
    Options,
    case_timing,
    host_calls,
    reps_and_warmup,
)

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
    the checked call, then per timed mode (one; three for a backward case) the memory call, warm-up, the timed
    calls and the host-time calls behind their GPU sleep, at assumed rates (:data:`_RATE`)."""
    total = 0.0
    gpu = opts.device.startswith("cuda")
    sleep_s = HOST_SLEEP_CYCLES / 2e9 if gpu else 0.0
    tuned = set()
    for case in cases:
        c = case_counts(case)
        bwd = case.backward
        total += (1.5 if bwd else 0.5) + (FLEX_COMPILE_S * (2.5 if bwd else 1.0) if "flex" in names and gpu else 0.0)
        key = (case.B, case.Hq, case.Nq, case.nk, case.D, case.dtype, case.causal, case.kv_len is None)
        if gpu and key not in tuned and any(n in ("triton", "auto", "triton-kernel") for n in names):
            total += TRITON_TUNE_S * (2 if bwd else 1)  # shared by triton, auto and triton-kernel in one process
            tuned.add(key)
        max_reps, budget, min_reps = case_timing(case, opts)
        modes = [m for _, _, m in BACKWARD_MODES] if bwd else [1.0]
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
            total += 0.15 + (3.5 * ms / 1e3 if bwd else ms / 1e3)
            for m in modes:
                mms = m * ms
                reps, warm = reps_and_warmup(mms, max_reps, budget, min_reps)
                total += (1 + warm + reps + host_calls(mms)) * mms / 1e3 + sleep_s
    return total


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def default_out(device: str) -> Path:
    """Where a run writes by default: data/bench for a GPU; a temporary folder for a CPU smoke run, so that
    CPU rows never land beside (or displace) the recorded GPU data."""
    if device.startswith("cuda"):
        return Path("data/bench")
    return Path(tempfile.gettempdir()) / "attnlab-bench"


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


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``attnlab bench``: run suites, write CSV and JSON per suite, print a summary. ``args`` are the parsed
    options (:func:`attnlab.cli.bench_parser`), ``argv`` the command line they came from (recorded, and reused
    by a restart after a lost CUDA context)."""
    argv = list(argv)
    device = args.device
    no_gpu = device.startswith("cuda") and not torch.cuda.is_available()
    if no_gpu and not args.estimate:
        print("attnlab bench: no CUDA GPU here (torch.cuda.is_available() is False). Use --device cpu for a "
              "smoke run of the harness, e.g. `python -m attnlab bench --suite quick --device cpu`.", file=sys.stderr)
        return 2
    if not (device.startswith("cuda") or device == "cpu"):
        print(f"attnlab bench: --device must be cuda or cpu; got {device!r}", file=sys.stderr)
        return 2
    if "ATTNLAB_HOPPER" not in os.environ:  # every timed call of a case runs one kernel, compiled on the first
        hopper.set_mode("sync")
    t_start = time.time()
    deadline = args.deadline_at if args.deadline_at is not None else (
        t_start + args.deadline_s if args.deadline_s is not None else None)
    run_id = args.run_id or _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    gpu = "(no GPU here)" if no_gpu else device_name(device)
    opts = Options(device=device, max_reps=args.reps, min_reps=args.min_reps, budget_ms=args.budget_ms,
                   seed=args.seed, deadline=deadline, run_id=run_id, gpu=gpu, max_call_s=args.max_call_s)
    suites = list(dict.fromkeys(n for a in args.suite for n in (recorded_suites() if a == "all" else [a])))
    plan, comps_of = [], {}
    for s in suites:
        cases = SUITES[s].cases(device)
        if args.cases:
            cases = [c for c in cases if args.cases in c.name]
        plan.append((s, cases))
        try:  # --backends, else the suite's own rivals, else every competitor
            comps_of[s] = competitors(args.backends or SUITES[s].backends)
        except ValueError as e:
            print(f"attnlab bench: {e}", file=sys.stderr)
            return 2
    names_of = {s: [c.name for c in comps_of[s]] for s in suites}
    est = {s: estimate_seconds(cases, names_of[s], opts) for s, cases in plan}
    any_flex = any("flex" in n for n in names_of.values())
    first_flex = 15.0 if any_flex and device.startswith("cuda") else 0.0  # Inductor's cold start
    print(f"attnlab bench on {gpu} ({device}), run {run_id}: " + ", ".join(
        f"{s} {len(c)} cases ~{est[s]:.0f} s" for s, c in plan) + f"; total ~{sum(est.values()) + first_flex:.0f} s "
        f"(crude estimate: assumed rates, flex compile {FLEX_COMPILE_S:g} s and Triton tuning {TRITON_TUNE_S:g} s "
        "per case)", flush=True)
    if args.estimate:
        return 0
    folder = Path(args.out if args.out is not None else default_out(device)) / gpu_slug(gpu)
    env = environment(device, argv)
    env.update(run_id=run_id, options={
        "max_reps": opts.max_reps, "min_reps": opts.min_reps, "budget_ms": opts.budget_ms, "seed": opts.seed,
        "suite_timing": {n: st.timing for n, st in SUITES.items() if st.timing},
        "competitors": {s: names_of[s] for s in suites}, "excluded": args.exclude,
        "suite_deadline_s": {s: _suite_deadline_s(s, args) for s in suites},
        "flex": "torch.compile(flex_attention, fullgraph=True, dynamic=False); torch._dynamo.reset() per case; "
                "recompile limit raised, fail_on_recompile_limit_hit",
        "timing": "median of CUDA-event-timed calls rotating over input sets >= 4x L2, after a checked call, "
                  "a memory call and >= 25 ms of warm-up; a case's forward competitors' timed calls run in "
                  f"{opts.rounds} interleaved rounds (the first in the order given, each later one in the order "
                  "that spreads whom each competitor runs right after, never itself; "
                  f"{ROUND_WARMUP} untimed calls open each later round); attnlab rows time the public call "
                  "attnlab.attention(...) (path 'public'), <backend>-kernel rows backend.forward on a Problem "
                  "validated once (path 'kernel')",
        "host_us": f"{HOST_SLEEP_CYCLES} GPU cycles of sleep queued, then up to 10 calls back to back unsynchronized; "
                   "host wall time / calls",
    })
    total_pairs = sum(len(row_keys(c)) * len(names_of[s]) for s, cases in plan for c in cases)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_pairs, desc="bench", unit="run", dynamic_ncols=True, file=sys.stderr)
    all_rows: list[dict[str, Any]] = []
    for suite, cases in plan:
        comps, names = comps_of[suite], names_of[suite]
        path = folder / f"{suite}.csv"
        kept: list[dict[str, Any]] = []
        others: list[dict[str, Any]] = []
        if args.resume and path.exists():
            # skipped rows (deadline, exclusions) are decided again; everything else that ran is kept
            kept = [r for r in read_rows(path) if (args.run_id is None or r.get("run_id") == args.run_id)
                    and r.get("status") != "skipped"]
        elif args.keep_others and path.exists():
            # the rows of competitors this run does not measure stay, with their own run_id
            ours = {k for c in cases for k, _ in row_keys(c)}
            others = [r for r in read_rows(path) if r.get("backend") not in names and r.get("case") in ours]
        done = {(r["case"], r["backend"]) for r in kept}
        rows = list(kept) if args.resume else list(others) if args.keep_others else []
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
        if others and jpath.exists():  # say which earlier runs the kept rows are from (the json is replaced)
            old = json.loads(jpath.read_text())
            kept_runs = dict(old.get("kept_runs", {}))
            if old.get("run_id"):
                kept_runs[old["run_id"]] = {k: old.get(k) for k in ("commit", "date_utc", "torch", "triton")}
            ids = {r.get("run_id") for r in others}
            senv["kept_runs"] = {rid: v for rid, v in kept_runs.items() if rid in ids}
        jpath.write_text(json.dumps(senv, indent=2, default=str))
        t_suite = time.time()
        own = _suite_deadline_s(suite, args)
        sdl = deadline if own is None else min(t_suite + own, deadline if deadline is not None else math.inf)
        opts.deadline = sdl

        def on_row(row, rows=rows, path=path, cases=cases, names=names):
            rows.append(row)
            write_csv(path, _ordered(rows, cases, names))
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{row['case'][:34]} {row['backend']} {row['status']}")

        for case in cases:
            if bar is not None:
                bar.set_description(f"{suite}")
                bar.update(sum(len(row_keys(case)) for n in names if _done(case, n, done)))

            def skip(name, case=case, suite=suite, rows=rows, sdl=sdl):
                if sdl is not None and time.time() > sdl:
                    return "deadline reached"
                if name in args.exclude:
                    return "excluded" + (" (it broke the CUDA context earlier in this run)" if args.run_id else "")
                if suite == "memory" and _oomed_before(rows, name, case):
                    return "ran out of memory at a smaller N"
                pred = _predicted_ms(rows, name, case)
                if pred is not None and pred > opts.max_call_s * 1e3:
                    return f"predicted {pred / 1e3:.1f} s a call (from smaller cases) > --max-call-s {opts.max_call_s}"
                return None

            todo = [c for c in comps if not _done(case, c.name, done)]
            keys = {k for k, _ in row_keys(case)}
            rows[:] = [r for r in rows if not (r["case"] in keys and r["backend"] in {c.name for c in todo})]
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
                    for r in status_rows(case, culprit, opts, case_counts(case), status="error", notes=msg):
                        on_row(r)
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
    return 0


def case_line(rows: Sequence[dict[str, Any]]) -> str:
    """One line for a case's rows: each timed backend's TFLOP/s (or GB/s for decode; with ms and host time
    when a call is short) and the other statuses (once per backend for a backward case)."""
    parts, first = [], {}
    for r in rows:
        first.setdefault(r["backend"], r["status"])
    for r in rows:
        name = r["backend"] + ("" if r.get("mode", "fwd") == "fwd" else f" {r['mode']}")
        if r["status"] == "ok":
            val = f"{r['gbps']:.4g} GB/s" if r["Nq"] == 1 else f"{r['tflops']:.4g} TF/s"
            if r["ms"] < 1.0 and r.get("host_us", "") != "":
                val += f" ({r['ms'] * 1e3:.0f} us, host {r['host_us']:.0f} us)"
            parts.append(f"{name} {val}")
        elif r.get("mode", "fwd") == "fwd" or r["status"] != first[r["backend"]]:
            parts.append(f"{name} {r['status'].upper()}")
    return ", ".join(parts)


def _suite_deadline_s(suite: str, args: argparse.Namespace) -> float | None:
    """Seconds a suite may start measurements for: ``--suite-deadline-s`` (0: none), else the suite's own."""
    if args.suite_deadline_s is not None:
        return args.suite_deadline_s or None
    return SUITES[suite].deadline_s


def _done(case: BenchCase, name: str, done: set[tuple[str, str]]) -> bool:
    """Whether every row of ``case`` for competitor ``name`` was kept from an earlier run."""
    return all((k, name) in done for k, _ in row_keys(case))


def _ordered(rows: list[dict[str, Any]], cases: Sequence[BenchCase], names: Sequence[str]) -> list[dict[str, Any]]:
    """Rows sorted by case order then competitor order (rows of unknown cases/competitors last)."""
    ci = {k: i for i, c in enumerate(cases) for k, _ in row_keys(c)}
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
