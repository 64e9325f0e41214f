"""The benchmark harness on a CPU: FLOP and byte counting per mask, the pass/fail gate, status rows, the
CSV schema and JSON metadata, load/ratios, flex's mask translation, and a smoke run of the quick suite."""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import math
import time

import pytest
import torch

from attnlab import bench
from attnlab.bench import runner as bench_runner
from attnlab.bench import session as bench_cli
from attnlab.cli import main as attnlab_main
from attnlab.masks import MaskSpec

# (B, Hq, Nq, Nk, keywords): every structural mask kind, both alignments, Nq < Nk and Nq > Nk.
SPECS = [
    (2, 3, 17, 17, {}),
    (2, 3, 17, 17, {"causal": True}),
    (2, 2, 9, 31, {"causal": True, "align": "top_left"}),
    (2, 2, 9, 31, {"causal": True, "align": "bottom_right"}),
    (2, 2, 31, 9, {"causal": True, "align": "bottom_right"}),
    (1, 2, 40, 40, {"window": (8, 4)}),
    (1, 2, 40, 40, {"window": (6, None)}),
    (1, 2, 40, 40, {"window": (None, 3)}),
    (2, 2, 19, 50, {"causal": True, "window": (5, None), "align": "bottom_right"}),
    (1, 2, 30, 12, {"window": (2, 1), "align": "top_left"}),
    (3, 2, 31, 45, {"kv_len": [0, 23, 45]}),
    (3, 2, 29, 29, {"kv_len": [29, 13, 0], "q_len": [29, 20, 5]}),
    (3, 2, 24, 40, {"causal": True, "align": "bottom_right", "kv_len": [40, 31, 10], "q_len": [24, 9, 17]}),
    (3, 2, 20, 41, {"causal": True, "align": "top_left", "kv_len": [41, 7, 30]}),
    (2, 2, 33, 33, {"window": (4, 2), "align": "bottom_right", "kv_len": [33, 20], "q_len": [10, 33]}),
]


@pytest.mark.parametrize("B,Hq,Nq,Nk,kw", SPECS)
def test_allowed_count_matches_predicate(B, Hq, Nq, Nk, kw):
    spec = MaskSpec.build(B, Hq, Nq, Nk, **kw)
    ok = spec.allowed()
    assert torch.equal(bench.row_counts(spec), ok.sum(dim=-1)[:, 0].long())
    assert bench.allowed_count(spec) == int(ok.expand(B, Hq, Nq, Nk).sum())
    empty = bench.empty_rows(spec)
    want = ~ok.any(dim=-1, keepdim=True)
    if empty is None:
        assert not bool(want.any())
    else:
        assert torch.equal(empty, want)


def test_allowed_count_explicit_mask_and_bias():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(2, 3, 13, 21, generator=g) < 0.6
    spec = MaskSpec.build(2, 3, 13, 21, causal=True, align="bottom_right", mask=m)
    assert bench.allowed_count(spec, chunk_rows=4) == int(spec.allowed().sum())
    bias = torch.randn(1, 1, 13, 21, generator=g).masked_fill(torch.rand(1, 1, 13, 21, generator=g) < 0.3, -math.inf)
    spec = MaskSpec.build(2, 3, 13, 21, kv_len=[21, 9], mask=bias)
    want = (spec.allowed() & (spec.bias != -math.inf)).sum()
    assert bench.allowed_count(spec, chunk_rows=5) == int(want)


