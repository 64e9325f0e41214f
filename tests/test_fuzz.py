"""Random combinations of the public call's keywords against the float64 reference.

The case lists of ``attnlab.cases`` pick each edge on purpose; these tests draw the keywords together at random
(causal or windows in either alignment, lengths, bool masks and biases, GQA, both layouts, a strided q, soft cap,
ALiBi, sinks, scales of either sign; float32 and 16-bit inputs), so that a combination no list names still meets
the contract as :func:`attnlab.check.verify` judges it (its tolerances, the textbook call as the 16-bit
baseline, TF32 off, outputs filled with NaN before a backend writes them), the lse, and a repeated call (the fast
call) equal to the first. Each test draws from its own seed (``ATTNLAB_FUZZ_SEED`` shifts them all, to explore);
a failure prints the case it drew.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import attnlab
from attnlab import check

SEED = int(os.environ.get("ATTNLAB_FUZZ_SEED", "0"))


@pytest.fixture(autouse=True)
def as_the_checker_runs():
    """float32 without TF32 and every output filled with NaN before a backend writes it, as ``verify`` runs."""
    from attnlab.api import poison_outputs

    with check.strict_fp32(), poison_outputs():
        yield


def _describe(kw: dict) -> dict:
    return {k: tuple(v.shape) if torch.is_tensor(v) else v for k, v in kw.items()}


def _lse_ok(lse: torch.Tensor, ref_lse: torch.Tensor, dtype: torch.dtype) -> bool:
    """The lse as ``verify`` judges it: within the input dtype's bound, -inf where the reference has it."""
    return check.compare(lse, ref_lse, dtype=torch.float32, atol=check._lse_atol(dtype), rtol=0.0).passed


def _keywords(rng: random.Random, gen: torch.Generator, B: int, Hq: int, Nq: int, Nk: int, device: str) -> dict:
    kw: dict = {}
    band = rng.random()
    if band < 0.25:
        kw["causal"] = True
    elif band < 0.45:
        kw["window"] = (rng.choice([None, 0, 1, 3, 7, 50]), rng.choice([None, 0, 2, 5]))
    if kw:  # (Nq != Nk needs it; either alignment is drawn)
        kw["align"] = rng.choice(["top_left", "bottom_right"])
    if rng.random() < 0.3:
        kw["kv_len"] = [rng.randint(0, Nk) for _ in range(B)]
    if rng.random() < 0.3:
        kw["q_len"] = [rng.randint(0, Nq) for _ in range(B)]
    explicit = rng.random()
    if explicit < 0.15:
        kw["mask"] = (torch.rand(B, 1, Nq, Nk, generator=gen) > 0.3).to(device)
    elif explicit < 0.25:
        kw["mask"] = torch.randn(1, Hq, Nq, Nk, generator=gen).to(device)
    if rng.random() < 0.2:
        kw["softcap"] = rng.choice([5.0, 30.0])
    if rng.random() < 0.2:
        kw["alibi_slopes"] = torch.rand(Hq, generator=gen).to(device)
    if rng.random() < 0.2:
        kw["sinks"] = torch.randn(Hq, generator=gen).to(device)
    if rng.random() < 0.2:
        kw["scale"] = rng.choice([0.1, 1.0, 2.0, -0.5])
    return kw


def _run(fn, *args, **kw):
    """``fn(*args, **kw)``, or None where the named backend does not take the problem (its ValueError says so)."""
    try:
        return fn(*args, **kw)
    except ValueError as err:
        if "cannot run this problem" in str(err):
            return None
        raise


