"""Autotune results on disk (attnlab/backends/triton/tune_cache.py): the file round trip, what the key is
made of, concurrent writers, corrupt files, and the forward's and backward's use of it. CPU tests stand in
for the GPU (its name and Triton's version are given) and for the timing (a counting stand-in tunes);
the ``gpu`` test runs two processes on one cache directory, the second of which must not tune.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from attnlab.backends.triton import backward as tbwd
from attnlab.backends.triton import configs as tconfigs
from attnlab.backends.triton import tiles as ttiles
from attnlab.backends.triton import tune_cache as tc
from attnlab.problem import make_problem

KEY = (torch.bfloat16, 64, "causal", False, 1024, 1024, 32)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, a stand-in GPU, and nothing remembered in this process."""
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNLAB_AUTOTUNE_CACHE", raising=False)
    monkeypatch.setattr(tc, "_environment", lambda device_index: ("NVIDIA H200", "3.6.0"))
    monkeypatch.setattr(tc, "_loaded", {})
    monkeypatch.setattr(tconfigs, "_tuned", {})
    monkeypatch.setattr(tbwd, "_tuned", {})
    monkeypatch.setattr(tbwd, "_tuned1", {})
    return tmp_path


def _forget() -> None:
    """What a new process knows: nothing but the file."""
    tc._loaded.clear()
    tconfigs._tuned.clear()
    tbwd._tuned.clear()
    tbwd._tuned1.clear()


def test_round_trip(cache):
    assert tc.load("fwd", 0, KEY) is None
    tc.store("fwd", 0, KEY, {"block_m": 64})
    path = cache / "autotune-NVIDIA-H200-triton3.6.0.json"
    assert tc.cache_file("NVIDIA H200", "3.6.0") == path and path.exists()
    data = json.loads(path.read_text())
    assert data["format"] == tc.FORMAT and data["gpu"] == "NVIDIA H200" and data["triton"] == "3.6.0"
    _forget()
    assert tc.load("fwd", 0, KEY) == {"block_m": 64}
    assert tc.load("fwd", 3, KEY) == {"block_m": 64}  # the device index is not part of the key: the model is
    assert tc.load("bwd", 0, KEY) is None  # another kernel
    assert tc.load("fwd", 0, (*KEY[:-1], 64)) is None  # another tune key


def test_file_is_per_gpu_model_and_triton_version(cache, monkeypatch):
    tc.store("fwd", 0, KEY, {"block_m": 64})
    for env in (("NVIDIA A100-SXM4-80GB", "3.6.0"), ("NVIDIA H200", "3.7.0")):
        monkeypatch.setattr(tc, "_environment", lambda device_index, env=env: env)
        _forget()
        assert tc.load("fwd", 0, KEY) is None
    assert len(list(cache.glob("autotune-*.json"))) == 1


def test_default_location_and_opt_out(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNLAB_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tc.cache_dir() == tmp_path / ".cache" / "attnlab"
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert tc.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.setattr(tc, "_environment", lambda device_index: ("gpu", "3.6.0"))
    monkeypatch.setenv("ATTNLAB_AUTOTUNE_CACHE", "0")
    tc.store("fwd", 0, KEY, {"block_m": 64})
    assert not (tmp_path / "elsewhere").exists() and tc.load("fwd", 0, KEY) is None


def test_key_changes_with_the_kernel_source(cache, monkeypatch):
    """Editing any @triton.jit function of a kernel changes its source hash, so what was tuned for the old
    source is not found; tiles.band is shared by both kernels."""
    fwd, bwd = tc.kernel_source_hash("fwd"), tc.kernel_source_hash("bwd")
    assert fwd == tc.kernel_source_hash("fwd") and fwd != bwd and len(fwd) == 20
    assert any("def attn_fwd_kernel(" in s for s in tc._jit_sources("attnlab.backends.triton.forward_kernel"))
    tc.store("fwd", 0, KEY, {"block_m": 64})
    tc.store("bwd", 0, KEY, [{"block_m": 16}, {"block_m": 16}])
    if not hasattr(ttiles.band, "_src"):
        pytest.skip("this triton keeps a JIT function's source elsewhere")
    monkeypatch.setattr(ttiles.band, "_src", ttiles.band.src.replace("-inf", "- inf"))
    assert tc.kernel_source_hash("fwd") != fwd and tc.kernel_source_hash("bwd") != bwd
    _forget()
    assert tc.load("fwd", 0, KEY) is None and tc.load("bwd", 0, KEY) is None
    assert tc.entry_key("fwd", "a", KEY) != tc.entry_key("fwd", "b", KEY)


def test_corrupt_file_is_ignored_and_rewritten(cache):
    path = tc.cache_file("NVIDIA H200", "3.6.0")
    for junk in ("{not json", json.dumps([1, 2]), json.dumps({"format": 999, "entries": {}}), ""):
        path.write_text(junk)
        _forget()
        assert tc.load("fwd", 0, KEY) is None
    path.write_bytes(b"\xff\xfe\x00garbage")
    _forget()
    assert tc.load("fwd", 0, KEY) is None
    tc.store("fwd", 0, KEY, {"block_m": 64})
    assert json.loads(path.read_text())["entries"] == {tc.entry_key("fwd", tc.kernel_source_hash("fwd"), KEY):
                                                       {"block_m": 64}}


def test_unwritable_directory_warns_and_goes_on(cache, monkeypatch):
    blocker = cache / "file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(blocker / "sub"))  # a directory under a file
    with pytest.warns(UserWarning, match="could not write the autotune cache"):
        tc.store("fwd", 0, KEY, {"block_m": 64})
    assert tc.load("fwd", 0, KEY) == {"block_m": 64}  # this process still remembers it


def test_concurrent_threads_keep_every_entry(cache):
    path = cache / "shared.json"

    def writer(t: int) -> None:
        for i in range(40):
            tc.write_entries(path, {f"t{t}-{i}": i})

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    entries = tc.read_entries(path)
    assert len(entries) == 160 and entries["t3-39"] == 39
    assert not list(cache.glob("*.tmp"))  # no temporary file left behind


_WRITER = textwrap.dedent("""
    import importlib.util, sys
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("tune_cache", sys.argv[1])
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)
    for i in range(60):
        tc.write_entries(Path(sys.argv[2]), {f"{sys.argv[3]}-{i}": i})
        assert len(tc.read_entries(Path(sys.argv[2]))) >= i + 1  # never a half-written file: entries only grow
""")


def test_concurrent_processes_neither_corrupt_nor_lose_entries(cache):
    """Two processes writing one file at once: it always parses, and every entry of both survives."""
    path = cache / "shared.json"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, tc.__file__, str(path), name]) for name in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    entries = tc.read_entries(path)
    assert len(entries) == 120 and entries["a-59"] == entries["b-59"] == 59


