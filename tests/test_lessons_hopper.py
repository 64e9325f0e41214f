"""attnlab.lessons.hopper: the recorded Hopper routes and profile as the notebook reads them."""

from __future__ import annotations

import json

import pytest

from attnlab.lessons import hopper


def _run(path, rows):
    path.write_text(json.dumps({"environment": {}, "rows": rows}))
    return path


def test_routes_take_each_familys_best_ratio_within_its_own_run(tmp_path):
    a = _run(tmp_path / "a.json", [
        {"case": "c", "route": "sdpa-cudnn", "passed": True, "ms": 1.0, "tflops": 1},
        {"case": "c", "route": "triton", "passed": True, "ms": 2.0, "tflops": 1},
        {"case": "c", "route": "tma cfg=(1, 2, 3, 4) ws=False", "passed": True, "ms": 1.25, "tflops": 1},
        {"case": "c", "route": "tma cfg=(5, 6, 7, 8) ws=False", "passed": False, "ms": None, "tflops": None},
    ])
    b = _run(tmp_path / "b.json", [  # a slower run: cuDNN 2 ms; triton 2.5 ms is 0.8x, better than run a's 0.5x
        {"case": "c", "route": "sdpa-cudnn", "passed": True, "ms": 2.0, "tflops": 1},
        {"case": "c", "route": "triton", "passed": True, "ms": 2.5, "tflops": 1},
        {"case": "c", "route": "tma cfg=(1, 2, 3, 4) ws=True", "passed": False, "ms": None, "tflops": None},
    ])
    t = hopper.routes((a, b))
    assert t.loc[("c", hopper.FAMILIES["triton"]), "x cudnn"] == pytest.approx(0.8)
    tma = t.loc[("c", hopper.FAMILIES["tma ws=False"])]
    assert tma["x cudnn"] == pytest.approx(0.8) and tma["config"] == "(1, 2, 3, 4)" and tma["failed"] == 1
    assert ("c", hopper.FAMILIES["tma ws=True"]) not in t.index  # it never passed: no row, no time
    assert hopper.routes((a, tmp_path / "absent.json")) is None


def test_the_recorded_routes_and_profile_read_back():
    t = hopper.routes()
    assert t is not None and set(t.index.get_level_values("family")) == set(hopper.FAMILIES.values())
    assert t["x cudnn"].between(0.3, 1.5).all()
    assert t.xs(hopper.FAMILIES["tma ws=True"], level="family")["failed"].sum() > 0
    prof = hopper.profile()
    assert list(prof.columns) == ["attnlab (triton)", "cuDNN"]
    assert prof.loc["threads per block", "cuDNN"] == 384
    assert len(prof) == len(hopper.PROFILE_METRICS) + 1


