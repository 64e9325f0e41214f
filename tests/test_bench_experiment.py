"""attnlab.bench.experiment: the one-off experiments' record and command line."""

from __future__ import annotations

import json

import pytest

from attnlab.bench import experiment


def test_the_command_line_runs_writes_and_prints(tmp_path, capsys):
    out = tmp_path / "x.json"
    rc = experiment.main("attnlab.bench.x", "X.\n", lambda o: experiment.write({"ok": True, "at": o}, o), [str(out)])
    assert rc == 0 and json.loads(out.read_text()) == {"ok": True, "at": str(out)}
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert experiment.write({"a": 1}, None) == {"a": 1}  # nothing written without a file


def test_a_machine_that_cannot_run_it_and_a_bad_command_are_one_line_errors(tmp_path, capsys):
    ran = []
    rc = experiment.main("attnlab.bench.x", "X.", ran.append, [str(tmp_path / "x.json")], needs=lambda: "needs a GPU")
    err = capsys.readouterr().err
    assert rc == 2 and not ran and err.strip() == "python -m attnlab.bench.x: error: needs a GPU"
    with pytest.raises(SystemExit) as exit_:
        experiment.main("attnlab.bench.x", "X.", ran.append, [])
    assert exit_.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_the_environment_names_commit_and_date(monkeypatch):
    monkeypatch.setenv("ATTNLAB_COMMIT", "abc1234")
    env = experiment.run_environment("cpu")
    assert env["commit"] == "abc1234" and env["gpu"] is None and env["date_utc"].endswith("Z")


@pytest.mark.parametrize("module", ["hopper_persistent_ab", "hopper_window_route", "hopper_bwd_window_route"])
def test_the_hopper_experiments_say_what_they_need(module, tmp_path, capsys):
    import importlib

    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU is here: the experiment would run")
    mod = importlib.import_module(f"attnlab.bench.{module}")
    assert mod.main([str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.strip() == f"python -m attnlab.bench.{module}: error: needs an sm_90 GPU"
    assert not (tmp_path / "x.json").exists()


def test_run_rows_prints_each_row_and_writes_the_record(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rec = experiment.run_rows([(1, 2), (3, 4)], lambda a, b: {"sum": a + b}, str(out), device="cpu")
    assert rec["rows"] == [{"sum": 3}, {"sum": 7}] and json.loads(out.read_text()) == rec
    assert capsys.readouterr().out.splitlines() == ["{'sum': 3}", "{'sum': 7}"]
    rec = experiment.run_rows([(1, 2)], lambda a, b: {"sum": a + b}, None, device="cpu", extra={"method": "m"})
    assert list(rec) == ["environment", "method", "rows"] and rec["method"] == "m"


def test_the_backward_route_judges_gradients_on_its_slice():
    """The backward route's check passes the gradients of a right backward (the chunked PyTorch one, with a window
    and sinks under GQA) and fails them with dk off by 10%."""
    import torch

    import attnlab
    from attnlab.bench.hopper_bwd_window_route import _check

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 50, 16, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(2, 4, 50, 16, generator=g).bfloat16()
    kw = dict(window=(7, 0), sinks=torch.randn(4, generator=g))
    grads = torch.autograd.grad(attnlab.attention(q, k, v, backend="torch", **kw), (q, k, v), dout)
    q, k, v = q.detach(), k.detach(), v.detach()
    assert _check(q, k, v, dout, kw, grads, 2)
    assert not _check(q, k, v, dout, kw, (grads[0], grads[1] * 1.1, grads[2]), 2)
