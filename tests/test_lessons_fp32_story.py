import re

import pandas as pd
import pytest

from attnlab.bench import plots as bench_plots
from attnlab.lessons import fp32_story, kernel_notes
from attnlab.paths import data_file


def _suite() -> pd.DataFrame:
    rows = []
    for case, scale in (("fp32_b1_h8_n1024_d64_causal", 1.0), ("fp32_b8_h16_n2048_d64_causal", 20.0)):
        for b, ms in (("torch", 0.6), ("cuda-naive", 2.4), ("cuda-tiled", 0.3), ("cuda-rowmax", 0.1),
                      ("sdpa-efficient", 0.12), ("triton", 0.09)):
            rows.append({"case": case, "backend": b, "status": "ok", "ms": ms * scale, "tflops": 1 / (ms * scale),
                         "notes": ""})
        rows.append({"case": case, "backend": "sdpa-flash", "status": "unsupported", "ms": None, "tflops": None,
                     "notes": "no fp32 (Triggered internally)"})
    return pd.DataFrame(rows)


def test_blog_table_ratios_come_from_the_suite():
    t = fp32_story.blog_vs_gpu(_suite())
    assert t["public call (x rowmax)"].tolist() == pytest.approx([6.0, 24.0, 3.0, 1.0])
    assert t["blog (x rowmax)"].tolist() == [4.0, 3.2, 1.4, 1.0]
    story = fp32_story.order_story(t)
    assert story["blog"] == ["cuda-rowmax", "cuda-tiled", "cuda-naive", "torch"]
    assert story["recorded"] == ["cuda-rowmax", "cuda-tiled", "torch", "cuda-naive"] and not story["same"]
    assert story["naive slower than PyTorch (recorded)"] and not story["naive slower than PyTorch (blog)"]
    assert story["column"] == "public call (x rowmax)"


def test_the_order_is_read_from_gpu_time_alone_where_it_is_recorded():
    alone = pd.Series({"torch": 3.3, "cuda-naive": 32.1, "cuda-tiled": 3.6, "cuda-rowmax": 1.0})
    t = fp32_story.blog_vs_gpu(_suite(), gpu_alone=alone)
    assert t["GPU alone (x rowmax)"].tolist() == [3.3, 32.1, 3.6, 1.0]
    story = fp32_story.order_story(t)
    assert story["column"] == "GPU alone (x rowmax)"
    assert story["recorded"] == ["cuda-rowmax", "torch", "cuda-tiled", "cuda-naive"]  # not the public call's
    import matplotlib

    matplotlib.use("Agg")
    from attnlab.lessons import figures

    fig = figures.blog_vs_gpu(t, gpu="H200")
    assert len(fig.axes[0].patches) == 3 * 4  # blog, GPU alone, public call per implementation


def test_blog_table_says_which_rows_waited_for_the_host():
    suite = _suite().assign(host_us=lambda d: d["ms"] * 1e3 * 0.9, peak_extra_mib=2.0)
    suite.loc[suite["backend"] == "cuda-naive", "host_us"] = 1.0
    t = fp32_story.blog_vs_gpu(suite).set_index("attnlab backend")
    assert t.loc["cuda-rowmax", "host-bound"] and not t.loc["cuda-naive", "host-bound"]
    assert t["peak extra MiB"].tolist() == [2.0] * 4
    assert fp32_story.blog_vs_gpu(_suite())["host us"].isna().all()  # not recorded: not guessed
    partial = fp32_story.blog_vs_gpu(_suite()[lambda d: d["backend"] != "cuda-naive"])
    with pytest.raises(ValueError, match="cuda-naive"):  # no order from a missing row
        fp32_story.order_story(partial)


def test_fair_fp32_is_relative_to_sdpa_efficient_and_names_the_unsupported():
    t = fp32_story.fair_fp32(_suite())
    assert t["x sdpa-efficient"].loc["cuda-rowmax"].tolist() == pytest.approx([1.2, 1.2])
    assert t.attrs["unsupported"] == {"sdpa-flash": "no fp32"}


def test_ladder_csv_matches_the_note():
    lad = fp32_story.ladder()
    note = data_file("notes", "rowmax_ladder.md").read_text()
    numbers = set(re.findall(r"\d+\.\d+", note))
    for v in pd.concat([lad["before_ms"], lad["after_ms"]]).dropna():
        assert f"{v:g}" in numbers or f"{v:.2f}" in numbers or f"{v:.3f}" in numbers, v
    assert (lad.dropna(subset=["after_ms"])["speedup"] > 0.9).all()


def test_tiled_rowmax_split_multiplies_back():
    s = fp32_story.tiled_rowmax_split(_suite(), fp32_story.ladder())
    assert s["gap"] == pytest.approx(3.0)
    assert s["ladder"] * s["rest"] == pytest.approx(s["gap"])


def test_work_model():
    t, r = fp32_story.work_per_score("tiled"), fp32_story.work_per_score("rowmax")
    assert t["FMA (QK^T + PV)"] == r["FMA (QK^T + PV)"] == 128
    assert t["exp"] == 16 and r["exp"] == 1.25
    with pytest.raises(ValueError):
        fp32_story.work_per_score("flash")


def test_recorded_suite_loads():
    df = bench_plots.load_bench("fp32", quiet=True)
    if df is None:
        pytest.skip("no recorded fp32 suite")
    assert fp32_story.blog_vs_gpu(df)["public call (x rowmax)"].notna().all()


def test_blocks_per_sm_and_nvcc_commands():
    occ = kernel_notes.blocks_per_sm(256, 128, 104448)
    assert occ["resident"] == 2 and occ["registers"] == 2
    assert kernel_notes.blocks_per_sm(1024, 64, 0)["threads"] == 2
    cmd = kernel_notes.nvcc_commands("tiled")[0]
    assert cmd[0] == "nvcc" and "-cubin" in cmd and cmd[cmd.index("-cubin") + 1].endswith("attn_tiled.cu")