def test_a_profile_of_both_masks_reads_tensor_pipe_and_stalls_per_kernel_and_mask(tmp_path):
    """The export ``tools/hopper_routes.py --profile`` makes: launches in the order ours, cuDNN (full), ours,
    cuDNN (causal); section metrics and the raw ones (tensor pipe, stall reasons) land in one column each."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    kernels = ["attn_fwd_hopper", "cudnn_generated_fort_native_sdpa_sm90_x"] * 2
    lines = [head]
    for i, kname in enumerate(kernels):
        block = "(384, 1, 1)"
        def row(section, metric, value, i=i, kname=kname, block=block):
            return f'"{i}","1","python3","h","{kname}","1","7","{block}","(32, 64, 1)","0","9.0","{section}",' \
                   f'"{metric}","x","{value}"'
        lines += [row("GPU Speed Of Light Throughput", "Duration", f"{1000 + i:,}"),
                  row("Occupancy", "Achieved Occupancy", "18.5"),
                  row("Command line profiler metrics",
                      "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", str(50 + i)),
                  row("Command line profiler metrics",
                      "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "0.25"),
                  row("Command line profiler metrics", "smsp__something_else", "3")]
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    prof = hopper.profile(path, masks=("full", "causal"))
    assert list(prof.columns) == ["attnlab (Gluon), full", "cuDNN, full", "attnlab (Gluon), causal",
                                  "cuDNN, causal"]
    assert prof.loc["duration (ns)"].tolist() == [1000, 1001, 1002, 1003]
    assert prof.loc["tensor pipe active, wgmma (%)", "cuDNN, causal"] == 53
    assert prof.loc["stall: long_scoreboard", "attnlab (Gluon), full"] == 0.25
    assert "smsp__something_else" not in prof.index and prof.loc["threads per block"].eq(384).all()


def test_the_gluon_kernels_first_run_reads_back(tmp_path):
    run = {"check": [{"case": "a", "passed": True}, {"case": "b", "passed": False}],
           "time": [{"case": "x", "ms": {"hopper": 1.0, "triton": 1.5, "sdpa-cudnn": 0.9}},
                    {"case": "w", "ms": {"hopper": 0.5, "triton": 0.6}}, {"case": "e", "error": "boom"}]}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(run))
    table, passed, total = hopper.gluon_kernel(path)
    assert (passed, total) == (1, 2)
    assert list(table.index) == ["x", "w"]
    assert table.loc["x", "Gluon x cuDNN"] == pytest.approx(0.9)
    assert table.loc["x", "Gluon x portable"] == pytest.approx(1.5)
    assert table.loc["w", "Gluon x cuDNN"] is None or table["Gluon x cuDNN"].isna()["w"]
    assert hopper.gluon_kernel(tmp_path / "absent.json") is None
    recorded = hopper.gluon_kernel()
    assert recorded is not None and recorded[1] == recorded[2] and len(recorded[0]) == 6


def test_the_backward_ab_reads_only_cases_whose_gradients_agreed(tmp_path):
    p = tmp_path / "bwd.json"
    ms = {"hopper-bwd": 1.0, "portable-bwd": 1.5, "sdpa-cudnn-bwd": 0.9}
    p.write_text(json.dumps({"environment": {}, "rows": [
        {"case": "ok", "passed": True, "err_vs_portable": [1e-3, 2e-3, 5e-4], "ms": ms},
        {"case": "bad", "passed": False, "err_vs_portable": [0.5, 0.1, 0.1]},
    ]}))
    t = hopper.backward_ab(p)
    assert list(t.index) == ["ok"]
    row = t.loc["ok"]
    assert row["Gluon x cuDNN"] == pytest.approx(0.9) and row["portable x cuDNN"] == pytest.approx(0.6)
    assert row["Gluon x portable"] == pytest.approx(1.5) and row["gap to portable grads"] == pytest.approx(2e-3)
    assert hopper.backward_ab(tmp_path / "absent.json") is None
    later = {"product": 1.0, "old": 1.2, "portable": 1.5, "sdpa-cudnn-bwd": 0.9}  # a later run's names
    p.write_text(json.dumps({"environment": {}, "rows": [
        {"case": "ok", "passed": True, "product_err_vs_portable": [1e-3, 3e-3, 5e-4], "ms": later}]}))
    row = hopper.backward_ab(p).loc["ok"]
    assert row["Gluon x cuDNN"] == pytest.approx(0.9) and row["earlier form x cuDNN"] == pytest.approx(0.75)
    assert row["Gluon x portable"] == pytest.approx(1.5) and row["gap to portable grads"] == pytest.approx(3e-3)


def test_the_recorded_backward_ab_reads_back():
    t = hopper.backward_ab()
    assert t is not None and len(t) == 8
    assert (t["Gluon x portable"] > 1).all() and t["Gluon x cuDNN"].between(0.5, 1.5).all()
    assert (t["Gluon x cuDNN"] > t["earlier form x cuDNN"]).all()
    first = hopper.backward_ab(hopper.BACKWARD_FILE.with_name("hopper-bwd-3517dae.json"))
    assert len(first) == 4 and "earlier form x cuDNN" not in first


def test_the_backward_profile_keeps_the_main_kernels_and_sums_each_sides_pass(tmp_path):
    """attnlab's launches first (preprocess, zeroing, the pass, conversion), then cuDNN's (dot_do_o, bprop,
    conversion): the table keeps the two passes; the totals add each side's small kernels."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    kernels = [("bwd_preprocess", 10), ("void at::vectorized_elementwise_kernel<4, x>", 20), ("attn_bwd_hopper", 100),
               ("void at::vectorized_elementwise_kernel<8, y>", 30), ("void cudnn::compute_dot_do_o<1>", 5),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_x", 90), ("void cudnn::convert_dq<1>", 7)]
    lines = [head] + [f'"{i}","1","p","h","{k}","1","7","(384, 1, 1)","(1, 1, 1)","0","9.0",'
                      f'"GPU Speed Of Light Throughput","Duration","ns","{ns:,}"' for i, (k, ns) in enumerate(kernels)]
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    table, total = hopper.backward_profile(path)
    assert list(table.columns) == ["attnlab (Gluon backward)", "cuDNN backward"]
    assert table.loc["duration (ns)"].tolist() == [100, 90]
    assert total.to_dict() == {"attnlab": 160, "cuDNN": 102}
    assert hopper.backward_profile(tmp_path / "absent.csv") is None


def test_the_recorded_gluon_profiles_read_back():
    table, total, env = hopper.gluon_profiles()
    assert len(table) == len(hopper.GLUON_PROFILE_ROWS) and table.notna().all().all()
    assert len(table.columns) == 6 and table.loc["threads per block"].eq(384).all()
    assert (total > table.loc["duration (us)"].iloc[-2:].to_numpy()).all()
    assert "--clock-control none" in env["command"]
