"""attnlab.plots: every figure builds without error on small synthetic inputs, and the benchmark figures
degrade to a message (and None) when no data is recorded."""

import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from attnlab import bench
from attnlab.bench import plots as bench_plots
from attnlab.lessons import figures, memory, online_softmax
from attnlab.masks import MaskSpec


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def synthetic_bench(suite: str = "dense") -> pd.DataFrame:
    """Rows in the documented schema (attnlab.bench): three backends, two N, causal and not, one failing row."""
    rows = []
    for backend, N, causal in itertools.product(["sdpa-flash", "sdpa-cudnn", "triton"], [1024, 4096], [False, True]):
        base = {"sdpa-flash": 300.0, "sdpa-cudnn": 450.0, "triton": 250.0}[backend]
        t = base * (0.6 if causal else 1.0) * (1.1 if N == 4096 else 1.0)
        rows.append({
            "backend": backend, "suite": suite, "case": f"N{N}{'_causal' if causal else ''}", "B": 4, "Hq": 16,
            "Hkv": 16, "Nq": N if suite != "decode" else 1, "Nk": N, "D": 128, "dtype": "bfloat16",
            "causal": causal, "mask": "causal" if causal else "dense", "ms": 1.0, "tflops": t, "flops": t * 1e9,
            "gbps": 2000.0 + N / 4, "peak_extra_mib": (64.0 if backend != "torch" else 4096.0),
            "max_abs_err": 1e-3, "passed": True, "status": "ok",
        })
    rows.append({**rows[0], "backend": "torch", "passed": False, "status": "failed", "ms": float("nan"),
                 "tflops": float("nan")})
    rows.append({**rows[1], "backend": "torch", "peak_extra_mib": 4200.0, "tflops": 50.0})
    return pd.DataFrame(rows)


def test_theme_and_mask_figures():
    spec = MaskSpec.build(2, 1, 24, 40, causal=True, align="bottom_right", kv_len=[40, 30])
    assert isinstance(figures.mask_heatmap(spec, title="causal br"), Figure)
    bias = torch.randn(8, 10)
    bias[2] = float("-inf")
    fig = figures.mask_grid({"spec": spec, "bool": torch.rand(8, 10) < 0.5, "bias": bias}, ncols=2)
    assert isinstance(fig, Figure)
    assert isinstance(figures.tile_map(spec, 8, 8), Figure)


def test_online_trace_and_memory_figures():
    s = torch.tensor([0.5, 2.0, -1.0, 3.0])
    v = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    assert isinstance(figures.online_trace(s, online_softmax.trace(s, v)), Figure)
    sweep = memory.sweep([512, 1024, 2048])
    assert isinstance(figures.memory_vs_n(sweep), Figure)
    assert isinstance(figures.traffic_vs_n(sweep), Figure)
    pts = [("unfused", 60.0, None), ("fused", 2000.0, 400.0)]
    fig = figures.roofline(pts, extra_peaks={"fp32": 51.0})
    assert fig.axes[0].get_xlabel().startswith("arithmetic intensity")


def test_precision_figures():
    df = pd.DataFrame({
        "dtype": ["float16"] * 4, "N": [64, 256, 64, 256], "D": [32, 32, 64, 64], "method": ["textbook torch"] * 4,
        "max_abs": [1e-3, 2e-3, 1e-3, 3e-3], "tolerance": [1e-2] * 4,
    })
    assert isinstance(figures.error_vs_n(df), Figure)
    rel = df.assign(max_rel=df["max_abs"] / 2, rel_tolerance=df["tolerance"] / 2)
    assert isinstance(figures.error_vs_n(rel, relative=True), Figure)
    ex = pd.DataFrame({"x": [-1.0, -10.0], "cpu_exp_ulp": [1.0, 1.0], "fast_exp_emulated_ulp": [3.0, 12.0]})
    assert isinstance(figures.exp_error(ex), Figure)


def test_bench_figures_from_files(tmp_path):
    d = tmp_path / "h200"
    d.mkdir()
    synthetic_bench("dense").to_csv(d / "dense.csv", index=False)
    synthetic_bench("decode").to_csv(d / "decode.csv", index=False)
    synthetic_bench("memory").to_csv(d / "memory.csv", index=False)
    (d / "dense.json").write_text('{"gpu": "synthetic"}')
    df = bench_plots.load_bench("dense", root=tmp_path)
    assert df is not None and set(bench_plots.BENCH_COLUMNS) <= set(df.columns)
    assert bench_plots.bench_environment("dense", root=tmp_path) == {"gpu": "synthetic"}
    assert isinstance(bench_plots.throughput_vs_n(df), Figure)
    r = bench.ratios(df, "sdpa-flash", "tflops", by="mask")
    assert r.loc["sdpa-cudnn", "dense"] == pytest.approx(1.5)
    assert r.loc["sdpa-flash", "causal"] == pytest.approx(1.0)
    assert isinstance(bench_plots.ratio_bars(df), Figure)
    assert isinstance(bench_plots.bench_roofline(df), Figure)
    assert bench_plots.summary(df).shape[1] == 4
    assert isinstance(bench_plots.decode_bandwidth(bench_plots.load_bench("decode", root=tmp_path)), Figure)
    assert isinstance(bench_plots.memory_measured(bench_plots.load_bench("memory", root=tmp_path)), Figure)


