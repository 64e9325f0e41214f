"""attnlab.bench.mma_patch_probe: the patch file, the patches' application, the command line; one GPU run."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.bench import mma_patch_probe as probe

#: A patch that changes no instruction: one comment line of the kernel, reworded.
NOOP = [["// ---- the kernel ----", "// ---- the kernel (reworded) ----"]]


def test_patches_apply_in_order_and_only_to_text_found_once():
    assert probe.apply_patches("a b c", [("a", "x"), ("x b", "y")]) == "y c"
    with pytest.raises(ValueError, match=r"mode 'm': the text to replace occurs 0 times, not once: 'zz'"):
        probe.apply_patches("a b c", [("zz", "y")], "m")
    with pytest.raises(ValueError, match="occurs 2 times"):
        probe.apply_patches("a a", [("a", "y")], "m")


def test_the_patch_file_is_checked(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"noop": NOOP}))
    assert probe.load_patches(path) == {"noop": [tuple(NOOP[0])]}
    probe.check_patches(probe.load_patches(path))  # it applies to the kernel as it is
    for bad, says in (([], "JSON object of mode name"), ({"main": []}, "'main' is the unpatched kernel"),
                      ({"m": [["only old"]]}, "expected a list of \\[old, new\\] string pairs"),
                      ({"m": "text"}, "expected a list")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=says):
            probe.load_patches(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the patch file"):
        probe.load_patches(path)


def test_the_command_line_reports_mistakes_in_one_line(tmp_path, capsys):
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps({"m": [["text that is not in the kernel", "x"]]}))
    assert probe.main([str(moved), str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: mode 'm': the text to replace occurs 0 times" in err
    assert probe.main([str(tmp_path / "missing.json"), str(tmp_path / "out.json")]) == 2
    assert "cannot read the patch file" in capsys.readouterr().err
    noop = tmp_path / "noop.json"
    noop.write_text(json.dumps({"noop": NOOP}))
    assert probe.main([str(noop), str(tmp_path / "no-such-folder" / "out.json")]) == 2
    assert "error: no folder for the output file" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert probe.main([str(noop), str(tmp_path / "out.json")]) == 2
        assert capsys.readouterr().err.strip().endswith("error: needs a CUDA GPU of compute capability 8.0 or newer")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.gpu
def test_a_patch_that_changes_nothing_gives_main_bit_for_bit(tmp_path, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs a CUDA GPU of compute capability 8.0 or newer")
    monkeypatch.setattr(probe, "CASES", [("bfloat16", 1, 2, 300, 64, True)])
    monkeypatch.setattr(probe, "ROUNDS", 1)
    rec = probe.run({"noop": [tuple(NOOP[0])]}, str(tmp_path / "out.json"))
    (row,) = rec["rows"]
    assert row["equal"] == {"public_call": True, "main": True, "noop": True}
    assert row["max_abs_diff"]["noop"] == 0.0 and set(row["flash_over"]) == {"main", "noop"}
    assert json.loads((tmp_path / "out.json").read_text())["patches"] == {"noop": NOOP}
