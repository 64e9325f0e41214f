"""Random combinations of the public call's keywords against the float64 reference.

The case lists of ``attnlab.cases`` pick each edge on purpose; these tests draw :class:`~attnlab.cases.Case`
objects at random (causal or windows in either alignment, lengths, every explicit mask kind, GQA, both layouts,
every memory view, soft cap, ALiBi, sinks, scales of either sign; float32 and 16-bit inputs; packed sequences),
so that a combination no list names still meets the contract as :func:`attnlab.check.verify` judges it. Their
gradients, and paged caches with appends (which no Case describes), are judged here with the checker's
:func:`~attnlab.check.compare`. Each test draws from its own seed (``ATTNLAB_FUZZ_SEED`` shifts them all, to
explore); a failure prints the cases it drew.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import attnlab
from attnlab import check
from attnlab.api import poison_outputs
from attnlab.cases import MASKS, VIEWS, Case, make_inputs

SEED = int(os.environ.get("ATTNLAB_FUZZ_SEED", "0"))
DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float16)


def _band(rng: random.Random) -> dict:
    """causal, a window or neither; with either, an alignment (Nq != Nk needs one)."""
    pick = rng.random()
    if pick < 0.25:
        return dict(causal=True, align=rng.choice(["top_left", "bottom_right"]))
    if pick < 0.45:
        return dict(window=(rng.choice([None, 0, 1, 3, 7, 50]), rng.choice([None, 0, 2, 5])),
                    align=rng.choice(["top_left", "bottom_right"]))
    return {}


def _modifiers(rng: random.Random) -> dict:
    """The soft cap, ALiBi slopes, sinks and a scale, each drawn now and then."""
    mods: dict = {}
    if rng.random() < 0.2:
        mods["softcap"] = rng.choice([5.0, 30.0])
    if rng.random() < 0.2:
        mods["alibi"] = rng.choice(["h", "bh"])
    if rng.random() < 0.2:
        mods["sinks"] = True
    if rng.random() < 0.2:
        mods["scale"] = rng.choice([0.1, 1.0, 2.0, -0.5])
    return mods


def _random_case(rng: random.Random, i: int, dtypes: tuple[torch.dtype, ...] = DTYPES) -> Case:
    """A padded-batch case with every keyword drawn, checked in one drawn dtype."""
    B, Hkv = rng.choice([1, 2, 3]), rng.choice([1, 2])
    Nq, Nk = rng.randint(1, 40), rng.randint(1, 40)
    kw = dict(_band(rng), **_modifiers(rng))
    if rng.random() < 0.3:
        kw["kv_len"] = tuple(rng.randint(0, Nk) for _ in range(B))
    if rng.random() < 0.3:
        kw["q_len"] = tuple(rng.randint(0, Nq) for _ in range(B))
    if rng.random() < 0.25:
        kw["mask"] = rng.choice(sorted(MASKS))
    return Case(f"random_{i}", B=B, Hq=Hkv * rng.choice([1, 2, 3]), Hkv=Hkv, Nq=Nq, Nk=Nk,
                D=rng.choice([8, 16, 24, 32]), layout=rng.choice(["bhnd", "bnhd"]), view=rng.choice(VIEWS),
                dtypes=(rng.choice(dtypes),), **kw)


def _random_packed_case(rng: random.Random, i: int) -> Case:
    """Packed sequences (some empty), Dv != D at times, bands in either alignment, the score modifiers."""
    Hkv, D = rng.choice([1, 2]), rng.choice([8, 16, 32])
    seqs = tuple((rng.randint(0, 20), rng.randint(0, 20)) for _ in range(rng.randint(1, 4)))
    return Case(f"random_packed_{i}", Hq=Hkv * rng.choice([1, 2]), Hkv=Hkv, D=D, Dv=rng.choice([D, 8, 24]),
                seqs=seqs, dtypes=(rng.choice([torch.float32, torch.bfloat16]),), **_band(rng), **_modifiers(rng))


def _verify(backends: list[str], cases: list[Case], device: str, seed: int) -> None:
    df = check.verify(backends=backends, cases=cases, device=device, seed=seed)
    assert len(df) and check.all_passed(df), check.summarize(df[df["status"].isin(["failed", "error"])])


def test_random_cases_cpu():
    rng = random.Random(SEED + 1)
    _verify(["triton", "sdpa", "auto"], [_random_case(rng, i) for i in range(90)], "cpu", SEED + 1)


@pytest.mark.gpu
def test_random_cases_gpu():
    """Fewer cases than on CPU: on a GPU most draws compile kernels of their own."""
    rng = random.Random(SEED + 2)
    _verify(["triton", "sdpa", "auto"], [_random_case(rng, i, (torch.float32, torch.bfloat16, torch.float16))
                                         for i in range(60)], "cuda", SEED + 2)


def test_random_packed_cases_cpu():
    rng = random.Random(SEED + 4)
    _verify(["triton", "auto"], [_random_packed_case(rng, i) for i in range(120)], "cpu", SEED + 4)


def _grads(fn, leaves: list[torch.Tensor], dout: torch.Tensor, kw: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradients of ``fn(q, k, v, **kw)`` in ``dtype`` against ``dout``: q, k, v, then the sinks' and a
    bias's."""
    ins = [t.detach().to(dtype).requires_grad_(True) for t in leaves]
    kw = dict(kw)
    for key in ("sinks", "mask"):
        if torch.is_tensor(kw.get(key)) and kw[key].is_floating_point():
            kw[key] = kw[key].detach().to(dtype).requires_grad_(True)
            ins.append(kw[key])
    out = fn(*ins[:3], **kw)
    (out[0] if isinstance(out, tuple) else out).backward(dout.to(dtype))
    return [t.grad for t in ins]


