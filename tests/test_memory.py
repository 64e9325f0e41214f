"""attnlab.memory against hand computations."""

import pandas as pd
import pytest
import torch

from attnlab.lessons import memory


def test_score_matrix_bytes():
    # B8 H32 N4096 float32: 8 * 32 * 4096^2 * 4 bytes = 2^3 * 2^5 * 2^24 * 2^2 = 2^34 = 16 GiB
    assert memory.score_bytes(8, 32, 4096, dtype="float32") == 16 * 2**30
    assert memory.fmt_bytes(memory.score_bytes(8, 32, 4096, dtype=torch.float32)) == "16.0 GiB"
    assert memory.score_bytes(1, 1, 3, 5, dtype=torch.bfloat16) == 30
    assert memory.fmt_bytes(1536) == "1.5 KiB"
    assert memory.fmt_bytes(100) == "100 B"


def test_dtype_bytes():
    assert memory.dtype_bytes("bf16") == memory.dtype_bytes(torch.float16) == 2
    assert memory.dtype_bytes(torch.float64) == 8
    assert memory.dtype_bytes(3) == 3
    with pytest.raises(ValueError, match="unknown dtype"):
        memory.dtype_bytes("int4")


def test_traffic_by_hand():
    B, H, N, D = 2, 4, 128, 64
    op = B * H * N * D * 2  # one fp16 operand
    s = B * H * N * N * 2
    un = memory.unfused_traffic(B, H, N, N, D, "float16")
    assert un.operands == 4 * op and un.scores == 4 * s and un.total == 4 * op + 4 * s
    assert memory.unfused_traffic(B, H, N, N, D, "float16", elementwise_passes=2).scores == 8 * s
    fu = memory.fused_traffic(B, H, N, N, D, "float16")
    assert fu.scores == 0 and fu.total == 4 * op + B * H * N * 4
    # without cache reuse each of the N/64 query tiles re-reads K and V
    assert memory.fused_traffic(B, H, N, N, D, "float16", block_m=64, lse=False).total == 2 * op + 2 * 2 * op
    # GQA: K and V have Hkv heads
    assert memory.fused_traffic(B, H, N, N, D, "float16", Hkv=1, lse=False).total == 2 * op + 2 * op // H


def test_flops_time_intensity_roofline():
    assert memory.flops(1, 1, 2, 3, 4) == 4 * 2 * 3 * 4
    assert memory.flops(1, 1, 2, 3, 4, causal=True) == 2 * 2 * 3 * 4
    assert memory.seconds_at(4.2e12, 4.2) == pytest.approx(1.0)
    assert memory.ridge_point(692.0, 4.2) == pytest.approx(164.76, rel=1e-3)
    assert memory.attainable_tflops(10.0, 692.0, 4.2) == pytest.approx(42.0)
    assert memory.attainable_tflops(1e4, 692.0, 4.2) == 692.0
    # fused intensity grows with N (traffic ~ N, FLOPs ~ N^2); unfused saturates near D-ish values
    a = memory.intensity(1, 16, 1024, 1024, 128)
    b = memory.intensity(1, 16, 4096, 4096, 128)
    assert b == pytest.approx(4 * a, rel=0.01)
    assert memory.intensity(1, 16, 4096, 4096, 128, fused=False) < 70


def test_peak_models_match_the_recorded_dense_suite():
    t = memory.anchors_vs_model()
    assert t is not None and t.attrs["source"].endswith("dense.csv") and t.attrs["commit"]
    # attnlab's textbook backend: three score-sized tensors plus the output, within 0.1% of every recorded peak
    assert (t["textbook_model_error"].abs() < 1e-3).all() and len(t) == 6
    assert (t["fused_mib"] == t["fused_model_mib"]).all()  # the fused kernel: its output, nothing else
    two = memory.anchors_vs_model(live_scores=2)  # the formula's two tensors would be a third short
    assert (two["textbook_model_error"] > 0.3).all()
    assert memory.textbook_peak_extra(8, 16, 1024, 1024, 64, "bf16") == 528 * 2**20
    r = memory.ratio_table([1024], [64], live_scores=3)
    assert r.loc[1024, "D=64"] == pytest.approx(3 * 1024 / 64 + 1)


def test_anchors_come_only_from_a_recorded_file(tmp_path):
    assert memory.recorded_anchors(tmp_path) is None


def test_measured_tflops_picks_one_shape():
    df = pd.DataFrame({"B": [4, 4], "Hq": 16, "Nq": 4096, "Nk": 4096, "D": [128, 64], "dtype": "bfloat16",
                       "causal": False, "status": "ok", "backend": ["torch", "torch"], "tflops": [36.2, 30.0]})
    assert memory.measured_tflops(df, B=4, H=16, N=4096, D=128).to_dict() == {"torch": 36.2}


def test_sweep_columns():
    df = memory.sweep([1024, 2048])
    assert list(df["N"]) == [1024, 2048]
    assert (df["unfused_bytes"] > df["fused_bytes"]).all()
    assert df["score_bytes"].iloc[1] == 4 * df["score_bytes"].iloc[0]


def test_measured_roofs_reads_roofs_json(tmp_path):
    import json

    (tmp_path / "roofs.json").write_text(json.dumps({
        "roofs": {"bf16_matmul_tflops": 700.5, "fp32_matmul_tflops": 50.0, "fp32_fma_tflops": 49.0,
                  "read_tbps": 4.3, "copy_tbps": 4.1},
        "environment": {"gpu": "Some GPU", "commit": "abc1234", "date_utc": "2026-12-01T00:00:00Z", "how": "x"}}))
    r = memory.measured_roofs(tmp_path)
    assert (r["bf16_tflops"], r["fp32_tflops"], r["fp32_fma_tflops"]) == (700.5, 50.0, 49.0)
    assert (r["read_tbps"], r["copy_tbps"], r["name"], r["commit"]) == (4.3, 4.1, "Some GPU", "abc1234")
    assert r["source"] == f"{tmp_path.name}/roofs.json" and r["hbm_gib"] == memory.RECORDED_GPU["hbm_gib"]
    (tmp_path / "dense.json").write_text(json.dumps({"gpu": "Some GPU", "memory_gib": 139.8}))
    r = memory.measured_roofs(tmp_path)  # the memory the suites recorded, not the data sheet's figure
    assert r["hbm_gib"] == 139.8 and r["hbm_source"] == f"{tmp_path.name}/dense.json"


def test_measured_roofs_falls_back_to_the_constants(tmp_path):
    for content in (None, "not json", '{"roofs": {"bf16_matmul_tflops": 1.0}}'):
        if content is not None:
            (tmp_path / "roofs.json").write_text(content)
        r = memory.measured_roofs(tmp_path)
        assert r["source"] == "fallback: memory.RECORDED_GPU"
        gpu = memory.RECORDED_GPU
        assert r["bf16_tflops"] == gpu["bf16_tflops"] and r["copy_tbps"] == gpu["copy_tbps"]
        assert r["fp32_fma_tflops"] == gpu["fp32_tflops"] and r["read_tbps"] == gpu["copy_tbps"]


def test_measured_roofs_recorded_h200():
    r = memory.measured_roofs()
    if r["source"].startswith("fallback"):
        pytest.skip("no data/bench/nvidia-h200/roofs.json in this checkout")
    assert r["source"] == "nvidia-h200/roofs.json" and r["commit"] and r["date_utc"]
    assert r["bf16_tflops"] > r["fp32_tflops"] > 0 and r["read_tbps"] > 0 and r["copy_tbps"] > 0
