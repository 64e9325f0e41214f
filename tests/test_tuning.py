"""Configs without autotuning (attnlab/backends/triton/tuned_table.py, configs.config_for, backward.configs_for)
and autotuning on request (attnlab.tune, ATTNLAB_AUTOTUNE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attnlab
from attnlab.backends.triton import backward as tbwd
from attnlab.backends.triton import configs as tconfigs
from attnlab.backends.triton import forward as tlaunch
from attnlab.backends.triton import tune_cache as tc
from attnlab.backends.triton import tuned_table as tt
from attnlab.problem import make_problem

BF16 = torch.bfloat16


def _entry(kernel, config, **key):
    base = {"dtype": "bfloat16", "block_d": 64, "kind": "causal", "nq": 1024, "nk": 1024, "bh": 128}
    base.update({"tf32": False} if kernel == "fwd" else {"group": 1})
    base.update(key)
    return {"key": base, "config": config}


TABLE = {"sm90": {"measured": {"gpu": "NVIDIA H200", "triton": "3.6.0"}, "entries": {
    "fwd": [_entry("fwd", "causal-1k"), _entry("fwd", "causal-16k", nq=16384, nk=16384, bh=16),
            _entry("fwd", "dense-4k", kind="dense", nq=4096, nk=4096, bh=64),
            _entry("fwd", "d128", block_d=128)],
    "bwd": [_entry("bwd", "bwd-causal"), _entry("bwd", "bwd-gqa", group=4)],
}}}


def _key(kind="causal", n=1024, bh=128, block_d=64, fourth=False):
    return ("torch.bfloat16", block_d, kind, fourth, n, n, bh)


def test_lookup_takes_the_nearest_entry_of_the_same_kind():
    assert tt.lookup("fwd", "sm90", _key(n=2048), TABLE) == "causal-1k"
    assert tt.lookup("fwd", "sm90", _key(n=8192, bh=16), TABLE) == "causal-16k"
    assert tt.lookup("fwd", "sm90", _key(block_d=128), TABLE) == "d128"


def test_lookup_falls_back_to_the_mask_class_then_to_nothing():
    # causal+kv_len has no entry of its own: the banded class (causal) answers; kv_len takes the full class
    assert tt.lookup("fwd", "sm90", _key(kind="causal+kv_len"), TABLE) == "causal-1k"
    assert tt.lookup("fwd", "sm90", _key(kind="kv_len", n=512), TABLE) == "dense-4k"
    assert tt.lookup("fwd", "sm90", _key(block_d=256), TABLE) is None  # no entry of that head dim
    assert tt.lookup("fwd", "sm90", _key(fourth=True), TABLE) is None  # TF32 is its own space
    assert tt.lookup("fwd", "sm80", _key(), TABLE) is None  # a family the table does not have
    assert tt.lookup("bwd", "sm90", _key(fourth=4), TABLE) == "bwd-gqa"
    assert tt.lookup("bwd", "sm90", _key(fourth=2), TABLE) is None


def test_the_shipped_table_parses_and_holds_candidates_only():
    """Every shipped entry names a config that is still in its kernel's candidate space (else it is ignored)."""
    families = tt.load()
    for family, got in families.items():
        assert set(got["measured"]) >= {"gpu", "triton", "torch", "commit"}, family
        for e in got["entries"].get("fwd", []):
            k = e["key"]
            space = tconfigs.candidates(getattr(torch, k["dtype"]), k["block_d"])
            assert tconfigs.Config(**e["config"]) in space, e
        for e in got["entries"].get("bwd", []):
            k = e["key"]
            kv, q = (tconfigs.BwdConfig(**c) for c in e["config"])
            assert kv in tconfigs.dkdv_candidates(getattr(torch, k["dtype"]), k["block_d"]), e
            assert q in tconfigs.dq_candidates(getattr(torch, k["dtype"]), k["block_d"]), e


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Nothing tuned in memory, an empty cache folder, the GPU family sm90 and the TABLE above (with real
    configs) as the shipped table."""
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNLAB_AUTOTUNE_CACHE", raising=False)
    for mod in (tconfigs, tbwd):
        monkeypatch.setattr(mod, "_tuned", {})
        monkeypatch.setattr(mod, "_picked", {})
        monkeypatch.setattr(mod, "AUTOTUNE", False)
    monkeypatch.setattr(tbwd, "_tuned1", {})
    monkeypatch.setattr(tbwd, "_picked1", {})
    monkeypatch.setattr(tc, "_loaded", {})
    monkeypatch.setattr(tc, "_environment", lambda index: ("NVIDIA H200", "3.6.0"))
    monkeypatch.setattr(tt, "gpu_family", lambda device=None: "sm90")
    fwd_space, kv_space, q_space = (tconfigs.candidates(BF16, 64), tconfigs.dkdv_candidates(BF16, 64),
                                    tconfigs.dq_candidates(BF16, 64))
    table = json.loads(json.dumps(TABLE))
    table["sm90"]["entries"]["fwd"][0]["config"] = tconfigs.dataclasses.asdict(fwd_space[3])
    table["sm90"]["entries"]["bwd"][0]["config"] = [tconfigs.dataclasses.asdict(c) for c in (kv_space[2], q_space[1])]
    real_lookup = tt.lookup
    monkeypatch.setattr(tt, "lookup", lambda kernel, family, key, t=None: real_lookup(kernel, family, key, table))
    return fwd_space, kv_space, q_space


def _problem():
    q = torch.randn(2, 4, 1000, 64, dtype=BF16)
    return make_problem(q, q, q, causal=True)


def test_no_autotune_by_default_the_table_decides(fresh, monkeypatch):
    """Without ATTNLAB_AUTOTUNE nothing is timed: the table's config (forward and backward), once per key."""
    fwd_space, kv_space, q_space = fresh

    def refuse(*a):
        raise AssertionError("tuned without being asked")

    monkeypatch.setattr(tbwd, "_fastest", refuse)
    prob = _problem()
    assert tconfigs.config_for(prob, None, None, refuse) == fwd_space[3]
    assert tbwd.configs_for(prob, *[None] * 6) == (kv_space[2], q_space[1])
    other = make_problem(*(torch.randn(2, 4, 40, 64, dtype=BF16),) * 3, window=(8, 0))  # no entry of this size:
    assert tconfigs.config_for(other, None, None, refuse) == fwd_space[3]  # the nearest banded one
    d32 = make_problem(*(torch.randn(1, 2, 64, 32, dtype=BF16),) * 3)
    assert tconfigs.config_for(d32, None, None, refuse) == tconfigs.candidates(BF16, 32)[0]  # no entry: default


