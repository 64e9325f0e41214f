"""Kernels compiled ahead on worker threads load their launchers one at a time (background.serialize_kernel_loads):
two launchers loaded at once could hand one kernel the other's launch function."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnlab import switch_interval, warm_start
from attnlab.backends.triton import background

triton = pytest.importorskip("triton")
CompiledKernel = triton.compiler.compiler.CompiledKernel


def test_handles_are_made_one_thread_at_a_time(monkeypatch):
    inside, most, lock = [0], [0], threading.Lock()

    def slow_load(self) -> None:  # stands in for building and loading a launcher
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1

    def four_at_once() -> int:
        most[0] = 0
        gate = threading.Barrier(4)

        def call() -> None:
            gate.wait()
            CompiledKernel._init_handles(object())

        workers = [threading.Thread(target=call) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return most[0]

    monkeypatch.setattr(CompiledKernel, "_init_handles", slow_load)
    assert four_at_once() > 1  # the stand-in alone overlaps, so the check below can fail
    assert background.serialize_kernel_loads() is True
    assert CompiledKernel._init_handles.__wrapped__ is slow_load
    assert four_at_once() == 1
    background.serialize_kernel_loads()  # a second call wraps nothing twice
    assert CompiledKernel._init_handles.__wrapped__ is slow_load


def test_a_background_compile_serializes_loads_first(monkeypatch):
    seen = []
    monkeypatch.setattr(background, "serialize_kernel_loads", lambda: seen.append("serialized"))

    class Pool:
        def submit(self, fn, *args):
            seen.append("submitted")
            done = Future()
            done.set_result(None)
            return done

    monkeypatch.setattr(background, "_pool", Pool())
    background.ahead(SimpleNamespace(device_caches={0: None}), (1,), (), {}, torch.device("cuda", 0))
    assert seen == ["serialized", "submitted"]


def test_drain_waits_for_work_and_the_work_it_starts():
    """background.drain returns only once nothing submitted is left running, also work that running work
    submitted (a compile that starts its launcher's build)."""
    done = []

    def second():
        time.sleep(0.2)
        done.append("second")

    def first():
        time.sleep(0.2)
        background._submit(second)
        done.append("first")

    background._submit(first)
    background.drain()
    assert done == ["first", "second"] and not background._inflight


def test_background_work_runs_with_the_short_switch_interval():
    """Work on the compile threads sees attnlab's short GIL switch interval; the caller's is back after it."""
    warm_start.wait()  # no other user of the short interval (the warm start runs on GPU builds of torch)
    background.drain()
    before = sys.getswitchinterval()
    seen = []
    background._submit(lambda: seen.append(sys.getswitchinterval()))
    background.drain()
    assert seen == [pytest.approx(switch_interval.SHORT_S)]
    assert sys.getswitchinterval() == before


@pytest.mark.gpu
def test_kernels_loaded_on_threads_at_once_each_get_their_own_launcher():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    tools = Path(__file__).resolve().parents[1] / "tools"
    sys.path.insert(0, str(tools))
    try:
        spec = importlib.util.spec_from_file_location("launcher_race", tools / "launcher_race.py")
        race = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(race)
        for _ in range(3):
            row = race.one_round(serialized=True)
            assert row["errors"] == [] and row["wrong_values"] == 0, row
    finally:
        sys.path.remove(str(tools))