def _tensor(gen: torch.Generator, shape: tuple, device: str = "cpu", dtype: torch.dtype = torch.float32):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _forward_cases(n: int, seed: int, device: str, dtypes: list[torch.dtype], backends: tuple[str, ...]) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    failures = []
    for _ in range(n):
        B, Hkv = rng.choice([1, 2, 3]), rng.choice([1, 2])
        Hq, Nq, Nk, D = Hkv * rng.choice([1, 2, 3]), rng.randint(1, 40), rng.randint(1, 40), rng.choice([8, 16, 24, 32])
        layout, dtype = rng.choice(["bhnd", "bnhd"]), rng.choice(dtypes)
        kw = _keywords(rng, gen, B, Hq, Nq, Nk, device)
        q_shape, kv_shape = ((B, Hq, Nq, D), (B, Hkv, Nk, D)) if layout == "bhnd" else ((B, Nq, Hq, D), (B, Nk, Hkv, D))
        if rng.random() < 0.3:  # a strided view
            q = _tensor(gen, (*q_shape[:-1], 2 * D), device, dtype)[..., ::2]
        else:
            q = _tensor(gen, q_shape, device, dtype)
        k, v = _tensor(gen, kv_shape, device, dtype), _tensor(gen, kv_shape, device, dtype)
        ref, ref_lse = attnlab.reference(q, k, v, layout=layout, **kw)
        base = None if dtype == torch.float32 else attnlab.attention(q, k, v, layout=layout, backend="torch", **kw)
        for backend in backends:
            got = _run(attnlab.attention, q, k, v, layout=layout, backend=backend, return_lse=True, **kw)
            if got is None:
                continue
            out, lse = got
            again = attnlab.attention(q, k, v, layout=layout, backend=backend, **kw)
            rep = check.compare(out, ref, base=base)
            if not (rep.passed and _lse_ok(lse, ref_lse, dtype) and torch.equal(out, again)):
                failures.append(f"{backend} {dtype} B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} Nk{Nk} D{D} {layout} "
                                f"{_describe(kw)}: {rep}")
    assert not failures, "\n".join(failures)


def test_random_keyword_combinations_cpu():
    _forward_cases(90, SEED + 1, "cpu", [torch.float32, torch.float32, torch.bfloat16, torch.float16],
                   ("triton", "sdpa", "auto"))


@pytest.mark.gpu
def test_random_keyword_combinations_gpu():
    _forward_cases(200, SEED + 2, "cuda", [torch.float32, torch.bfloat16, torch.float16], ("triton", "sdpa", "auto"))