def test_flops_convention():
    dense = bench.BenchCase("t", "d", B=2, Hq=4, Nq=64, D=32)
    assert bench.useful_flops(dense) == 4 * 2 * 4 * 64 * 64 * 32
    causal = bench.BenchCase("t", "c", B=2, Hq=4, Nq=64, D=32, causal=True)
    assert bench.useful_flops(causal) == 4 * 2 * 4 * 32 * (64 * 65 // 2)  # exact: N(N+1)/2 per head
    br = bench.BenchCase("t", "br", B=1, Hq=2, Nq=4, Nk=10, D=8, causal=True, align="bottom_right")
    assert bench.useful_flops(br) == 4 * 2 * 8 * (7 + 8 + 9 + 10)
    pad = bench.BenchCase("t", "p", B=2, Hq=1, Nq=8, D=4, kv_len=(3, 8))
    assert bench.useful_flops(pad) == 4 * 4 * 8 * (3 + 8)
    c = bench.case_counts(pad)
    assert c["allowed_frac"] == pytest.approx(11 / 16)


def test_min_bytes():
    dec = bench.BenchCase("t", "dec", B=2, Hq=8, Hkv=2, Nq=1, Nk=100, D=16)
    es = 2
    assert bench.min_bytes(dec) == (2 * 2 * 8 * 1 * 16 + 2 * 2 * 2 * 100 * 16) * es
    ragged = bench.BenchCase("t", "r", B=2, Hq=8, Hkv=2, Nq=1, Nk=100, D=16, kv_len=(10, 100))
    assert bench.min_bytes(ragged) == (2 * 2 * 8 * 16 + 2 * 2 * (10 + 100) * 16) * es
    win = bench.BenchCase("t", "w", B=1, Hq=1, Nq=1, Nk=100, D=16, window=(9, 0), align="bottom_right")
    assert bench.min_bytes(win) == (2 * 16 + 2 * 10 * 16) * es


def test_suites_are_well_formed():
    for name, suite in bench.SUITES.items():
        assert suite.name == name
        cases = suite.cases("cuda")
        assert cases, name
        assert len({c.name for c in cases}) == len(cases)
        assert all(c.suite == name for c in cases)
        for c in cases:
            c.spec()  # valid keywords
    assert len(bench.dense_suite()) == 25  # 24 of the grid and the sliding window
    pad = bench.padding_suite()
    kv = pad[0].kv_len
    assert kv == bench.padding_suite()[0].kv_len  # seeded
    assert all(4096 // 4 <= x <= 4096 for x in kv) and len(kv) == 8
    assert {c.causal for c in pad} == {False, True}
    dec = bench.decode_suite()
    assert all(c.Nq == 1 and c.Hq == 32 and c.hkv in (8, 32) for c in dec)
    assert {c.B for c in dec} == {1, 8, 16} and {min(c.nk for c in dec), max(c.nk for c in dec)} == {4096, 131072}
    assert any(c.kv_len for c in dec) and any(not c.kv_len for c in dec)
    assert all(c.Nq == 512 and c.nk == 8192 and c.align == "bottom_right" for c in bench.prefill_suite())
    assert max(c.Nq for c in bench.memory_suite()) == 32768
    # quick is a smoke run and tuning a comparison run by name only: neither is part of --suite all
    assert "quick" not in bench.ALL_ORDER
    assert set(bench.ALL_ORDER) == set(bench.SUITES) - {"quick", "tuning", "scoremod", "scoremod-decode"}
    assert bench.ALL_ORDER == ("fp32", "padding", "prefill", "decode", "memory", "dense", "latency", "bias",
                               "backward")
    assert bench.recorded_suites() == bench.ALL_ORDER


def test_a_suite_is_one_entry():
    """Adding one Suite to SUITES adds it to the command line and, with an all_rank, to --suite all."""
    from attnlab import cli
    from attnlab.bench import suites

    extra = suites.Suite("extra", lambda device: [bench.BenchCase("extra", "x", B=1, Hq=1, Nq=8, D=16)], all_rank=9)
    saved = dict(suites.SUITES)
    try:
        suites.SUITES["extra"] = extra
        assert "extra" in cli.bench_parser()._option_string_actions["--suite"].choices
        assert bench.suite_cases("extra", "cpu")[0].name == "x"
    finally:
        suites.SUITES.clear()
        suites.SUITES.update(saved)


def test_check_slice_is_a_consistent_subproblem():
    """The sliced reference equals the slice of the full reference (GQA, lengths, bottom-right)."""
    case = bench.BenchCase("t", "s", B=3, Hq=6, Hkv=3, Nq=12, Nk=20, D=8, dtype="float32", causal=True,
                           align="bottom_right", kv_len=(20, 7, 15))
    sl = bench.check_slice(case, full_scores=1)
    assert sl == ([0, 2], [0, 1, 4, 5], [0, 2])
    inp = bench.make_case_inputs(case, "cpu", seed=3, sets=2)
    truth = bench.make_truth(inp, full_scores=1)
    from attnlab.reference import reference

    full, _ = reference(inp.qs[0], inp.ks[0], inp.vs[0], **inp.kw)
    assert torch.allclose(bench.take_slice(full, sl), truth.ref, atol=1e-12)
    assert truth.scope.startswith("slice") and truth.base is None
    assert bench.check_slice(case) is None


def _right(inp):
    from attnlab.api import attention

    return lambda i: attention(inp.qs[i], inp.ks[i], inp.vs[i], backend="sdpa", **inp.kw)


def _cpu_opts(**kw):
    return bench.Options(**{**dict(device="cpu", max_reps=5, min_reps=2, budget_ms=5.0, run_id="test", gpu="cpu"),
                            **kw})


CASE = bench.BenchCase("t", "gate", B=2, Hq=2, Nq=24, D=16, dtype="bfloat16", causal=True, kv_len=(24, 9))


def test_competitors_timed_calls_interleave_in_rounds_each_inside_its_own_context():
    """The forward competitors of a case are checked, measured and warmed up one after another, then their
    timed calls run in alternating rounds, then their host times: a drift
    over the case's run, or a state one competitor leaves the GPU in, falls on both.
    Prepared.context (SDPA's sdpa_kernel) is entered around every stretch of a competitor's calls and never
    around another's; its cost is in no timed call."""
    events, used, sets = [], {}, {}

    def competitor(name):
        @contextlib.contextmanager
        def ctx():
            events.append((name, "enter"))
            yield
            events.append((name, "exit"))

        def prep(inp):
            good = _right(inp)
            sets[name] = inp.sets

            def call(i):
                events.append((name, "call"))
                used.setdefault(name, []).append(i)
                return good(i)

            return bench.Prepared(call=call, context=ctx)

        return bench.Competitor(name, "test", prep)

    rows = bench.run_case(CASE, [competitor("a"), competitor("b")], _cpu_opts(rounds=3, max_reps=6, min_reps=6))
    # (rows come as each competitor's run ends)
    assert [(r["backend"], r["status"], r["reps"]) for r in rows] == [("a", "ok", 6), ("b", "ok", 6)]
    inside = None
    for name, what in events:
        if what == "enter":
            assert inside is None
            inside = name
        elif what == "exit":
            assert inside == name
            inside = None
        else:
            assert inside == name  # every call inside its own competitor's context
    stretches = [name for name, what in events if what == "enter"]
    # a: the check, memory and warm-up, round 1; b the same; then rounds 2 and 3 and the host times, a turn each,
    # (two competitors: each always runs right after the other, never after itself)
    assert stretches == ["a"] * 3 + ["b"] * 3 + ["a", "b"] * 3
    for name in ("a", "b"):  # after the checked (set 0) and memory (set 1) calls, each call takes the next set
        seq = used[name][2:]
        assert len(seq) > 6 + 2 * bench.runner.ROUND_WARMUP
        assert all(y == (x + 1) % sets[name] for x, y in itertools.pairwise(seq)), seq
    one = bench.run_case(CASE, [competitor("c")], _cpu_opts(rounds=1, max_reps=6, min_reps=6))
    assert one[0]["reps"] == 6


def _predecessors(orders):
    """name -> whom it ran right after in each round but the first (rounds run back to back)."""
    from attnlab.lessons.bench_order import predecessors

    return {name: predecessors(orders, name) for name in orders[-1]}


def test_round_orders_spread_whom_each_runs_after():
    """For 2 to 7 names over 4 and 8 later rounds: every round is a permutation, no name runs right after itself
    (across rounds too), and no name runs after the same other more often than an even spread allows. Beyond
    EXHAUSTIVE_UP_TO (8 and 9 names) the greedy build still never repeats a name and varies each one's
    predecessor. A fixed order, a rotated one or one shuffle drawn for all keep a predecessor."""
    for n in range(2, 10):
        for later in (4, 8):
            orders = list(bench.timing.round_orders(list(range(n)), later + 1))
            assert orders[0] == list(range(n)) and all(sorted(o) == list(range(n)) for o in orders)
            preds = _predecessors(orders)
            assert all(b not in p for b, p in preds.items()), (n, later)
            most = max(max(p.count(a) for a in set(p)) for p in preds.values())
            if n <= bench.timing.EXHAUSTIVE_UP_TO:
                assert most == math.ceil(later / (n - 1)), (n, later)
            else:
                assert most <= 3 and all(len(set(p)) > 1 for p in preds.values()), (n, later)
    assert list(bench.timing.round_orders([], 3)) == [[], [], []]


def test_interleave_runs_the_turns_after_the_first_as_next_round_picks():
    """Four generators of 9 steps and one of 1: the first turn runs in the order given; the one-step generator
    ends there, and each later turn runs the four live ones so that none runs right after itself or after the
    same other more than 3 times in 8; results come back in the generators' order and to on_done as each ends."""
    log, done = [], []

    def steps(i, n):
        for k in range(n):
            log.append(i)
            if k < n - 1:
                yield
        return i * 10

    got = bench.runner.interleave([steps(0, 9), steps(1, 9), steps(2, 9), steps(3, 9), steps(4, 1)],
                                  on_done=done.append)
    assert got == [0, 10, 20, 30, 40]
    assert done[0] == 40 and sorted(done) == got
    assert log[:5] == [0, 1, 2, 3, 4]
    turns = [log[:5]] + [log[5 + 4 * t:9 + 4 * t] for t in range(8)]
    assert all(sorted(t) == [0, 1, 2, 3] for t in turns[1:])
    preds = _predecessors(turns)
    assert all(b not in p and max(p.count(a) for a in set(p)) <= 3 for b, p in preds.items() if b != 4), preds


def test_gate_wrong_output_is_failed_and_untimed():
    def wrong(inp):
        good = _right(inp)
        return bench.Prepared(call=lambda i: good(i) * 1.05)

    def nan_row(inp):
        good = _right(inp)

        def call(i):
            o = good(i).clone()
            o[1, 1, 5] = float("nan")
            return o

        return bench.Prepared(call=call)

    comps = [
        bench.Competitor("right", "test", lambda inp: bench.Prepared(call=_right(inp))),
        bench.Competitor("wrong", "test", wrong),
        bench.Competitor("nan", "test", nan_row),
    ]
    rows = {r["backend"]: r for r in bench.run_case(CASE, comps, _cpu_opts())}
    ok = rows["right"]
    assert ok["status"] == "ok" and ok["passed"] is True
    assert ok["ms"] > 0 and 2 <= ok["reps"] <= 5 and ok["tflops"] > 0 and ok["gbps"] > 0
    assert ok["flops"] == bench.useful_flops(CASE)
    for name in ("wrong", "nan"):
        r = rows[name]
        assert r["status"] == "failed" and r["passed"] is False
        assert r["ms"] == "" and r["tflops"] == "" and r["reps"] == "" and r["peak_extra_mib"] == ""
        assert "FAIL" in r["notes"]
    assert rows["wrong"]["max_abs_err"] > 0


def test_attnlab_backend_must_write_every_element():
    """attnlab backends are checked on a NaN-poisoned output: a skipped element fails."""
    from attnlab import backends as _b

    real = _b.registry()["sdpa"]

    class Lazy(_b.Backend):
        name = "lazy-test"

        def forward(self, prob, out, lse):
            tmp = torch.empty_like(out)
            real.forward(prob, tmp, None)
            out[:, :, :-1] = tmp[:, :, :-1]  # the last row is never written

    reg = _b.registry()
    reg["lazy-test"] = Lazy()
    try:
        rows = bench.run_case(CASE, bench.competitors(["sdpa", "lazy-test"]), _cpu_opts())
    finally:
        del reg["lazy-test"]
    st = {r["backend"]: r["status"] for r in rows}
    assert st == {"sdpa": "ok", "lazy-test": "failed"}


def test_paged_rows_run_the_public_call_on_paged_caches():
    """``auto-paged16``: the public call with paged caches, checked on a poisoned output like every attnlab row,
    its notes naming the block size and what auto picked; a KV length its blocks do not divide is unsupported."""
    from attnlab.bench.suites import decode_suite

    case = decode_suite("cpu")[0]
    rows = bench.run_case(case, bench.competitors(["auto-paged16", "triton-decode"]), _cpu_opts())
    st = {r["backend"]: (r["status"], r["notes"]) for r in rows}
    assert st["auto-paged16"][0] == "ok" and st["triton-decode"][0] == "ok"
    assert st["auto-paged16"][1].startswith("paged cache, blocks of 16 keys; auto picked ")
    inp = bench.make_case_inputs(case, "cpu", seed=0, sets=1)
    with pytest.raises(bench.Unsupported, match="multiple of 7"):
        bench.competitors(["auto-paged7"])[0].prepare(inp)


def test_status_rows_for_exceptions():
    def raiser(exc):
        def prepare(inp):
            def call(i):
                raise exc

            return bench.Prepared(call=call)

        return prepare

    def unsupported(inp):
        raise bench.Unsupported("D too large for this kernel")

    def unavailable(inp):
        raise bench.Unavailable("needs cupy")

    comps = [
        bench.Competitor("oom", "test", raiser(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))),
        bench.Competitor("boom", "test", raiser(ValueError("bad launch"))),
        bench.Competitor("unsup", "test", unsupported),
        bench.Competitor("unav", "test", unavailable),
    ]
    rows = {r["backend"]: r for r in bench.run_case(CASE, comps, _cpu_opts(), skip=None)}
    assert rows["oom"]["status"] == "oom" and "out of memory" in rows["oom"]["notes"]
    assert rows["boom"]["status"] == "error" and "bad launch" in rows["boom"]["notes"]
    assert rows["unsup"]["status"] == "unsupported" and "D too large" in rows["unsup"]["notes"]
    assert rows["unav"]["status"] == "unavailable"
    assert all(r["ms"] == "" and r["passed"] == "" for r in rows.values())
    # skipped and deadline rows
    rows = bench.run_case(CASE, comps[:1], _cpu_opts(), skip=lambda n: "excluded")
    assert rows[0]["status"] == "skipped" and rows[0]["notes"] == "excluded"
    rows = bench.run_case(CASE, comps[:1], _cpu_opts(deadline=0.0))
    assert rows[0]["status"] == "skipped" and "deadline" in rows[0]["notes"]

    def slow(inp):  # its setup runs past the deadline: the competitor after it does not start
        time.sleep(0.3)
        return bench.Prepared(call=_right(inp))

    comps = [bench.Competitor("slow", "test", slow), bench.Competitor("late", "test", slow)]
    rows = {r["backend"]: r for r in bench.run_case(CASE, comps, _cpu_opts(deadline=time.time() + 0.2))}
    assert rows["slow"]["status"] == "ok" and rows["late"]["status"] == "skipped"


def test_sdpa_competitors_on_cpu():
    case = bench.BenchCase("t", "gqa", B=2, Hq=4, Hkv=2, Nq=8, Nk=40, D=16, dtype="float32", causal=True,
                           align="bottom_right", kv_len=(40, 20))
    rows = {r["backend"]: r for r in bench.run_case(case, bench.competitors(["sdpa-math", "sdpa-cudnn"]),
                                                    _cpu_opts())}
    assert rows["sdpa-math"]["status"] == "ok", rows["sdpa-math"]["notes"]
    assert rows["sdpa-math"]["setup_mib"] > 0  # the materialized mask
    assert rows["sdpa-cudnn"]["status"] == "unsupported"
    # bottom-right causal (prefill): flash takes it as causal_lower_right; rows with no key are zeroed first
    case = bench.BenchCase("t", "br", B=1, Hq=2, Nq=48, Nk=16, D=16, dtype="float32", causal=True,
                           align="bottom_right")
    row = bench.run_case(case, bench.competitors(["sdpa-flash"]), _cpu_opts())[0]
    assert row["status"] == "ok" and "causal_lower_right" in row["notes"]
    assert "32 empty rows zeroed" in row["notes"]


@pytest.mark.parametrize("B,Hq,Nq,Nk,kw", SPECS)
def test_flex_mask_mod_matches_reference(B, Hq, Nq, Nk, kw):
    """The mask_mod given to FlexAttention is the contract's predicate (eager flex, CPU)."""
    import warnings

    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    spec = MaskSpec.build(B, Hq, Nq, Nk, **kw)
    mask_mod, score_mod, by_b, by_h = spec.flex_mods()
    if mask_mod is None:
        assert spec.kind == "dense"
        return
    bm = flex.create_block_mask(mask_mod, B if by_b else None, Hq if by_h else None, Nq, Nk, device="cpu")
    b, h, i, j = torch.meshgrid(torch.arange(B), torch.arange(1), torch.arange(Nq), torch.arange(Nk), indexing="ij")
    got = mask_mod(b, h, i, j)
    assert torch.equal(got, spec.allowed().expand(B, 1, Nq, Nk))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, Hq, n, 8, generator=g) for n in (Nq, Nk, Nk))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex.flex_attention(q, k, v, block_mask=bm, score_mod=score_mod)
    from attnlab.reference import reference

    ref, _ = reference(q, k, v, **kw)
    empty = bench.empty_rows(spec)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_csv_json_load_and_ratios_from_a_cpu_quick_run(tmp_path, capsys):
    argv = ["--suite", "quick", "--device", "cpu", "--out", str(tmp_path), "--no-progress", "--budget-ms", "5",
            "--reps", "4", "--backends", "torch", "sdpa", "cuda-tiled", "sdpa-flash", "sdpa-efficient", "flex"]
    assert attnlab_main(["bench", *argv]) == 0
    printed = capsys.readouterr().out
    assert "status counts" in printed and "total ~" in printed
    path = tmp_path / "cpu" / "quick.csv"
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert header == bench.COLUMNS
    meta = json.loads(path.with_suffix(".json").read_text())
    for key in ("gpu", "driver", "torch", "triton", "cupy", "cuda", "commit", "date_utc", "command", "backends",
                "options", "seconds", "run_id"):
        assert key in meta, key
    assert "--suite quick" in meta["command"]
    df = bench.load(tmp_path)
    ncases = len(bench.quick_suite("cpu"))
    assert len(df) == ncases * 6
    assert list(df.columns) == bench.COLUMNS
    assert set(df["status"]) <= set(bench.STATUSES)
    by = df.groupby("backend")["status"].agg(lambda s: set(s))
    assert by["torch"] == {"ok"} and by["sdpa"] == {"ok"} and by["sdpa-flash"] == {"ok"}
    assert by["cuda-tiled"] == {"unavailable"} and by["flex"] == {"unsupported"}
    assert by["sdpa-efficient"] == {"unsupported"}
    ok = df[df["status"] == "ok"]
    assert ok["passed"].all() and (ok["ms"] > 0).all() and (ok["tflops"] > 0).all() and (ok["host_us"] > 0).all()
    assert set(df["mode"]) == {"fwd"} and set(df["path"]) == {"public"}
    assert str(df["passed"].dtype) == "boolean" and df.loc[df["status"] == "unavailable", "passed"].isna().all()
    assert df["Nq"].dtype == "int64" and df["ms"].dtype == "float64"
    assert str(path) in df.attrs["meta"]
    # round trip of one file and of a list
    assert len(bench.load(path)) == len(df) == len(bench.load([path]))
    r = bench.ratios(df, baseline="sdpa-flash")
    assert r.loc["quick", "sdpa-flash"] == pytest.approx(1.0)
    assert r.loc["quick", "torch"] > 0 and "cuda-tiled" not in r.columns
    assert r.attrs["counts"].loc["quick", "torch"] == ncases
    # resume: nothing is re-run, the rows stay
    assert attnlab_main(["bench", *argv, "--resume"]) == 0
    assert len(bench.load(path)) == len(df)


