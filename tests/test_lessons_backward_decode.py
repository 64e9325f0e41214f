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


def test_bandwidth_table():
    df = pd.DataFrame({"case": ["c", "c", "c"], "backend": ["triton", "sdpa-cudnn", "flex"],
                       "status": ["ok", "ok", "unsupported"], "gbps": [1000.0, 2000.0, None]})
    t = dl.bandwidth_table(df)
    assert list(t.columns) == ["sdpa-cudnn", "triton"] or set(t.columns) == {"sdpa-cudnn", "triton"}
    assert dl.bandwidth_table(None) is None


def test_recorded_decode_experiments_load_as_frames(tmp_path):
    """Each recorded decode experiment is a CSV with its columns; an unknown name is a ValueError and a GPU
    folder without the file gives None."""
    columns = {"decode-deep-sweep": ["config", "variant", "S", "paged", "us", "ok"],
               "decode-merge-ab": ["config", "way", "graph_us", "gbps", "stream_us", "host_us"],
               "decode-pdl-ab": ["config", "way", "graph_us", "events_us", "equal"],
               "decode-graph": ["config", "variant", "us", "gbps"],
               "read-ceiling": ["config", "bytes", "reader", "us", "tbps", "ok"]}
    assert set(columns) == set(dl.EXPERIMENTS)
    for name, cols in columns.items():
        df = dl.experiment(name)
        assert list(df.columns) == cols and len(df) > 0, name
    assert dl.experiment("decode-graph", tmp_path / "some-gpu") is None
    with pytest.raises(ValueError, match="unknown decode experiment"):
        dl.experiment("decode-run2")


def _frame(columns: str, rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=columns.split())


def test_merge_ab_story():
    ab = _frame("config way graph_us gbps stream_us host_us", [
        ("B1 Hq32 Hkv8 Nk32k", "sdpa-cudnn", 37.7, 3560, 44.5, 45.3),
        ("B1 Hq32 Hkv8 Nk32k", "merge-in-split", 50.1, 2678, 51.7, 20.3),
        ("B1 Hq32 Hkv8 Nk32k", "merge-kernel", 39.5, 3397, 41.9, 35.6),
        ("B16 Hq32 Hkv8 Nk4k", "merge-in-split", 75.6, 3553, 76.4, 19.4),
        ("B16 Hq32 Hkv8 Nk4k", "merge-kernel", 69.4, 3871, 72.1, 25.5)])
    story = dl.merge_ab_story(ab)
    assert "saves 6-15 us of host time" in story and "costs 6.2-10.6 us of GPU time" in story
    assert "most at B1 Hq32 Hkv8 Nk32k (50.1 against 39.5 us)" in story and "+4.3 to +9.8 us" in story


def test_pdl_ab_story():
    rows = [("B16 Hq32 Hkv8 Nk4k", "cudnn", 64.0, 67.0, True), ("B16 Hq32 Hkv8 Nk4k", "pdl=0", 69.1, 74.4, True),
            ("B16 Hq32 Hkv8 Nk4k", "pdl=1", 68.9, 72.2, True), ("B1 Hq32 Hkv8 Nk32k", "cudnn", 38.1, 57.1, True),
            ("B1 Hq32 Hkv8 Nk32k", "pdl=0", 39.3, 52.0, True), ("B1 Hq32 Hkv8 Nk32k", "pdl=1", 38.6, 54.0, True)]
    story = dl.pdl_ab_story(_frame("config way graph_us events_us equal", rows))
    assert "GPU time of a call by -0.7 to -0.2 us" in story and "event-timed call by -2.2 to +2.0 us" in story
    assert "across the 2 configs" in story and "equal bit for bit" in story
    rows[0] = (*rows[0][:4], False)
    assert "NOT equal" in dl.pdl_ab_story(_frame("config way graph_us events_us equal", rows))