def test_random_gradients_cpu():
    """dq, dk, dv (and the sinks' and a bias's) of ``triton`` and ``auto`` in float32 against the float64
    reference's, within twice the textbook call's error plus 1e-5 of their largest value (the baseline criterion
    of :func:`attnlab.check.compare` with that floor)."""
    rng, gen = random.Random(SEED + 3), torch.Generator().manual_seed(SEED + 3)
    failures = []
    for i in range(60):
        case = _random_case(rng, i, (torch.float32,))
        q, k, v, kw = make_inputs(case, dtype=torch.float32, device="cpu", seed=SEED + 3 + i)
        dout = torch.randn(q.shape, generator=gen)
        ref = _grads(attnlab.reference, [q, k, v], dout, kw, torch.float64)
        base = _grads(attnlab.attention, [q, k, v], dout, dict(kw, backend="torch"), torch.float32)
        for backend in ("triton", "auto"):
            got = _grads(attnlab.attention, [q, k, v], dout, dict(kw, backend=backend), torch.float32)
            for name, g, r, t in zip(("dq", "dk", "dv", "extra", "extra"), got, ref, base, strict=False):
                rep = check.compare(g, r, base=t, floor=1e-5 * max(1.0, float(r.abs().max())))
                if not rep.baseline_passed:
                    failures.append(f"{backend} {name} {rep.max_abs:.2e} (textbook {rep.base_max_abs:.2e}) {case}")
    assert not failures, "\n".join(failures)


def _run(fn, *args, **kw):
    """``fn(*args, **kw)``, or None where the named backend does not take the problem (its ValueError says so)."""
    try:
        return fn(*args, **kw)
    except ValueError as err:
        if "cannot run this problem" in str(err):
            return None
        raise


def test_random_paged_caches_and_appends_cpu():
    """Paged caches (block sizes 1, 4 and 16, permuted tables) with kv_len, and k_new / v_new appended: the
    output against the reference on caches written by hand, and the caches after the call."""
    rng, gen = random.Random(SEED + 5), torch.Generator().manual_seed(SEED + 5)
    failures = []
    for _ in range(80):
        B, Hkv, D = rng.randint(1, 3), rng.choice([1, 2]), rng.choice([16, 32])
        Hq, bs, blocks = Hkv * rng.choice([1, 4]), rng.choice([1, 4, 16]), rng.randint(1, 6)
        n_blocks, Nq, layout = B * blocks + rng.randint(0, 3), rng.choice([1, 1, 2, 5]), rng.choice(["bhnd", "bnhd"])
        k_cache, v_cache = (torch.randn(n_blocks, bs, Hkv, D, generator=gen) for _ in range(2))
        table = torch.randperm(n_blocks, generator=gen)[: B * blocks].view(B, blocks).to(torch.int32)
        n_new = min(rng.choice([0, 0, 1, 3]), blocks * bs)
        kw = dict(block_table=table, kv_len=[rng.randint(0, blocks * bs - n_new) for _ in range(B)])
        if rng.random() < 0.4:
            kw.update(causal=True, align="bottom_right")
        if rng.random() < 0.2:
            kw["softcap"] = 20.0
        if rng.random() < 0.2:
            kw["sinks"] = torch.randn(Hq, generator=gen)
        q = torch.randn(*((B, Hq, Nq, D) if layout == "bhnd" else (B, Nq, Hq, D)), generator=gen)
        k_want, v_want, ref_kw = k_cache.clone(), v_cache.clone(), dict(kw)
        if n_new:
            new_shape = (B, Hkv, n_new, D) if layout == "bhnd" else (B, n_new, Hkv, D)
            kw["k_new"], kw["v_new"] = (torch.randn(*new_shape, generator=gen) for _ in range(2))
            for b in range(B):
                for t in range(n_new):
                    j = kw["kv_len"][b] + t
                    at = (table[b, j // bs], j % bs)
                    pick = (b, slice(None), t) if layout == "bhnd" else (b, t)
                    k_want[at], v_want[at] = kw["k_new"][pick], kw["v_new"][pick]
            ref_kw["kv_len"] = [n + n_new for n in kw["kv_len"]]
        ref, ref_lse = attnlab.reference(q, k_want, v_want, layout=layout, **ref_kw)
        for backend in ("triton", "auto", "torch", "sdpa"):
            k_got, v_got = k_cache.clone(), v_cache.clone()
            with check.strict_fp32(), poison_outputs():  # as verify runs a backend
                got = _run(attnlab.attention, q, k_got, v_got, layout=layout, backend=backend, return_lse=True, **kw)
            if got is None:
                continue
            out, lse = got
            rep = check.compare(out, ref)
            lse_ok = check.compare(lse, ref_lse, dtype=torch.float32, atol=check._lse_atol(torch.float32), rtol=0.0)
            caches = torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
            if not (rep.passed and lse_ok.passed and caches):
                failures.append(f"{backend} B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} D{D} block {bs} x {blocks} {layout} "
                                f"new {n_new} caches {caches} {kw}: {rep}")
    assert not failures, "\n".join(failures)