@pytest.mark.parametrize("first", ["mla", "d256"])
def test_backward_defaults_at_256_wide_tiles_are_kept_apart_by_value_dim(fresh, first):
    """D 192 / Dv 128 and D 256 share the head dim the backward's configs are chosen for (256) but not their first
    candidates (configs.wide_tiles_first): each keeps its own default in one process, whichever comes first."""
    def prob(D, Dv):
        q, k = (torch.randn(1, 2, 300, D, dtype=BF16) for _ in range(2))
        return make_problem(q, k, torch.randn(1, 2, 300, Dv, dtype=BF16), causal=True)

    want = {"mla": (prob(192, 128), (tconfigs.dkdv_candidates(BF16, 256, wide_first=True)[0],
                                     tconfigs.dq_candidates(BF16, 256, wide_first=True)[0])),
            "d256": (prob(256, 256), (tconfigs.dkdv_candidates(BF16, 256)[0], tconfigs.dq_candidates(BF16, 256)[0]))}
    assert want["mla"][1] != want["d256"][1]
    for name in (first, *(n for n in want if n != first)):
        p, pair = want[name]
        assert tbwd.configs_for(p, *[None] * 6) == pair, name
    assert tconfigs.bwd_tune_key(prob(128, 64))[3] == "causal"  # narrower tiles: Dv orders nothing, no tag


def test_a_config_tuned_on_this_machine_wins_over_the_table(fresh, monkeypatch):
    fwd_space, *_ = fresh
    def tuned(prob, out, lse):
        return fwd_space[1]

    prob = _problem()
    assert tconfigs.config_for(prob, None, None, tuned) == fwd_space[3]
    monkeypatch.setattr(tconfigs, "AUTOTUNE", True)  # ATTNLAB_AUTOTUNE=1: a key tuned nowhere is tuned now
    assert tconfigs.config_for(prob, None, None, tuned) == fwd_space[1]
    monkeypatch.setattr(tconfigs, "AUTOTUNE", False)
    tconfigs._tuned.clear()
    tconfigs._picked.clear()
    assert tconfigs.config_for(prob, None, None, tuned) == fwd_space[1]  # a new process: from the persistent cache
    with tconfigs.shipped_only():
        assert tconfigs.config_for(prob, None, None, tuned) == fwd_space[3]


def test_autotune_variable_is_read_at_import():
    code = "from attnlab.backends.triton import configs, backward; print(configs.AUTOTUNE, backward.AUTOTUNE)"
    for value, want in (("1", "True True"), ("0", "False False"), (None, "False False")):
        env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_AUTOTUNE"}
        if value is not None:
            env["ATTNLAB_AUTOTUNE"] = value
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert got.stdout.strip() == want, got.stderr[-2000:]


def test_tune_refuses_cpu_tensors_and_bad_keywords():
    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match="GPU launches"):
        attnlab.tune(q, q, q)
    with pytest.raises(TypeError, match="backend"):
        attnlab.tune(q, q, q, backend="triton")
    with pytest.raises(TypeError, match="backward"):
        attnlab.tune(q, q, q, backward="yes")