def _sweep() -> pd.DataFrame:
    nan = float("nan")
    return _frame("config variant S paged us ok", [
        ("B16 Hq32 Hkv8 Nk4k", "default", 4, 0, 67.5, True), ("B16 Hq32 Hkv8 Nk4k", "cudnn", nan, 0, 62.6, True),
        ("B16 Hq32 Hkv8 Nk4k", "128/4/3", 1, 0, 65.5, True), ("B16 Hq32 Hkv8 Nk4k", "128/4/3", 1, 16, 92.1, True),
        ("B16 Hq32 Hkv8 Nk4k", "128/4/3", 1, 64, 88.6, True), ("B16 Hq32 Hkv8 Nk4k", "128/4/3", 2, 0, 71.6, True),
        ("B16 Hq32 Hkv8 Nk4k", "64/4/4", 1, 0, 64.2, False),
        ("B8 Hq32 Hkv8 Nk32k ragged", "default", 6, 0, 200.9, True),
        ("B8 Hq32 Hkv8 Nk32k ragged", "cudnn", nan, 0, 245.9, True),
        ("B8 Hq32 Hkv8 Nk32k ragged", "128/4/3", 2, 0, 207.6, True),
        ("B8 Hq32 Hkv8 Nk32k ragged", "128/4/3", 4, 0, 201.4, True)])


def test_deep_sweep_table():
    table = dl.deep_sweep_table(_sweep())
    row = table.loc["B16 Hq32 Hkv8 Nk4k"]
    assert row["default S"] == 4 and row["128/4/3 S"] == 1 and row["128/4/3 us"] == 65.5  # fewest splits, dense
    assert row["128/4/3 / cudnn"] == pytest.approx(65.5 / 62.6)
    assert table.loc["B8 Hq32 Hkv8 Nk32k ragged", "128/4/3 us"] == 207.6
    assert pd.isna(table.loc["B8 Hq32 Hkv8 Nk32k ragged", "64/4/4 us"])


def test_deep_paged_ratio():
    ratio = dl.deep_paged_ratio(_sweep()[lambda d: d["config"] == "B16 Hq32 Hkv8 Nk4k"])
    assert ratio[("B16 Hq32 Hkv8 Nk4k", 16)] == pytest.approx(92.1 / 65.5)
    assert ratio[("B16 Hq32 Hkv8 Nk4k", 64)] == pytest.approx(88.6 / 65.5) and len(ratio) == 2


def test_ceiling_table():
    mib = 2**20
    reads = _frame("config bytes reader us tbps ok", [
        ("B1 Hq32 Hkv8 Nk32k", 128 * mib, "torch.sum", 128 * mib / 3.52e6, 3.52, True),
        ("B1 Hq32 Hkv8 Nk32k", 128 * mib, "stream 8192/8/3 P128", 46.5, 2.88, True),
        ("B1 Hq32 Hkv8 Nk32k", 128 * mib, "stream 4096/4/4 P528", 37.4, 3.59, True),
        ("B1 Hq32 Hkv8 Nk32k", 128 * mib, "stream 4096/4/4 P1056", 30.0, 4.47, False),
        ("B16 Hq32 Hkv8 Nk4k", 256 * mib, "stream 8192/8/3 P264", 67.8, 3.96, True)])
    graph = _frame("config variant us gbps", [("B1 Hq32 Hkv8 Nk32k", "sdpa-cudnn", 38.1, 3520.0),
                                               ("B1 Hq32 Hkv8 Nk32k", "auto", 38.4, 3494.0)])
    table = dl.ceiling_table(graph, reads)
    assert list(table.index) == ["B1 Hq32 Hkv8 Nk32k"]  # the other config has no graph time
    row = table.loc["B1 Hq32 Hkv8 Nk32k"]
    assert row["fastest read"] == "stream 4096/4/4 P528" and row["read us"] == 37.4  # the BAD read is not counted
    assert row["x read"] == pytest.approx(38.4 / 37.4) and row["K/V MiB"] == 128 and row["cudnn us"] == 38.1


