"""The command line's front door: one help, a version, and mistakes reported in one line (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnlab import __version__
from attnlab.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=120)


def test_top_level_help_lists_every_command():
    res = _run("--help")
    assert res.returncode == 0
    for cmd in ("info", "check", "compile-check", "bench"):
        assert cmd in res.stdout


def test_version():
    res = _run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"attnlab {__version__}"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "COMMAND"),
        (["frob"], "invalid choice: 'frob'"),
        (["check", "--backends", "trition"], "unknown backend 'trition'"),
        (["check", "--backends"], "expected at least one argument"),
        (["bench"], "--suite"),
        (["bench", "--suite", "nope"], "invalid choice: 'nope'"),
        (["bench", "--suite", "quick", "--device", "tpu"], "--device must be cuda or cpu"),
        (["compile-check", "--arch"], "expected at least one argument"),
    ],
)
def test_mistakes_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        rc = main(argv)
        raise SystemExit(rc)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_cpu_bench_never_writes_into_the_recorded_data():
    from attnlab.bench.session import default_out

    assert default_out("cpu").resolve() != (default_out("cuda")).resolve()
    assert "data" not in default_out("cpu").parts[-2:]


def test_plots_never_read_a_cpu_folder(tmp_path):
    from attnlab.bench.plots import bench_dirs

    for name in ("cpu", "nvidia-h200"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "dense.csv").write_text("x\n")
    assert [d.name for d in bench_dirs(tmp_path)] == ["nvidia-h200"]