# ---- GPU -----------------------------------------------------------------------------------------------
_COUNT_COMPILES = textwrap.dedent("""
    import json, sys
    import torch
    import attnlab
    from attnlab.backends.triton import backward_kernels as bk, forward_kernel as fk

    grad = sys.argv[1] == "grad"
    q = torch.randn(2, 8, 777, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k, v = torch.randn_like(q, requires_grad=grad), torch.randn_like(q, requires_grad=grad)
    out = attnlab.attention(q, k, v, causal=True, backend="triton")
    if grad:
        out.sum().backward()  # the expanded ones: the backward makes them contiguous, as compile_ahead assumed
    torch.cuda.synchronize()
    ref = attnlab.reference(q.detach(), k.detach(), v.detach(), causal=True)[0]
    from attnlab.backends.triton.runtime import compiled_count
    compiled = {f.__name__: compiled_count(f)
                for f in (fk.attn_fwd_kernel, bk.bwd_preprocess, bk.bwd_dkdv_kernel, bk.bwd_dq_kernel)}
    print(json.dumps({"compiled": compiled, "ok": bool(attnlab.check.compare(out.detach(), ref))}))
""")


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_gpu_first_call_compiles_one_config_per_kernel(grad, tmp_path):
    """A new process with empty caches compiles the forward once (and each backward kernel once), no candidates."""
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_AUTOTUNE"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), ATTNLAB_CACHE_DIR=str(tmp_path / "attnlab"))
    got = subprocess.run([sys.executable, "-c", _COUNT_COMPILES, "grad" if grad else "fwd"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    assert res["ok"]
    n = int(grad)
    assert res["compiled"] == {"attn_fwd_kernel": 1, "bwd_preprocess": n, "bwd_dkdv_kernel": n,
                               "bwd_dq_kernel": n}, res


@pytest.mark.gpu
def test_gpu_tune_keeps_its_choice_and_calls_use_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    q = torch.randn(2, 4, 1024, 64, device="cuda", dtype=BF16, requires_grad=True)
    k, v = torch.randn_like(q), torch.randn_like(q)
    chosen = attnlab.tune(q, k, v, causal=True)
    prob = make_problem(q.detach(), k, v, causal=True)
    assert chosen["fwd"] in tconfigs.candidates(BF16, 64)
    assert tconfigs.config_for(prob, None, None, tlaunch.autotune) == chosen["fwd"]
    assert tbwd.configs_for(prob, *[None] * 6) == chosen["bwd"]
    assert list(tmp_path.glob("autotune-*.json"))
    out = attnlab.attention(q, k, v, causal=True, backend="triton")
    assert attnlab.check.compare(out.detach(), attnlab.reference(q.detach(), k, v, causal=True)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", ["1", "0"])
def test_gpu_compile_ahead_gradients_match_the_reference(ahead, tmp_path):
    """In a new process (nothing compiled yet), the backward with its kernels compiled in the background (and
    without) gives gradients within the checker's bound of the float64 reference."""
    code = textwrap.dedent("""
        import json, torch, attnlab
        from attnlab.check import compare
        g = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randn(2, 8, 333, 96, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
        k = torch.randn(2, 2, 333, 96, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
        v = torch.randn(2, 2, 333, 96, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
        dout = torch.randn(2, 8, 333, 96, device="cuda", dtype=torch.float16, generator=g)
        got = torch.autograd.grad(attnlab.attention(q, k, v, window=(64, 0), backend="triton"), (q, k, v), dout)
        base = torch.autograd.grad(attnlab.attention(q, k, v, window=(64, 0), backend="torch"), (q, k, v), dout)
        x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(attnlab.reference(*x64, window=(64, 0))[0], x64, dout.double())
        print(json.dumps([bool(compare(a, r, dtype=torch.float16, base=b).baseline_passed)
                          for a, r, b in zip(got, ref, base)]))
    """)
    env = dict(os.environ, ATTNLAB_COMPILE_AHEAD=ahead, TRITON_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [True, True, True]


def test_a_config_that_does_not_fit_gives_way_to_the_next(fresh, monkeypatch):
    """Triton's OutOfResources at a plan's first launch: the next candidate runs, with a warning, and is kept
    for the tune key (a table or default made for a GPU with more shared memory)."""

    fwd_space, *_ = fresh
    tried = []

    class OutOfResources(Exception):
        pass

    def fake_launch(prob, out, lse, cfg, interpret):
        tried.append(cfg)
        if cfg == fwd_space[3]:
            raise OutOfResources("out of resource: shared memory")
        return None

    monkeypatch.setattr(tlaunch, "jit_launch", fake_launch)
    prob = _problem()
    plan = tlaunch._Plan(prob, tconfigs.config_for(prob, None, None, tlaunch.autotune))
    with pytest.warns(UserWarning, match="does not fit"):
        plan.launch(prob, torch.empty(2, 4, 1000, 64, dtype=BF16), None)
    assert tried == [fwd_space[3], fwd_space[4]] and plan.cfg == fwd_space[4]
    assert tconfigs.config_for(prob, None, None, tlaunch.autotune) == fwd_space[4]
