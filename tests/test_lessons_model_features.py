"""Notebook 11's helpers (attnlab.lessons.model_features): each figure and claim the notebook prints."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.lessons import model_features as mf


def test_the_packed_mask_is_block_diagonal_and_causal():
    m = mf.packed_mask([2, 3])
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]).bool()
    assert torch.equal(m, want)
    assert mf.packed_mask([2, 3], causal=False).sum().item() == 4 + 9
    assert mf.prefix_sums([2, 3]).tolist() == [0, 2, 5]


def test_padding_saved_counts_tokens_and_causal_pairs():
    t = mf.padding_saved([1, 3])
    assert t.loc["tokens"].tolist()[:2] == [4, 6]
    assert t.loc["causal pairs per head"].tolist()[:2] == [1 + 6, 2 * 6]
    assert t.loc["tokens", "padded / packed"] == pytest.approx(1.5)


def test_varlen_equals_each_document_alone():
    assert mf.varlen_against_documents([3, 1, 6], H=2, D=8) < 1e-5


def test_softcap_curve_and_its_gradient():
    c = mf.softcap_curve(10.0, lo=-50, hi=50, n=11)
    assert c["capped"].abs().max() < 10.0 and c.loc[5, "capped"] == 0.0 and c.loc[5, "gradient"] == 1.0
    assert c.loc[0, "gradient"] == pytest.approx(1 - math.tanh(5.0) ** 2)
    assert mf.softcap_gradient_check(cap=2.0) < 1e-5


def test_alibi_penalty_follows_the_contract_and_equals_a_bias():
    p = mf.alibi_penalty(0.5, Nq=2, Nk=4)  # query i sits at key i + 2
    assert p.tolist() == [[-1.0, -0.5, 0.0, -0.5], [-1.5, -1.0, -0.5, 0.0]]
    assert mf.alibi_slopes(8).tolist()[0] == pytest.approx(0.5) and mf.alibi_slopes(8).dtype == torch.float32
    assert mf.alibi_as_bias_check() < 1e-5


def test_a_sink_takes_weight_and_gives_an_empty_row_its_value_as_lse():
    t = mf.sink_rows(sink=0.75)
    plain, sunk = t.xs("no sink"), t.xs("sink 0.75")
    assert plain.loc[2, "lse"] == float("-inf") and sunk.loc[2, "lse"] == pytest.approx(0.75)
    assert (sunk["|out|"][2], plain["|out|"][2]) == (0.0, 0.0)
    assert plain.loc[0, "weight on keys"] == pytest.approx(1.0) and 0 < sunk.loc[0, "weight on keys"] < 1
    # the sink's share is exp(sink - lse)
    assert 1 - sunk.loc[1, "weight on keys"] == pytest.approx(math.exp(0.75 - sunk.loc[1, "lse"]))


def test_the_decode_loop_writes_each_step_and_matches_the_whole_sequence():
    loop = mf.decode_loop(steps=3, prompt=4, capacity=8)
    assert loop["written into the cache"].all()
    assert loop["keys attended"].tolist() == [5, 6, 7]
    assert loop["max |out - whole sequence|"].max() < 1e-5


def test_recorded_speed_tables_read_the_suites():
    speed = mf.speed_table()
    if speed is None:
        pytest.skip("no recorded scoremod suite")
    assert {"flex", "sdpa-cudnn"} <= set(speed["rival"]) and (speed["rival / attnlab"] > 0).all()
    row = speed[(speed["feature"] == "softcap50 (full)") & (speed["pass"] == "forward")].iloc[0]
    assert row["rival / attnlab"] == pytest.approx(row["rival ms"] / row["attnlab ms"])
    cost = mf.modifier_cost()
    assert cost is not None and {"sinks", "softcap", "append 1", "append 4"} <= set(cost["with"])


def test_speed_tables_read_one_gpu_folder_and_keep_training_rows_without_decode(tmp_path, monkeypatch):
    import shutil

    gpu = tmp_path / "some-gpu"
    gpu.mkdir()
    src = mf.BENCH_DIR / "nvidia-h200"
    if not (src / "scoremod.csv").is_file():
        pytest.skip("no recorded scoremod suite")
    shutil.copy(src / "scoremod.csv", gpu)
    (tmp_path / "another-gpu").mkdir()
    shutil.copy(src / "scoremod-decode.csv", tmp_path / "another-gpu")  # another GPU's decode rows: not mixed in
    monkeypatch.setattr(mf, "BENCH_DIR", tmp_path)
    cost = mf.modifier_cost()
    assert cost is not None and set(cost["with"]) == {"sinks"}
    assert mf.speed_table().attrs["gpu"] == "some-gpu"


def test_the_provider_steps_read_the_recorded_runs(tmp_path, monkeypatch):
    import json

    folder = tmp_path / "experiments" / "some-gpu"
    folder.mkdir(parents=True)
    monkeypatch.setattr(mf, "DATA_DIR", tmp_path)
    assert mf.provider_steps("some-gpu") is None
    rec = {"environment": {"commit": "abcdef0123"}, "checks": {"a": True, "b": False},
           "shape": {"layers": 4, "B": 2, "N": 512},
           "timing": {"step_ms": {"sdpa-flash": 3.0, "attnlab": 2.0},
                      "attnlab_calls_per_step": {"forward": 4.0, "backward": 4.0, "refused": 0.0}}}
    (folder / "llama-sdpa-abcdef0.json").write_text(json.dumps(rec))
    got = mf.provider_steps("some-gpu")
    (row,) = got.to_dict("records")
    assert got.index[0] == "transformers Llama, 4 layers, B2 N512"  # read from the record
    assert row["PyTorch / attnlab"] == pytest.approx(1.5) and row["checks passed"] is False
    assert row["attnlab calls (fwd, bwd, refused)"] == "4, 4, 0" and row["commit"] == "abcdef0"
    newer = dict(rec, environment={"commit": "0000000aaa", "date_utc": "2026-12-05T00:00:00Z"})
    (folder / "llama-sdpa-0000000.json").write_text(json.dumps(newer))  # sorts first by name, newest by date
    assert mf.provider_steps("some-gpu").iloc[0]["commit"] == "0000000"


def test_the_client_models_read_the_recorded_run(tmp_path, monkeypatch):
    import json

    folder = tmp_path / "experiments" / "some-gpu"
    folder.mkdir(parents=True)
    monkeypatch.setattr(mf, "DATA_DIR", tmp_path)
    assert mf.client_models("some-gpu") is None
    errs = {"logits_max_abs": 0.1, "grads_rel_l2": 0.03, "attn_grads_max_rel": 0.07}
    rec = {"environment": {"commit": "abcdef0123"}, "bound": 1.5, "checks": {"x": True, "y": False},
           "models": {"gemma2": {"eager": errs, "attnlab": dict(errs, logits_max_abs=0.2),
                                 "step_ms": {"eager": 2.0, "attnlab": 1.0}}}}
    (folder / "hf-clients-abcdef0.json").write_text(json.dumps(rec))
    got = mf.client_models("some-gpu")
    assert got.loc[("gemma2", "attnlab"), "logits err"] == 0.2 and got.loc[("gemma2", "eager"), "step ms"] == 2.0
    assert got.attrs == {"checks_passed": False, "commit": "abcdef0", "bound": 1.5}


def test_the_sinks_replay_reads_the_newest_recorded_run(tmp_path, monkeypatch):
    import json

    folder = tmp_path / "experiments" / "some-gpu"
    folder.mkdir(parents=True)
    monkeypatch.setattr(mf, "DATA_DIR", tmp_path)
    assert mf.sinks_replay("some-gpu") is None
    rows = [{"variant": v, "graph_ms": g, "graph_over_plain": g / 2.0, "eager_ms": 3.0, "eager_over_plain": 1.0}
            for v, g in (("plain", 2.0), ("sinks", 2.1), ("sinks_requiring_grad", 2.2))]
    old = {"environment": {"commit": "aaaaaaa111", "date_utc": "2026-12-01T00:00:00Z"}, "rows": rows[:2]}
    new = {"environment": {"commit": "bbbbbbb222", "date_utc": "2026-12-04T00:00:00Z"}, "rows": rows}
    (folder / "window-sinks-graph-aaaaaaa.json").write_text(json.dumps(old))
    (folder / "window-sinks-graph-bbbbbbb.json").write_text(json.dumps(new))
    got = mf.sinks_replay("some-gpu")
    assert got.attrs["commit"] == "bbbbbbb" and list(got.index) == ["plain", "sinks", "sinks_requiring_grad"]
    assert got.loc["sinks_requiring_grad", "graph_over_plain"] == pytest.approx(1.1)
