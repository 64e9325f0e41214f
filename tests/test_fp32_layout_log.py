import json

import pytest

from attnlab.lessons import kernel_notes


def test_fp32_layouts_reads_the_recorded_figures(tmp_path):
    rec = kernel_notes.fp32_layouts()  # the recorded file of this checkout
    assert 0 < rec["bank_conflict_frac"] < 1 and rec["query_major_ratio"]
    assert rec["source_log"].startswith("data/gpu_tests/") and rec["path"].suffix == ".json"
    p = tmp_path / "fp32.json"
    p.write_text(json.dumps({"bank_conflict_frac": 0.25, "query_major_ratio": {"B8 H16 N2048": 0.367},
                             "source_log": "data/gpu_tests/x.txt"}))
    r = kernel_notes.fp32_layouts(p)
    assert r["query_major_ratio"] == {"B8 H16 N2048": 0.367} and r["bank_conflict_frac"] == 0.25
    with pytest.raises(FileNotFoundError):  # a missing file fails loudly (a wheel install without ATTNLAB_DATA_DIR)
        kernel_notes.fp32_layouts(tmp_path / "none.json")