def test_ratios_are_baseline_over_backend():
    import pandas as pd

    rows = []
    for case, base_ms, mine_ms in (("a", 1.0, 2.0), ("b", 1.0, 0.5), ("c", 3.0, 1.0)):
        rows += [{"suite": "s", "case": case, "backend": "base", "status": "ok", "ms": base_ms},
                 {"suite": "s", "case": case, "backend": "mine", "status": "ok", "ms": mine_ms}]
    rows.append({"suite": "s", "case": "d", "backend": "mine", "status": "failed", "ms": float("nan")})
    r = bench.ratios(pd.DataFrame(rows), baseline="base")
    assert r.loc["s", "mine"] == pytest.approx(2.0)  # median of 0.5, 2, 3
    assert r.attrs["counts"].loc["s", "mine"] == 3


def test_no_gpu_gives_a_clear_message(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert attnlab_main(["bench", "--suite", "quick"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_restart_argv_and_prediction():
    argv = ["--suite", "all", "--deadline-s", "540", "--exclude", "x", "--reps", "20", "--resume"]
    new = bench_cli._restart_argv(argv, "RID", 123.5, ["x", "cuda-naive"])
    assert new == ["--suite", "all", "--reps", "20", "--resume", "--run-id", "RID", "--deadline-at", "123.5",
                   "--exclude", "x", "cuda-naive"]
    big = bench.BenchCase("t", "big", B=1, Hq=16, Nq=4096, D=64)
    rows = [{"backend": "slow", "status": "ok", "dtype": "bfloat16", "ms": 100.0, "B": 1, "Hq": 16, "Nq": 1024,
             "Nk": 1024, "D": 64}]
    assert bench_cli._predicted_ms(rows, "slow", big) == pytest.approx(1600.0)
    rows.append(dict(rows[0], ms=800.0, Nq=2048, Nk=2048))  # the closest smaller case wins
    rows.append(dict(rows[0], ms=1.0, Nq=512, Nk=512))
    assert bench_cli._predicted_ms(rows, "slow", big) == pytest.approx(3200.0)
    assert bench_cli._predicted_ms(rows, "other", big) is None
    assert bench.gpu_slug("NVIDIA H200") == "nvidia-h200"


def test_lost_context_is_raised_not_recorded(monkeypatch):
    """An exception after which CUDA no longer works stops the case (main restarts without the culprit)."""
    monkeypatch.setattr(bench_runner, "context_ok", lambda device: False)

    def prepare(inp):
        def call(i):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return bench.Prepared(call=call)

    with pytest.raises(bench.ContextLost) as info:
        bench.run_case(CASE, [bench.Competitor("bad", "test", prepare)], _cpu_opts())
    assert info.value.backend == "bad" and info.value.case == "gate"


@pytest.mark.gpu
def test_gpu_timing_and_memory_columns():
    """On a GPU: CUDA-event timings, L2-sized input rotation and peak memory (textbook above fused)."""
    case = bench.BenchCase("t", "gpu", B=2, Hq=8, Nq=1024, D=64, dtype="bfloat16", causal=True)
    opts = bench.Options(device="cuda", max_reps=10, run_id="test", gpu=torch.cuda.get_device_name())
    rows = {r["backend"]: r for r in bench.run_case(case, bench.competitors(["torch", "sdpa-flash", "sdpa-math"]),
                                                    opts)}
    for r in rows.values():
        assert r["status"] == "ok", r["notes"]
        assert r["ms"] > 0 and r["peak_extra_mib"] >= 0 and r["sets"] >= 2
    assert rows["torch"]["peak_extra_mib"] > 10 * max(rows["sdpa-flash"]["peak_extra_mib"], 1.0)
    assert rows["sdpa-flash"]["ms"] < rows["torch"]["ms"]


# ---- graph_ms: the calls' time in CUDA-graph replay ------------------------------------------------------


def test_graph_column_is_the_median_replay_or_empty_with_a_note(monkeypatch):
    """``graph_ms`` is the median of the replays; a call that cannot be captured leaves it empty, says why,
    and the row keeps its event timings; a capture that broke the CUDA context raises like any failed call."""
    from attnlab.bench import replay

    monkeypatch.setattr(replay, "graph_times", lambda call, sets: [3.0, 1.0, 2.0, 9.0])
    notes: list[str] = []
    assert bench_runner.graph_column(lambda i: None, 2, torch.device("cuda"), notes) == 2.5 and notes == []

    def refuse(call, sets):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(replay, "graph_times", refuse)
    monkeypatch.setattr(bench_runner, "context_ok", lambda device: True)
    assert bench_runner.graph_column(lambda i: None, 2, torch.device("cuda"), notes) == ""
    assert notes == ["graph replay: RuntimeError: operation not permitted when stream is capturing"]
    monkeypatch.setattr(bench_runner, "context_ok", lambda device: False)
    with pytest.raises(RuntimeError, match="capturing"):
        bench_runner.graph_column(lambda i: None, 2, torch.device("cuda"), [])


def test_graph_suites_are_the_decode_ones_and_a_cpu_row_leaves_graph_ms_empty(monkeypatch):
    """Only the suites of short calls replay graphs; on a CPU no graph is captured and the column stays empty."""
    from attnlab.bench import replay

    assert {n for n, s in bench.SUITES.items() if s.graph} == {"decode", "scoremod-decode"}
    assert bench.COLUMNS[-1] == "graph_ms"

    def never(call, sets):
        raise AssertionError("no CUDA graph on a CPU")

    monkeypatch.setattr(replay, "graph_times", never)
    case = bench.suite_cases("decode", "cpu")[0]
    (row,) = bench.run_case(case, bench.competitors(["sdpa"]), _cpu_opts())
    assert row["status"] == "ok" and row["graph_ms"] == "" and row["suite"] == "decode", row["notes"]


@pytest.mark.gpu
def test_gpu_graph_ms_beside_the_event_timings():
    """On a GPU, in a graph suite: every competitor that captures gets ``graph_ms`` (at most its event-timed
    median plus noise: the host's launches are gone); one that synchronizes inside the call cannot be
    captured, gets an empty ``graph_ms`` and a note, and the competitors after it still run."""
    case = bench.BenchCase("decode", "graph", B=4, Hq=8, Hkv=2, Nq=1, Nk=4096, D=128, dtype="bfloat16")

    def syncing(inp):
        def call(i):
            out = torch.nn.functional.scaled_dot_product_attention(inp.qs[i], inp.ks[i].repeat_interleave(4, 1),
                                                                   inp.vs[i].repeat_interleave(4, 1))
            torch.cuda.synchronize()
            return out

        return bench.Prepared(call=call)

    opts = bench.Options(device="cuda", max_reps=10, run_id="test", gpu=torch.cuda.get_device_name())
    comps = [*bench.competitors(["triton-decode", "auto-paged16"]), bench.Competitor("syncing", "test", syncing),
             *bench.competitors(["sdpa-flash"])]
    rows = {r["backend"]: r for r in bench.run_case(case, comps, opts)}
    assert all(r["status"] == "ok" for r in rows.values()), {k: r["notes"] for k, r in rows.items()}
    for name in ("triton-decode", "auto-paged16", "sdpa-flash"):
        assert 0 < rows[name]["graph_ms"] <= 1.2 * rows[name]["ms"], rows[name]
    assert rows["syncing"]["graph_ms"] == "" and "graph replay:" in rows["syncing"]["notes"]


# ---- the public call, host time, the new suites ---------------------------------------------------------


def test_public_rows_validate_every_call_kernel_rows_once(monkeypatch):
    """attnlab rows time attnlab.attention (a new Problem per call); <backend>-kernel rows do not."""
    import attnlab.api

    made = {"n": 0}
    real = attnlab.api.make_problem

    def counting(*a, **k):
        made["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(attnlab.api, "make_problem", counting)
    per = {}
    for name in ("sdpa", "sdpa-kernel"):
        made["n"] = 0
        (row,) = bench.run_case(CASE, bench.competitors([name]), _cpu_opts())
        assert row["status"] == "ok", row["notes"]
        per[name] = (made["n"], row)
    (n_pub, pub), (n_ker, ker) = per["sdpa"], per["sdpa-kernel"]
    assert pub["path"] == "public" and ker["path"] == "kernel" and pub["mode"] == ker["mode"] == "fwd"
    assert n_pub - n_ker >= pub["reps"] + 2  # every timed call, the checked call and the memory call


def test_host_time_is_recorded_for_every_timed_row():
    def slow(inp):
        good = _right(inp)

        def call(i):
            time.sleep(0.003)
            return good(i)

        return bench.Prepared(call=call)

    comps = [bench.Competitor("slow", "test", slow), *bench.competitors(["sdpa", "auto"])]
    rows = {r["backend"]: r for r in bench.run_case(CASE, comps, _cpu_opts())}
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["slow"]["host_us"] >= 3000 and rows["sdpa"]["host_us"] > 0
    assert "auto picked sdpa" in rows["auto"]["notes"]


def test_new_suites_are_as_the_issues_ask():
    lat = bench.latency_suite()
    assert all(1 <= c.B <= 4 and 64 <= c.Nq <= 512 and c.D in (64, 128) and c.dtype == "bfloat16" for c in lat)
    kinds = {c.spec().kind for c in lat}
    assert {"dense", "causal", "kv_len", "causal+kv_len"} <= kinds
    ragged = [c for c in bench.padding_suite() if c.q_len is not None]
    assert len(ragged) == 2 and all(c.q_len == c.kv_len for c in ragged) and {c.causal for c in ragged} == {True, False}
    assert all(1024 <= x <= 4096 for x in ragged[0].q_len) and len(set(ragged[0].q_len)) > 1
    (alibi,) = bench.bias_suite()
    assert (alibi.B, alibi.Hq, alibi.Nq, alibi.D, alibi.causal) == (4, 16, 2048, 128, True)
    bw = bench.backward_suite()
    mha = [c for c in bw if c.Hkv is None]
    assert {(c.B, c.Nq, c.causal) for c in mha if c.kv_len is None} == {(4, 4096, False), (4, 4096, True),
                                                                        (1, 16384, False), (1, 16384, True)}
    assert all(c.backward and c.D == 128 and c.Hq == 16 for c in mha)
    # the Hopper issue's GQA 32/8 row: the causal B4 H16 N4096 row's twin (as many query heads, the same work)
    (gqa,) = [c for c in bw if c.Hkv is not None]
    assert (gqa.B * gqa.Hq, gqa.Hq, gqa.Hkv, gqa.Nq, gqa.D, gqa.causal, gqa.backward) == (64, 32, 8, 4096, 128, True,
                                                                                         True)
    assert [c.kv_len for c in bw if c.kv_len is not None] == [bench.padding_suite()[0].kv_len]
    assert bench.SUITES["latency"].backends and "sdpa-flash" in bench.SUITES["latency"].backends
    assert all(bench.SUITES[s].deadline_s for s in ("latency", "bias", "backward"))


def test_the_scoremod_suites_are_as_issue_31_asks():
    cases = {c.name: c for c in bench.scoremod_suite()}
    big = [c for c in cases.values() if c.Hq == 16]
    assert all((c.B, c.Nq, c.D, c.dtype, c.backward) == (4, 4096, 128, "bfloat16", True) for c in big)
    for mask in ("full", "causal"):
        for tag in ("softcap50", "alibi", "sinks", "plain"):
            assert f"bf16_b4_h16_n4096_d128_{mask}_{tag}" in cases
    assert cases["bf16_b4_h16_n4096_d128_causal_softcap50"].softcap == 50.0
    assert cases["bf16_b4_h16_n4096_d128_full_alibi"].alibi == "h"
    oss = [c for c in cases.values() if c.Hq == 64]
    assert {c.sinks for c in oss} == {True, False}
    assert all((c.hkv, c.D, c.window, c.backward) == (8, 64, (127, 0), True) for c in oss)
    assert bench.SUITES["scoremod"].backends == ("auto", "flex", "sdpa-cudnn")
    dec = bench.scoremod_decode_suite()
    assert all((c.B, c.Hq, c.hkv, c.nk, c.D) == (8, 32, 8, 32768, 128) for c in dec)
    assert {c.Nq for c in dec if c.append} == {1, 4} and all(c.Nq == c.append for c in dec if c.append)
    assert sum(c.sinks for c in dec) == 1 and sum(c.softcap is not None for c in dec) == 1
    plain4 = [c for c in dec if c.Nq == 4 and not c.append]  # the append call's twins over the same keys
    assert len(plain4) == 2 and all(c.align == "bottom_right" for c in plain4)
    assert {c.kv_len for c in dec if not c.append and c.Nq in (1, 4)} >= {None, (32768,) * 8}
    assert "auto-paged16" in bench.SUITES["scoremod-decode"].backends


def test_the_rivals_score_mods_follow_the_contract():
    """SDPA's materialized ALiBi bias and flex's score_mod give the reference's scores (FlashAttention's rule,
    Nq != Nk, causal folded in as -inf); the textbook baseline counts the sink."""
    from attnlab.bench.competitors import alibi_mask, flex_score_mod
    from attnlab.bench.truth import textbook
    from attnlab.problem import make_problem
    from attnlab.reference import masked_scores, reference

    case = bench.BenchCase("t", "m", B=2, Hq=3, Nq=5, Nk=9, D=8, dtype="float32", causal=True, align="top_left",
                           alibi="h", softcap=4.0, sinks=True)
    inp = bench.make_case_inputs(case, "cpu", seed=3, sets=1)
    kw = dict(inp.kw)
    plain = make_problem(inp.qs[0], inp.ks[0], inp.vs[0], causal=True, align="top_left")
    alibi = make_problem(inp.qs[0], inp.ks[0], inp.vs[0], alibi_slopes=kw["alibi_slopes"])
    bias = alibi_mask(alibi, None, True).double()
    want = masked_scores(alibi, 0, 5, torch.float64) - masked_scores(plain, 0, 5, torch.float64)
    assert torch.equal(torch.isinf(bias), torch.isinf(want))
    assert torch.allclose(bias[~torch.isinf(bias)], want[~torch.isinf(want)], atol=1e-6)
    mod = flex_score_mod(case, kw, None)
    s = masked_scores(make_problem(inp.qs[0], inp.ks[0], inp.vs[0]), 0, 5, torch.float64)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(3).view(1, 3, 1, 1)
    i, j = torch.arange(5).view(1, 1, 5, 1), torch.arange(9).view(1, 1, 1, 9)
    got = mod(s, b, h, i, j)
    full = make_problem(inp.qs[0], inp.ks[0], inp.vs[0], softcap=4.0, alibi_slopes=kw["alibi_slopes"])
    assert torch.allclose(got, masked_scores(full, 0, 5, torch.float64), atol=1e-5)
    ref, _ = reference(inp.qs[0], inp.ks[0], inp.vs[0], **kw)
    assert torch.allclose(textbook(inp.qs[0], inp.ks[0], inp.vs[0], kw), ref.float(), atol=1e-5)


@pytest.mark.parametrize("mods", [{"alibi": "h"}, {"sinks": True}])
def test_a_sliced_truth_slices_the_score_modifiers_with_the_heads(mods):
    from attnlab.reference import reference

    case = bench.BenchCase("t", "m", B=3, Hq=6, Hkv=2, Nq=6, D=8, dtype="float32", causal=True, **mods)
    inp = bench.make_case_inputs(case, "cpu", seed=4, sets=1)
    truth = bench.make_truth(inp, full_scores=1)
    assert truth.sl is not None and truth.sl[1] == [3, 4, 5]
    full, _ = reference(inp.qs[0], inp.ks[0], inp.vs[0], **inp.kw)
    assert torch.allclose(bench.take_slice(full, truth.sl), truth.ref, atol=1e-12)


def test_rivals_refuse_what_they_would_time_as_another_call():
    from attnlab.bench.competitors import Unsupported, competitors, flex_score_mod

    case = bench.BenchCase("t", "a", B=1, Hq=2, Nq=1, Nk=8, D=8, dtype="float32", append=1)
    inp = bench.make_case_inputs(case, "cpu", seed=0, sets=1)
    (kernel,) = competitors(["triton-kernel"])
    with pytest.raises(Unsupported, match="KV append"):
        kernel.prepare(inp)
    bh = bench.BenchCase("t", "b", B=2, Hq=2, Nq=4, D=8, dtype="float32", alibi="bh")
    with pytest.raises(Unsupported, match=r"\[B, Hq\]"):
        flex_score_mod(bh, bench.make_case_inputs(bh, "cpu", seed=0, sets=1).kw, None)


def test_an_append_case_writes_the_keys_its_cache_holds():
    """The append call's keywords: lengths Nk - n before, copies of the last n keys; the call then equals the
    plain attention over all Nk keys, and the cache is unchanged."""
    import attnlab
    from attnlab.bench.competitors import call_keywords

    case = bench.BenchCase("t", "a", B=2, Hq=4, Hkv=2, Nq=3, Nk=11, D=8, dtype="float32", causal=True,
                           align="bottom_right", append=3)
    inp = bench.make_case_inputs(case, "cpu", seed=2, sets=2)
    kws = call_keywords(inp)
    assert len(kws) == 2 and kws[1]["kv_len"].tolist() == [8, 8]
    assert torch.equal(kws[1]["k_new"], inp.ks[1][:, :, 8:]) and kws[1]["k_new"].data_ptr() != inp.ks[1].data_ptr()
    before = inp.ks[1].clone()
    got = attnlab.attention(inp.qs[1], inp.ks[1], inp.vs[1], backend="torch", **kws[1])
    want = attnlab.attention(inp.qs[1], inp.ks[1], inp.vs[1], backend="torch", **inp.kw)
    assert torch.equal(inp.ks[1], before) and torch.allclose(got, want, atol=1e-6)


def test_alibi_bias_and_sliced_truth():
    b = bench.alibi_bias(4, 5, 7, "float32", "cpu")
    slopes = [2.0 ** (-8 * (h + 1) / 4) for h in range(4)]
    assert b.shape == (1, 4, 5, 7) and b[0, 2, 4, 1].item() == pytest.approx(-slopes[2] * 3)
    case = bench.BenchCase("t", "alibi", B=2, Hq=4, Nq=9, D=8, dtype="float32", causal=True, bias="alibi")
    assert case.spec().kind == "causal+bias"
    inp = bench.make_case_inputs(case, "cpu", seed=1, sets=2)
    truth = bench.make_truth(inp, full_scores=1)  # sliced: the bias is sliced with the heads
    from attnlab.reference import reference

    full, _ = reference(inp.qs[0], inp.ks[0], inp.vs[0], **inp.kw)
    assert torch.allclose(bench.take_slice(full, truth.sl), truth.ref, atol=1e-12)


def _bwd_case():
    return bench.BenchCase("t", "bw", B=2, Hq=2, Nq=20, D=16, causal=True, kv_len=(20, 11), backward=True)


def test_the_one_pass_backward_competitor_runs_every_call_in_its_mode_and_restores_it(monkeypatch):
    """``triton-dq-atomic``: the public triton call whose backward adds dQ up in the dK/dV pass; its three rows
    pass the gradient check, the dQ pass never runs under it, and the shipped mode is back afterwards."""
    from attnlab.backends.triton import backward as triton_bwd
    from attnlab.backends.triton import bwd_launch

    def no_dq_pass(*a, **k):
        raise AssertionError("the dQ pass ran under triton-dq-atomic")

    monkeypatch.setattr(bwd_launch, "launch_dq", no_dq_pass)
    monkeypatch.setattr(triton_bwd, "DQ_MODE", "pass")
    rows = bench.run_case(_bwd_case(), bench.competitors(["triton-dq-atomic"]), _cpu_opts())
    assert [r["mode"] for r in rows] == ["fwd", "fwd+bwd", "bwd"]
    assert all(r["status"] == "ok" and r["passed"] for r in rows), [r["notes"] for r in rows]
    assert "dQ by atomics" in rows[2]["notes"] and triton_bwd.DQ_MODE == "pass"


def test_backward_gate_and_flops():
    """Wrong gradients with a right output: every mode failed and untimed; right ones: three timed rows."""
    from attnlab.api import attention

    def wrong_grad(inp):
        def call(i):
            o = attention(inp.qs[i], inp.ks[i], inp.vs[i], backend="sdpa", **inp.kw)
            return o.detach() + 1.1 * (o - o.detach())  # the same values, gradients 10% too large

        return bench.Prepared(call=call)

    comps = [bench.Competitor("wrong", "test", wrong_grad), *bench.competitors(["sdpa", "sdpa-kernel"])]
    rows = bench.run_case(_bwd_case(), comps, _cpu_opts())
    by = {(r["backend"], r["mode"]): r for r in rows}
    assert len(rows) == 9 and len({(r["case"], r["backend"]) for r in rows}) == 9
    for mode in ("fwd", "fwd+bwd", "bwd"):
        w = by[("wrong", mode)]
        assert w["status"] == "failed" and w["passed"] is False and w["ms"] == "" and "FAIL" in w["notes"]
        assert by[("sdpa", mode)]["status"] == "ok", by[("sdpa", mode)]["notes"]
        assert by[("sdpa-kernel", mode)]["status"] == "unsupported"
    fwd = by[("sdpa", "fwd")]["flops"]
    assert fwd == bench.useful_flops(_bwd_case())
    assert by[("sdpa", "fwd+bwd")]["flops"] == 3.5 * fwd and by[("sdpa", "bwd")]["flops"] == 2.5 * fwd
    assert by[("sdpa", "bwd")]["case"] == "bw_bwd" and by[("sdpa", "bwd")]["host_us"] > 0
    assert "grads: dq" in by[("sdpa", "bwd")]["notes"]


def test_latency_and_backward_smoke_on_cpu(tmp_path):
    base = ["--device", "cpu", "--no-progress", "--budget-ms", "5", "--out", str(tmp_path)]
    assert attnlab_main(["bench", "--suite", "latency", *base]) == 0
    df = bench.load(tmp_path / "cpu" / "latency.csv")
    assert set(df["backend"]) == set(bench.SUITES["latency"].backends)
    ok = df[df["status"] == "ok"]
    assert {"triton", "auto", "triton-kernel", "sdpa-flash"} <= set(ok["backend"])
    assert (ok["host_us"] > 0).all() and set(df["path"]) == {"public", "kernel"}
    assert attnlab_main(["bench", "--suite", "backward", *base, "--reps", "3", "--min-reps", "1"]) == 0
    df = bench.load(tmp_path / "cpu" / "backward.csv")
    assert len(df) == 3 * len(bench.backward_suite("cpu")) * len(bench.SUITES["backward"].backends)
    ok = df[df["status"] == "ok"]
    for b in ("triton", "sdpa-flash"):
        assert ok.groupby("backend")["mode"].agg(set)[b] == {"fwd", "fwd+bwd", "bwd"}
    assert (ok["tflops"] > 0).all() and ok["passed"].all()


def test_keep_others_and_estimate_without_gpu(tmp_path, capsys):
    argv = ["--suite", "quick", "--device", "cpu", "--out", str(tmp_path), "--no-progress", "--budget-ms", "5",
            "--cases", "kvlen"]
    assert attnlab_main(["bench", *argv, "--backends", "sdpa", "torch", "--run-id", "A"]) == 0
    assert attnlab_main(["bench", *argv, "--backends", "sdpa", "--run-id", "B", "--keep-others"]) == 0
    df = bench.load(tmp_path / "cpu" / "quick.csv")
    assert dict(zip(df["backend"], df["run_id"])) == {"sdpa": "B", "torch": "A"}
    env = json.loads((tmp_path / "cpu" / "quick.json").read_text())
    assert env["run_id"] == "B" and set(env["kept_runs"]) == {"A"}  # where the kept rows come from
    capsys.readouterr()
    assert attnlab_main(["bench", "--suite", "backward", "latency", "--estimate"]) == 0  # several suites, one process
    out = capsys.readouterr().out
    assert "backward 6 cases" in out and "latency 8 cases" in out and out.index("backward") < out.index("latency")


def test_backward_without_a_retained_graph_is_fwdbwd_minus_fwd():
    """A competitor whose graph cannot be backpropagated twice: bwd is the difference of the medians."""
    from attnlab.api import attention

    latest = {}

    class Once(torch.autograd.Function):
        """Backward only through the latest forward's graph (as if each forward freed the one before)."""

        @staticmethod
        def forward(ctx, x):
            latest["ctx"] = ctx
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            if latest["ctx"] is not ctx:
                raise RuntimeError("Trying to backward through the graph a second time")
            return g

    def once(inp):
        return bench.Prepared(call=lambda i: Once.apply(attention(inp.qs[i], inp.ks[i], inp.vs[i], backend="sdpa",
                                                                  **inp.kw)))

    rows = {r["mode"]: r for r in bench.run_case(_bwd_case(), [bench.Competitor("once", "test", once)], _cpu_opts())}
    assert all(r["status"] == "ok" for r in rows.values()), [r["notes"] for r in rows.values()]
    assert "bwd = fwd+bwd - fwd" in rows["bwd"]["notes"]
    assert rows["bwd"]["ms"] == pytest.approx(max(rows["fwd+bwd"]["ms"] - rows["fwd"]["ms"], 1e-6))


@pytest.mark.gpu
def test_gpu_host_time_and_backward_rows():
    """On a GPU: host time behind the queued sleep (SDPA never syncs), and the three backward rows checked."""
    opts = bench.Options(device="cuda", max_reps=5, run_id="test", gpu=torch.cuda.get_device_name())
    lat = bench.BenchCase("t", "lat", B=1, Hq=8, Nq=128, D=64, causal=True)
    rows = {r["backend"]: r for r in bench.run_case(lat, bench.competitors(["sdpa-flash", "triton", "triton-kernel"]),
                                                    opts)}
    assert all(r["status"] == "ok" and r["host_us"] > 0 for r in rows.values()), rows
    assert "outlasted" not in rows["sdpa-flash"]["notes"]  # the GPU still slept when its calls were all queued
    bw = bench.BenchCase("t", "bw", B=2, Hq=4, Nq=512, D=64, causal=True, kv_len=(512, 300), backward=True)
    rows = bench.run_case(bw, bench.competitors(["triton", "sdpa-efficient"]), opts)
    assert [r["mode"] for r in rows] == ["fwd", "fwd+bwd", "bwd"] * 2
    assert all(r["status"] == "ok" and r["peak_extra_mib"] >= 0 for r in rows), [r["notes"] for r in rows]


def test_kernel_notes_name_the_compiled_variant_only_where_a_backend_has_one():
    from attnlab.bench.competitors import kernel_notes

    class Labelled:
        def kernel_label(self, prob):
            return f"mma_bf16_d{prob}_fastexp_wide"

    assert kernel_notes(Labelled(), 64) == ["kernel mma_bf16_d64_fastexp_wide"]
    assert kernel_notes(object(), 64) == []


def test_interleaved_ms_warms_up_one_round_and_takes_the_upper_median():
    """Every label's call is asked for at its turn, run ``warmup`` times, then timed; the first round is dropped,
    the rest give the upper median; the rounds follow round_orders."""
    from attnlab.bench.timing import interleaved_ms, round_orders

    seen, ran, clock = [], {"a": 0, "b": 0}, iter(range(100))

    def call_of(label):
        seen.append(label)
        return lambda: ran.__setitem__(label, ran[label] + 1)

    got = interleaved_ms(["a", "b"], call_of, rounds=4, warmup=2, calls=7,
                         time_one=lambda fn, calls: (fn(), float(next(clock)), calls == 7)[1])
    assert seen == [x for order in round_orders(["a", "b"], 5) for x in order]
    assert ran == {"a": 5 * 3, "b": 5 * 3}  # 2 warm-up calls and the timed one, in 5 rounds
    times = {label: [float(i) for i, x in enumerate(seen) if x == label] for label in "ab"}
    assert got == {label: sorted(t[1:])[2] for label, t in times.items()}
