import pandas as pd

from attnlab.lessons import perf


def _rows():
    return pd.DataFrame({
        "case": ["a", "a", "b", "b", "c_fwd", "c_bwd"],
        "backend": ["triton", "sdpa-flash", "triton", "sdpa-flash", "triton", "triton"],
        "status": ["ok", "ok", "ok", "ok", "ok", "skipped"],
        "ms": [1.0, 1.444, 2.0, 2.03, 1.0, None], "tflops": [1.0, 1.0, 1.0, 1.0, 5.0, None],
        "mode": ["fwd", "fwd", "fwd", "fwd", "fwd", "bwd"], "path": [None] * 6,
    })


def test_ratios_from_unrounded_values():
    t = pd.DataFrame({"triton": [14.46], "base": [10.04]})
    r = perf.with_ratios(t, "base", ["triton"])
    assert r["triton / base"].iloc[0] == 1.44  # from the rounded 14.5 / 10.0 it would be 1.45
    assert r["triton"].iloc[0] == 14.5
    assert perf.ratio_range(_rows(), "triton", "sdpa-flash") == (1.015, 1.444)


def test_recorded_path_and_backward_table():
    df = _rows()
    assert perf.recorded_path(df).startswith("validate-once")
    assert perf.recorded_path(df.assign(path="public")) == "public"
    mixed = df.assign(path=["public"] + [""] * (len(df) - 1))
    assert perf.recorded_path(mixed) == "public, validate-once kernel path (older rows, no path)"
    bwd = perf.backward_table(df[df["case"].str.startswith("c")])
    assert bwd.loc[("c", "triton"), "fwd"] == 5.0 and bwd.loc[("c", "triton"), "bwd"] == "skipped"


def test_backward_bars_draw_what_was_timed_and_nothing_else():
    import matplotlib

    matplotlib.use("Agg")
    from attnlab.lessons import figures

    df = pd.DataFrame({"case": ["s_bwd", "s_bwd", "t_bwd", "t_bwd"], "backend": ["triton", "flex"] * 2,
                       "status": ["ok", "ok", "ok", "unsupported"], "tflops": [400.0, 380.0, 300.0, None],
                       "mode": ["bwd"] * 4})
    bwd = perf.backward_table(df)
    fig = figures.backward_bars(bwd, "bwd")
    bars = [p for p in fig.axes[0].patches]
    assert sorted(round(b.get_width()) for b in bars if b.get_width() > 0) == [300, 380, 400]
    assert figures.backward_bars(bwd, "fwd") is None  # a mode the suite did not time


def test_the_dense_grid_and_its_window_rows_apart():
    df = pd.DataFrame({"case": ["a", "a", "w", "w"], "backend": ["triton", "sdpa-cudnn", "triton", "flex"],
                       "window": [None, None, "1024:0", "1024:0"], "status": "ok", "ms": [1.0, 0.9, 0.3, 0.45]})
    grid, window = perf.dense_split(df)
    assert list(grid["case"].unique()) == ["a"] and list(window["case"].unique()) == ["w"]
    assert perf.speed_ratios(window, "triton", "flex")["w"] == 1.5
    old = df.drop(columns="window")  # a suite recorded before the window row
    grid, window = perf.dense_split(old)
    assert len(grid) == 4 and window.empty
    assert perf.dense_split(None) == (None, None)
