"""The first-call harness: new processes, the rows they write, and its one-line errors."""

from __future__ import annotations

import csv
import json

import pytest

from attnlab.bench import first_call


def test_a_cold_only_run_writes_one_process_rows_under_its_name(tmp_path):
    rc = first_call.main(["--device", "cpu", "--backends", "torch", "--problems", "n777_d64", "--cold-only",
                          "--name", "first_call_cpu", "--out", str(tmp_path), "--timeout-s", "240"])
    assert rc == 0
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    command = json.loads((folder / "first_call_cpu.json").read_text())["command"]
    assert command.startswith("python -m attnlab.bench.first_call --device cpu --backends torch"), command
    rows = list(csv.DictReader(open(folder / "first_call_cpu.csv")))
    assert [(r["kind"], r["cold"], r["status"]) for r in rows] == [("fwd", "True", "ok"),
                                                                    ("warm-new-shape", "True", "ok")]
    assert all(float(r["first_call_s"]) > 0 for r in rows)
    assert "background settled in" in rows[1]["notes"] and "background" not in rows[0]["notes"]


@pytest.mark.parametrize("argv, says", [
    (["--name", "../x"], "--name takes letters"),
    (["--timeout-s", "0"], "--timeout-s must be positive"),
    (["--problems", "no-such-problem"], "no problem's name contains"),
])
def test_bad_values_are_one_line_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        first_call.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "Traceback" not in err