def _gpu_like_problem():
    q = torch.randn(2, 4, 40, 64, dtype=torch.bfloat16)
    return make_problem(q, q, q, causal=True)


def test_forward_config_for_tunes_once_across_processes(cache, monkeypatch):
    """config_for's miss: tune and store; a new process (nothing in memory) finds it on disk and does not
    tune; a stored config that is no longer a candidate is tuned anew."""
    tuned = []
    space = tconfigs.candidates(torch.bfloat16, 64)
    monkeypatch.setattr(tconfigs, "AUTOTUNE", True)
    first = lambda prob, out, lse: tuned.append(1) or space[2]
    prob = _gpu_like_problem()
    assert tconfigs.config_for(prob, None, None, first) == space[2] and tuned == [1]
    assert tconfigs.config_for(prob, None, None, first) == space[2] and tuned == [1]  # in memory
    _forget()
    assert tconfigs.config_for(prob, None, None, first) == space[2] and tuned == [1]  # from disk
    assert tconfigs._tuned[tconfigs.tune_key(prob)] == space[2]
    monkeypatch.setattr(tconfigs, "candidates", lambda dtype, block_d: [space[0], space[1]])
    _forget()
    second = lambda prob, out, lse: tuned.append(2) or space[1]
    assert tconfigs.config_for(prob, None, None, second) == space[1] and tuned == [1, 2]


def test_backward_configs_for_tunes_once_across_processes(cache, monkeypatch):
    timed = []
    monkeypatch.setattr(tbwd, "AUTOTUNE", True)
    monkeypatch.setattr(tbwd, "_fastest", lambda configs, launch: timed.append(1) or configs[-1])
    prob = _gpu_like_problem()
    want = (tconfigs.dkdv_candidates(torch.bfloat16, 64)[-1], tconfigs.dq_candidates(torch.bfloat16, 64)[-1])
    assert tbwd.configs_for(prob, *[None] * 6) == want and timed == [1, 1]
    _forget()
    assert tbwd.configs_for(prob, *[None] * 6) == want and timed == [1, 1]
    path = tc.cache_file("NVIDIA H200", "3.6.0")
    data = json.loads(path.read_text())
    for name in list(data["entries"]):  # a damaged entry (one config only) is tuned anew
        data["entries"][name] = data["entries"][name][:1]
    path.write_text(json.dumps(data))
    _forget()
    assert tbwd.configs_for(prob, *[None] * 6) == want and timed == [1, 1, 1, 1]


def test_interpreter_path_reads_no_cache(cache, monkeypatch):
    """CPU tensors never autotune, so nothing is read or written."""
    import attnlab

    def refuse(*args):
        raise AssertionError("the interpreter path reached the tune cache")

    monkeypatch.setattr(tc, "load", refuse)
    monkeypatch.setattr(tc, "store", refuse)
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    attnlab.attention(q, q, q, causal=True, backend="triton").sum().backward()
    assert not list(cache.iterdir())


# ---- GPU: a second process finds what the first tuned ---------------------------------------------------
_GPU_RUN = textwrap.dedent("""
    import json
    import torch
    import attnlab
    from attnlab.backends.triton import backward
    from attnlab.backends.triton import forward as launch

    calls = []
    autotune, fastest = launch.autotune, backward._fastest
    launch.autotune = lambda *a: calls.append("fwd") or autotune(*a)
    backward._fastest = lambda *a: calls.append("bwd") or fastest(*a)
    q = torch.randn(2, 8, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    attnlab.attention(q, q, q, causal=True, backend="triton").sum().backward()
    torch.cuda.synchronize()
    print(json.dumps({"calls": calls}))
""")


@pytest.mark.gpu
def test_gpu_second_process_takes_the_persisted_configs(tmp_path):
    """A second process tunes nothing: it reads the configs the first one stored. How long its first call takes is
    a benchmark's to say, not this test's (``python -m attnlab.bench.first_call --env ATTNLAB_AUTOTUNE=1
    ATTNLAB_AUTOTUNE_CACHE=1``): a wall-clock bound here read the load of the other test workers as well."""
    env = dict(os.environ, ATTNLAB_CACHE_DIR=str(tmp_path), ATTNLAB_AUTOTUNE="1", ATTNLAB_AUTOTUNE_CACHE="1")
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", _GPU_RUN], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0]["calls"] == ["fwd", "bwd", "bwd"]  # tuned: the forward, and the backward's two kernels
    assert runs[1]["calls"] == []  # found on disk
    assert len(list(tmp_path.glob("autotune-*.json"))) == 1
