"""The helpers of notebooks 09 (backward, training) and 10 (decode), on small CPU problems."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

import attnlab
from attnlab.lessons import decoding as dl
from attnlab.lessons import gradients as bw
from attnlab.lessons import memory
from attnlab.lessons import training as tr

ROOT = Path(__file__).resolve().parents[1]


def test_manual_backward_matches_autograd_with_a_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 1, n, 4, generator=g, dtype=torch.float64) for n in (5, 7, 7, 5))
    allowed = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)
    allowed[1] = False  # an empty row
    f = bw.manual_backward(q, k, v, dout, allowed=allowed)
    want = bw.autograd_grads(lambda *t: attnlab.reference(*t, mask=allowed), (q, k, v), dout)
    for name, w in zip(("dq", "dk", "dv"), want):
        torch.testing.assert_close(f[name], w, atol=1e-12, rtol=0)
    torch.testing.assert_close(f["delta"], f["delta_p"], atol=1e-12, rtol=0)
    assert (f["dq"][:, :, 1] == 0).all()


def test_grad_check_passes_on_the_pytorch_backends():
    df = bw.grad_check(["torch", "sdpa"], Nq=9, Nk=13, causal=True, align="bottom_right", kv_len=[13, 5])
    assert len(df) == 6 and df["passed"].all()


def test_mask_gradients_are_zero_where_masked_and_never_nan():
    s = bw.mask_gradient_summary(bw.mask_gradients(seed=0))
    ours = s.loc["attnlab"]
    assert ours["dq of empty rows all zero"] and ours["dk, dv of unseen keys all zero"]
    assert not ours["NaN in dq, dk, dv"]
    assert s.loc["textbook masked_fill", "NaN in dq, dk, dv"]


def test_saved_bytes():
    assert bw.saved_bytes(1, 16, 4096, 128, "bfloat16", fused=False) == 16 * 4096 * 4096 * 2
    assert bw.saved_bytes(1, 16, 4096, 128, "bfloat16", fused=True) == 16 * 4096 * 4
    t = bw.memory_table([1024, 2048])
    assert list(t["ratio"]) == [512, 1024]  # bf16 P against a float32 lse: N / 2


def test_backward_summary_is_defensive():
    assert bw.backward_summary(None) is None
    df = pd.DataFrame({"backend": ["triton", "sdpa-flash", "triton"], "case": ["a", "a", "a"],
                       "mode": ["bwd", "bwd", "fwd+bwd"], "tflops": [300.0, 290.0, 280.0],
                       "status": ["ok", "ok", "ok"]})
    t = bw.backward_summary(df)
    assert t.loc[("bwd", "a"), "triton"] == 300.0 and t.loc[("fwd+bwd", "a"), "triton"] == 280.0
    fig = bw.plot_backward(t)
    assert fig is not None


def test_copy_batch_repeats_the_first_half():
    x, y = tr.copy_batch(4, 16, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert (y[:, :8] == -100).all()
    assert torch.equal(y[:, 8:], x[:, 1:9])  # the next token of the second half is the token 7 places back


def test_training_through_attnlab_follows_sdpa():
    cfg = tr.TrainConfig(steps=15, batch=4, seq=16, d_model=16, heads=2)
    a = tr.train(tr.attnlab_attn("torch"), cfg)
    b = tr.train(tr.sdpa_attn, cfg)
    assert len(a) == 15 and a["loss"].notna().all()
    assert (a["loss"] - b["loss"]).abs().max() < 1e-4
    cmp = tr.compare_runs({"a": a, "b": b}, window=5)
    assert list(cmp["run"]) == ["a", "b"]


def test_decode_tables_of_the_suite():
    configs = dl.suite_configs()
    assert len(configs) >= 1
    roof = dl.decode_roofline(configs)
    ridge = memory.ridge_point(memory.RECORDED_GPU["bf16_tflops"], memory.RECORDED_GPU["copy_tbps"])
    assert (roof["FLOP/byte"] < ridge).all()
    occ = dl.occupancy(configs, sms=132)
    assert (occ["splits"] >= 1).all()
    assert (occ["packed + split"] == occ["packed, no split"] * occ["splits"]).all()
    kvb = dl.kv_bytes(configs)
    assert (kvb["per query head"] == kvb["per kv head (packed)"] * kvb["ratio"]).all()


def test_packed_rows():
    p = dl.packed_rows(Hq=8, Hkv=2, Nq=2)
    assert len(p) == 16 and p["live"].sum() == 8
    live = p[p["live"]]
    assert list(live["query head"]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(live["query row i"]) == [0, 1] * 4


def test_split_merges_equal_one_pass():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 50, 8, generator=g, dtype=torch.float64) for _ in range(2))
    want, want_lse = attnlab.reference(q, k, v)
    out, lse = dl.split_reference(q, k, v, 4)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)


def test_decode_splits_and_paged_example():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    ref, _ = attnlab.reference(q, k, v, kv_len=[23])
    for out, _lse in dl.decode_splits(q, k, v, (1, 3), kv_len=[23]).values():
        assert attnlab.check.compare(out, ref).passed
    ex = dl.paged_example(seed=0, block_size=16, kv_len=(40, 20), num_blocks=6)
    a, _ = attnlab.reference(ex["q"], ex["k_cache"], ex["v_cache"], block_table=ex["block_table"], kv_len=ex["kv_len"])
    b, _ = attnlab.reference(ex["q"], ex["k"], ex["v"], kv_len=ex["kv_len"])
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert dl.plot_block_table(ex) is not None


def test_parse_decode_log(tmp_path):
    assert dl.parse_decode_log(tmp_path / "missing.txt") is None
    log = tmp_path / "log.txt"
    log.write_text("-- B1 Hq32 Hkv8 Nk32768: 134 MB of K/V\n"
                   "   triton-decode                       52.6 us     2554 GB/s  splits=32\n"
                   "     (split kernel alone)              47.9 us     2804 GB/s\n"
                   "   triton-decode paged16              107.9 us     1244 GB/s\n")
    df = dl.parse_decode_log(log)
    assert list(df["variant"]) == ["triton-decode", "triton-decode paged16"]
    assert list(df["gbps"]) == [2554.0, 1244.0]


def test_bandwidth_table():
    df = pd.DataFrame({"case": ["c", "c", "c"], "backend": ["triton", "sdpa-cudnn", "flex"],
                       "status": ["ok", "ok", "unsupported"], "gbps": [1000.0, 2000.0, None]})
    t = dl.bandwidth_table(df)
    assert list(t.columns) == ["sdpa-cudnn", "triton"] or set(t.columns) == {"sdpa-cudnn", "triton"}
    assert dl.bandwidth_table(None) is None


def test_parse_graph_profile(tmp_path):
    assert dl.parse_graph_profile(tmp_path / "missing.txt") is None
    log = tmp_path / "profile.txt"
    log.write_text("# header\nB1 Hkv8 Nk32768 sdpa-cudnn             37.0 us      4 GB/s\n"
                   "B1 Hkv8 Nk32768 attnlab paged16      52.8 us      3 GB/s\n"
                   "B1 Hkv8 Nk32768 sweep bn64 w4 st2 (default S=32): S4:188.7\n")
    df = dl.parse_graph_profile(log)
    assert list(df["variant"]) == ["sdpa-cudnn", "paged16"]
    assert df["gbps"].iloc[0] == pytest.approx(2 * 8 * 32768 * 128 * 2 / 37e-6 / 1e9)


def test_parse_merge_ab_and_its_story(tmp_path):
    assert dl.parse_merge_ab(tmp_path / "missing.txt") is None
    log = tmp_path / "ab.txt"
    log.write_text("# config | way | graph us | GB/s | stream us | host us | splits | regs | checked\n"
                   "B1 Hkv8 Nk32768 | sdpa-cudnn | 37.7 | 3560 | 44.5 | 45.3 |  | ok\n"
                   "B1 Hkv8 Nk32768 | merge-in-split | 50.1 | 2678 | 51.7 | 20.3 | 64 | 96 | ok\n"
                   "B1 Hkv8 Nk32768 | merge-kernel | 39.5 | 3397 | 41.9 | 35.6 | 64 | 96 | ok\n"
                   "B16 Hkv8 Nk4096 | merge-in-split | 75.6 | 3553 | 76.4 | 19.4 | 4 | 96 | ok\n"
                   "B16 Hkv8 Nk4096 | merge-kernel | 69.4 | 3871 | 72.1 | 25.5 | 4 | 96 | ok\n"
                   "B16 Hkv8 Nk4096 | sdpa-flash | failed: no kernel\n")
    ab = dl.parse_merge_ab(log)
    assert list(ab["way"]) == ["sdpa-cudnn", "merge-in-split", "merge-kernel", "merge-in-split", "merge-kernel"]
    assert ab["config"].iloc[0] == "B1 Hq32 Hkv8 Nk32k" and ab["host_us"].iloc[1] == 20.3
    story = dl.merge_ab_story(ab)
    assert "saves 6-15 us of host time" in story and "costs 6.2-10.6 us of GPU time" in story
    assert "most at B1 Hq32 Hkv8 Nk32k (50.1 against 39.5 us)" in story and "+4.3 to +9.8 us" in story


def test_parse_pdl_ab_and_its_story(tmp_path):
    assert dl.parse_pdl_ab(tmp_path / "missing.txt") is None
    log = tmp_path / "pdl.txt"
    log.write_text("# NVIDIA H200 torch 2.11.0+cu130\n"
                   "B16 Hkv8 Nk4096: cudnn graph   64.0 events   67.0 ( 4005 GB/s) | pdl=0 graph   69.1 events   74.4 "
                   "( 3610 GB/s) | pdl=1 graph   68.9 events   72.2 ( 3718 GB/s) | bitwise equal True\n"
                   "B8 Hkv8 Nk8192 paged16 pdl=1: graph   74.4 events   77.1 | equal to dense True\n"
                   "B1 Hkv8 Nk32768: cudnn graph   38.1 events   57.1 ( 2349 GB/s) | pdl=0 graph   39.3 events   52.0 "
                   "( 2580 GB/s) | pdl=1 graph   38.6 events   54.0 ( 2488 GB/s) | bitwise equal True\n")
    ab = dl.parse_pdl_ab(log)
    assert list(ab["way"]) == ["cudnn", "pdl=0", "pdl=1"] * 2  # the paged line is not an A/B row
    assert ab["config"].iloc[3] == "B1 Hq32 Hkv8 Nk32k" and ab["events_us"].iloc[5] == 54.0
    story = dl.pdl_ab_story(ab)
    assert "GPU time of a call by -0.7 to -0.2 us" in story and "event-timed call by -2.2 to +2.0 us" in story
    assert "across the 2 configs" in story and "equal bit for bit" in story
    log.write_text(log.read_text().replace("bitwise equal True\nB8", "bitwise equal False\nB8", 1))
    assert "NOT equal" in dl.pdl_ab_story(dl.parse_pdl_ab(log))


def test_parse_deep_sweep_and_its_table(tmp_path):
    assert dl.parse_deep_sweep(tmp_path / "missing.txt") is None
    log = tmp_path / "deep.txt"
    log.write_text("# a header line\n"
                   "bf16_b16_hq32_hkv8_nk4096_d128       default S=4 67.5 | cudnn 62.6 | 128/4/3 S1 65.5 | "
                   "128/4/3 S1 p16 92.1 | 128/4/3 S2 71.6 | 64/4/4 S1 64.2 BAD\n"
                   "bf16_b8_hq32_hkv8_nk32768_d128_kvlen default S=6 200.9 | cudnn 245.9 | 128/4/3 S2 207.6 | "
                   "128/4/3 S4 201.4 | 64/4/4 S2 KeyError: x\n")
    sweep = dl.parse_deep_sweep(log)
    assert len(sweep) == 10  # the failed cell is skipped
    first = sweep[sweep["config"] == "B16 Hq32 Hkv8 Nk4k"]
    assert list(first["variant"]) == ["default", "cudnn", "128/4/3", "128/4/3", "128/4/3", "64/4/4"]
    assert list(first["paged"]) == [0, 0, 0, 16, 0, 0] and list(first["ok"]) == [True] * 5 + [False]
    assert set(sweep["config"]) == {"B16 Hq32 Hkv8 Nk4k", "B8 Hq32 Hkv8 Nk32k ragged"}
    table = dl.deep_sweep_table(sweep)
    row = table.loc["B16 Hq32 Hkv8 Nk4k"]
    assert row["default S"] == 4 and row["128/4/3 S"] == 1 and row["128/4/3 us"] == 65.5  # fewest splits, dense
    assert row["128/4/3 / cudnn"] == pytest.approx(65.5 / 62.6)
    assert table.loc["B8 Hq32 Hkv8 Nk32k ragged", "128/4/3 us"] == 207.6
    assert pd.isna(table.loc["B8 Hq32 Hkv8 Nk32k ragged", "64/4/4 us"])


def test_deep_paged_ratio(tmp_path):
    log = tmp_path / "deep.txt"
    log.write_text("bf16_b16_hq32_hkv8_nk4096_d128       default S=4 67.5 | cudnn 62.6 | 128/4/3 S1 65.5 | "
                   "128/4/3 S1 p16 92.1 | 128/4/3 S1 p64 88.6 | 128/4/3 S2 71.6\n")
    ratio = dl.deep_paged_ratio(dl.parse_deep_sweep(log))
    assert ratio[("B16 Hq32 Hkv8 Nk4k", 16)] == pytest.approx(92.1 / 65.5)
    assert ratio[("B16 Hq32 Hkv8 Nk4k", 64)] == pytest.approx(88.6 / 65.5) and len(ratio) == 2


def test_parse_read_ceiling_and_its_table(tmp_path):
    assert dl.parse_read_ceiling(tmp_path / "missing.txt") is None
    log = tmp_path / "ceiling.txt"
    log.write_text("# header\n# NVIDIA H200\n"
                   "B1 Hkv8 Nk32k (128 MiB), TB/s: torch.sum 3.52\n"
                   "    8192/8/3 P128 46.5us 2.88\n"
                   "    4096/4/4 P528 37.4us 3.59\n"
                   "    4096/4/4 P1056 30.0us 4.47 BAD\n"
                   "B16 Hkv8 Nk4k (256 MiB), TB/s: torch.sum 3.85\n"
                   "    8192/8/3 P264 67.8us 3.96\n")
    reads = dl.parse_read_ceiling(log)
    assert len(reads) == 6 and list(reads["ok"]) == [True, True, True, False, True, True]
    assert reads["us"].iloc[0] == pytest.approx(128 * 2**20 / 3.52e6)
    assert set(reads["config"]) == {"B1 Hq32 Hkv8 Nk32k", "B16 Hq32 Hkv8 Nk4k"}
    graph = tmp_path / "graph.txt"
    graph.write_text("B1 Hkv8 Nk32768 sdpa-cudnn             38.1 us   3520 GB/s\n"
                     "B1 Hkv8 Nk32768 attnlab auto          38.4 us   3494 GB/s\n")
    table = dl.ceiling_table(dl.parse_graph_profile(graph), reads)
    assert list(table.index) == ["B1 Hq32 Hkv8 Nk32k"]  # the other config has no graph time
    row = table.loc["B1 Hq32 Hkv8 Nk32k"]
    assert row["fastest read"] == "stream 4096/4/4 P528" and row["read us"] == 37.4  # the BAD read is not counted
    assert row["x read"] == pytest.approx(38.4 / 37.4) and row["K/V MiB"] == 128 and row["cudnn us"] == 38.1
