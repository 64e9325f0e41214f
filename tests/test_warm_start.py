"""The background warm start: Triton's per-process start-up is done once, off the caller's thread."""

from __future__ import annotations

import importlib

import pytest
import torch

from attnlab import switch_interval, warm_start


@pytest.fixture
def fresh(monkeypatch):
    """warm_start as if attnlab had just been imported with a GPU build of torch (the import's own thread, on a GPU
    build, done first: it shares the short switch interval)."""
    warm_start.wait()
    monkeypatch.setattr(warm_start, "_thread", None)
    monkeypatch.setattr(warm_start, "_report", {"started": False})
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    monkeypatch.delenv("ATTNLAB_WARM_START", raising=False)
    return warm_start


def test_the_thread_computes_tritons_cache_key_for_the_process(fresh):
    pytest.importorskip("triton")
    triton_key = fresh.triton_key_function()
    triton_key.cache_clear()
    fresh.start()
    fresh.wait()
    got = fresh.report()
    assert got["started"] is True
    assert isinstance(got["triton_key"], float), got  # a time, not an error
    assert triton_key.cache_info().currsize == 1  # the caller's launch finds it computed
    assert importlib.util.find_spec("triton.experimental.gluon") is None or isinstance(got["gluon"], float), got


def test_nothing_starts_when_switched_off_or_on_a_cpu_build(fresh, monkeypatch):
    monkeypatch.setenv("ATTNLAB_WARM_START", "0")
    fresh.start()
    assert fresh._thread is None and fresh.report() == {"started": False}
    monkeypatch.delenv("ATTNLAB_WARM_START")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    fresh.start()
    assert fresh._thread is None
    fresh.wait()  # a no-op without a thread


def test_a_failing_step_is_reported_not_raised(fresh, monkeypatch):
    def broken():
        raise ImportError("no such piece")

    monkeypatch.setattr(fresh, "_gluon", broken)
    monkeypatch.setattr(fresh, "_cache_key", lambda: None)
    fresh.start()
    fresh.wait()
    got = fresh.report()
    assert got["gluon"] == "ImportError: no such piece" and isinstance(got["triton_key"], float)


def test_the_switch_interval_is_short_while_it_hashes_and_restored_after(fresh, monkeypatch):
    import sys

    seen = {}
    monkeypatch.setattr(fresh, "_cache_key", lambda: seen.setdefault("during", sys.getswitchinterval()))
    monkeypatch.setattr(fresh, "_gluon", lambda: None)
    before = sys.getswitchinterval()
    assert before > switch_interval.SHORT_S * 2  # the default 5 ms, or a user's setting above ours
    fresh.start()
    fresh.wait()
    assert seen["during"] == pytest.approx(switch_interval.SHORT_S)
    assert sys.getswitchinterval() == before