def _grads(fn, leaves: list[torch.Tensor], dout: torch.Tensor, kw: dict, layout: str,
           dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradients of ``fn(q, k, v, **kw)`` in ``dtype`` against ``dout``: q, k, v, then the sinks' and the
    bias's where they require grad."""
    ins = [t.to(dtype).requires_grad_(True) for t in leaves]
    kw = dict(kw)
    for key in ("sinks", "mask"):
        if torch.is_tensor(kw.get(key)) and kw[key].requires_grad:
            kw[key] = kw[key].detach().to(dtype).requires_grad_(True)
            ins.append(kw[key])
    out = fn(*ins[:3], layout=layout, **kw)
    (out[0] if isinstance(out, tuple) else out).backward(dout.to(dtype))
    return [t.grad for t in ins]


def test_random_gradients_cpu():
    """dq, dk, dv (and the sinks' and a bias's, when they require grad) of ``triton`` and ``auto`` within twice
    the textbook call's error against the float64 reference's gradients, plus 1e-5 of their largest value."""
    rng, gen = random.Random(SEED + 3), torch.Generator().manual_seed(SEED + 3)
    failures = []
    for _ in range(60):
        B, Hkv = rng.choice([1, 2]), rng.choice([1, 2])
        Hq, Nq, Nk, D = Hkv * rng.choice([1, 2]), rng.randint(1, 24), rng.randint(1, 24), rng.choice([8, 16])
        layout = rng.choice(["bhnd", "bnhd"])
        kw = _keywords(rng, gen, B, Hq, Nq, Nk, "cpu")
        for key in ("sinks", "mask"):
            if torch.is_tensor(kw.get(key)) and kw[key].is_floating_point() and rng.random() < 0.7:
                kw[key] = kw[key].requires_grad_(True)
        shape = (B, Hq, Nq, D) if layout == "bhnd" else (B, Nq, Hq, D)
        kv_shape = (B, Hkv, Nk, D) if layout == "bhnd" else (B, Nk, Hkv, D)
        leaves = [torch.randn(*shape, generator=gen), torch.randn(*kv_shape, generator=gen),
                  torch.randn(*kv_shape, generator=gen)]
        dout = torch.randn(*shape, generator=gen)
        ref = _grads(attnlab.reference, leaves, dout, kw, layout, torch.float64)
        base = _grads(attnlab.attention, leaves, dout, dict(kw, backend="torch"), layout, torch.float32)
        for backend in ("triton", "auto"):
            got = _grads(attnlab.attention, leaves, dout, dict(kw, backend=backend), layout, torch.float32)
            for name, g, r, t in zip(("dq", "dk", "dv", "extra", "extra"), got, ref, base, strict=False):
                err, base_err = (g.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
                if g.isnan().any() or err > 2 * base_err + 1e-5 * max(1.0, r.abs().max().item()):
                    failures.append(f"{backend} {name} {err:.2e} (textbook {base_err:.2e}) B{B} Hq{Hq} Hkv{Hkv} "
                                    f"Nq{Nq} Nk{Nk} D{D} {layout} {_describe(kw)}")
    assert not failures, "\n".join(failures)


def test_random_packed_sequences_cpu():
    """attention_varlen against each sequence's own reference call: empty sequences, Dv != D, bands in either
    alignment, the score modifiers."""
    rng, gen = random.Random(SEED + 4), torch.Generator().manual_seed(SEED + 4)
    failures = []
    for _ in range(120):
        B, Hkv, D = rng.randint(1, 4), rng.choice([1, 2]), rng.choice([8, 16, 32])
        Hq, Dv = Hkv * rng.choice([1, 2]), rng.choice([D, 8, 24])
        lq, lk = [rng.randint(0, 20) for _ in range(B)], [rng.randint(0, 20) for _ in range(B)]
        kw: dict = {}
        band = rng.random()
        if band < 0.3:
            kw.update(causal=True, align=rng.choice(["top_left", "bottom_right"]))
        elif band < 0.5:
            kw.update(window=(rng.choice([None, 0, 2, 5]), rng.choice([None, 0, 3])),
                      align=rng.choice(["top_left", "bottom_right"]))
        if rng.random() < 0.2:
            kw["softcap"] = 20.0
        if rng.random() < 0.2:
            kw["alibi_slopes"] = torch.rand(Hq, generator=gen)
        if rng.random() < 0.2:
            kw["sinks"] = torch.randn(Hq, generator=gen)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu_q[-1]), Hq, D, generator=gen).to(dtype)
        k = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen).to(dtype)
        v = torch.randn(int(cu_k[-1]), Hkv, Dv, generator=gen).to(dtype)
        ref = torch.zeros(q.shape[0], Hq, Dv, dtype=torch.float64)
        ref_lse = torch.full((Hq, q.shape[0]), float("-inf"), dtype=torch.float64)
        for b in range(B):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            o, lse = attnlab.reference(q[rows].transpose(0, 1)[None], k[keys].transpose(0, 1)[None],
                                       v[keys].transpose(0, 1)[None], **kw)
            ref[rows], ref_lse[:, rows] = o[0].transpose(0, 1), lse[0]
        args = (q, k, v, cu_q, cu_k, max([*lq, 1]), max([*lk, 1]))
        base = None if dtype == torch.float32 else attnlab.attention_varlen(*args, backend="torch", **kw)
        for backend in ("triton", "auto"):
            got = _run(attnlab.attention_varlen, *args, backend=backend, return_lse=True, **kw)
            if got is None:
                continue
            out, lse = got
            rep = check.compare(out, ref, dtype=dtype, base=base)
            if not (rep.passed and _lse_ok(lse, ref_lse, dtype)):
                failures.append(f"{backend} {dtype} lengths q {lq} k {lk} Hq{Hq} Hkv{Hkv} D{D} Dv{Dv} "
                                f"{_describe(kw)}: {rep}")
    assert not failures, "\n".join(failures)


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
            got = _run(attnlab.attention, q, k_got, v_got, layout=layout, backend=backend, return_lse=True, **kw)
            if got is None:
                continue
            out, lse = got
            rep = check.compare(out, ref)
            caches = torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
            if not (rep.passed and _lse_ok(lse, ref_lse, torch.float32) and caches):
                failures.append(f"{backend} B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} D{D} block {bs} x {blocks} {layout} "
                                f"new {n_new} caches {caches} {_describe(kw)}: {rep}")
    assert not failures, "\n".join(failures)