def test_bench_figures_without_data(tmp_path, capsys):
    assert bench_plots.load_bench("dense", root=tmp_path) is None
    assert "No recorded benchmark data for suite 'dense'" in capsys.readouterr().out
    for fn in (bench_plots.throughput_vs_n, bench_plots.ratio_bars, bench_plots.memory_measured,
               bench_plots.decode_bandwidth,
               bench_plots.bench_roofline):
        assert fn(None) is None
        assert "no recorded benchmark data" in capsys.readouterr().out
    assert bench.ratios(None, "sdpa-flash", by="mask") is None
    assert bench_plots.summary(None) is None


def test_kernel_notes_and_thread_maps():
    from attnlab.lessons import kernel_notes as kn

    assert kn.naive_map(D=64).shape == (8, 64) and kn.naive_map().max() == 127
    assert kn.tiled_map(64)[1, 9] == 8 + 1  # row 1, dim 9: thread g = 1 of row 1
    assert kn.rowmax_score_map(64).max() == 255 and kn.rowmax_score_map(128).shape == (64, 32)
    assert kn.rowmax_out_map(128)[0, 64] == 0  # dims 64.. wrap to the same threads (kk = 1)
    for f in kn.FAMILIES:
        assert "thread" in kn.header(f).lower() or "Thread" in kn.header(f)
    text = "a\n    b\n#pragma x\n        c\n    d\n"
    assert kn.excerpt_text(text, "b", "c") == "b\n#pragma x\n    c"
    with pytest.raises(ValueError, match="not found"):
        kn.excerpt_text(text, "zzz")
    with pytest.raises(ValueError, match="'zzz' not found after 'b'"):  # a lost end anchor fails too
        kn.excerpt_text(text, "b", "zzz")
    with pytest.raises(TypeError):  # no quiet mode: a notebook cannot print a note instead of the code
        kn.excerpt("naive", "Pass 1", strict=False)
    assert isinstance(figures.thread_map(kn.rowmax_score_map(64), title="rowmax"), Figure)


def test_committed_csvs_load_with_the_new_columns():
    """Every recorded CSV (written before path/mode/host_us existed, or after) loads with the full schema, and
    the figures still build from it."""
    root = bench_plots.DATA_ROOT / "nvidia-h200"
    stems = {p.stem for p in root.glob("*.csv")}
    suites = sorted(stems & set(bench.SUITES))
    own_schema = {"first_call", "first_call_rivals", "first_call_rivals_decode", "varlen"}
    assert stems - set(suites) <= own_schema  # records of their own schema
    assert {"dense", "padding", "decode", "memory"} <= set(suites)
    for suite in suites:
        df = bench_plots.load_bench(suite, gpu="nvidia-h200")
        assert df is not None and len(df) > 0, suite
        assert list(df.columns) == bench.COLUMNS, suite
        assert df["host_us"].dtype == "float64" and set(df["status"]) <= set(bench.STATUSES)
        assert df["mode"].isin(["", "fwd", "fwd+bwd", "bwd"]).all() and df["path"].isin(["", "public", "kernel"]).all()
    assert isinstance(bench_plots.throughput_vs_n(bench_plots.load_bench("dense", gpu="nvidia-h200")), Figure)
    assert isinstance(bench_plots.memory_measured(bench_plots.load_bench("memory", gpu="nvidia-h200")), Figure)



def test_roofline_helpers_take_the_measured_roofs():
    roofs = {"bf16_tflops": 772.4, "fp32_fma_tflops": 50.5, "read_tbps": 4.22, "copy_tbps": 4.19}
    fig = bench_plots.bench_roofline(synthetic_bench("dense"), peak_tflops=roofs["bf16_tflops"],
                                     tbps=roofs["read_tbps"],
                                     extra_peaks={"FP32 FMA (CUDA cores)": roofs["fp32_fma_tflops"]})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("772.4 TFLOP/s, 4.22 TB/s" in t for t in labels) and any("FP32 FMA" in t for t in labels)
    fig = bench_plots.decode_bandwidth(synthetic_bench("decode"), copy_tbps=roofs["copy_tbps"],
                                       read_tbps=roofs["read_tbps"])
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("read-only stream 4.22 TB/s" in t for t in labels) and any("copy 4.19" in t for t in labels)
    plt.close("all")
