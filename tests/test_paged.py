"""The paged KV cache through the public call: every backend, the reference, gradients and the checks."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.backends import registry

B, HQ, HKV, NQ, D = 2, 4, 2, 3, 16


def _paged(block_size: int, max_blocks: int, seed: int = 0, dtype=torch.float32):
    """Caches with shuffled blocks, the table, and the same keys as dense [B, Hkv, Nk, D] tensors."""
    g = torch.Generator().manual_seed(seed)
    nb = B * max_blocks + 3
    kc = torch.randn(nb, block_size, HKV, D, generator=g, dtype=dtype)
    vc = torch.randn(nb, block_size, HKV, D, generator=g, dtype=dtype)
    table = torch.randperm(nb, generator=g)[: B * max_blocks].reshape(B, max_blocks).to(torch.int32)
    dense_k = kc[table.long()].reshape(B, max_blocks * block_size, HKV, D).transpose(1, 2)
    dense_v = vc[table.long()].reshape(B, max_blocks * block_size, HKV, D).transpose(1, 2)
    q = torch.randn(B, HQ, NQ, D, generator=g, dtype=dtype)
    return q, kc, vc, table, dense_k, dense_v


def _cpu_backends():
    q = torch.zeros(1, 1, 1, 8)
    prob = attnlab.problem.make_problem(q, q, q)
    return [n for n, b in registry().items() if b.availability().available and b.unsupported(prob) is None]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("backend", _cpu_backends())
def test_paged_equals_dense(backend, block_size):
    q, kc, vc, table, dk, dv = _paged(block_size, max_blocks=3)
    lens = [3 * block_size - 5, block_size + 1]
    kw = dict(causal=True, align="bottom_right", kv_len=lens)
    got, lse = attnlab.attention(q, kc, vc, block_table=table, backend=backend, return_lse=True, **kw)
    want, want_lse = attnlab.attention(q, dk, dv, backend=backend, return_lse=True, **kw)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
    ref, _ = attnlab.reference(q, kc, vc, block_table=table, **kw)
    assert attnlab.check.compare(got, ref).passed


def test_paged_bnhd_query_and_garbage_past_the_lengths():
    q, kc, vc, table, dk, dv = _paged(16, max_blocks=4, seed=1)
    table[1, 2:] = 10**6  # blocks past sequence 1's keys are never read: anything may stand there
    kw = dict(kv_len=[64, 20])
    got = attnlab.attention(q.transpose(1, 2), kc, vc, block_table=table, layout="bnhd", backend="triton-decode",
                            **kw)
    ref, _ = attnlab.reference(q, dk, dv, **kw)
    assert attnlab.check.compare(got.transpose(1, 2), ref).passed


def test_paged_gradients_reach_the_caches():
    q, kc, vc, table, dk, dv = _paged(16, max_blocks=2, seed=2)
    kw = dict(kv_len=[32, 7])
    leaves = [t.clone().requires_grad_() for t in (q, kc, vc)]
    attnlab.attention(*leaves, block_table=table, **kw).square().sum().backward()
    dense = [t.clone().requires_grad_() for t in (q, dk, dv)]
    attnlab.attention(*dense, **kw).square().sum().backward()
    torch.testing.assert_close(leaves[0].grad, dense[0].grad)
    gk = torch.zeros_like(kc).index_put_((table.long().reshape(-1),),
                                         dense[1].grad.transpose(1, 2).reshape(-1, 16, HKV, D), accumulate=True)
    torch.testing.assert_close(leaves[1].grad, gk)


@pytest.mark.parametrize(
    ("change", "error", "says"),
    [
        (lambda q, kc, vc, t: (q, kc, vc, t.long()), ValueError, "int32"),
        (lambda q, kc, vc, t: (q, kc, vc, t[:1]), ValueError, "[B=2"),
        (lambda q, kc, vc, t: (q, kc[..., :8], vc[..., :8], t), ValueError, "head dim"),
        (lambda q, kc, vc, t: (q, kc, vc.half(), t), TypeError, "dtype"),
        (lambda q, kc, vc, t: (q, kc, vc, t.clone().fill_(99)), ValueError, "[0, num_blocks)"),
        (lambda q, kc, vc, t: (q, kc[0], vc[0], t), ValueError, "caches"),
    ],
)
def test_bad_paged_input_is_refused(change, error, says):
    q, kc, vc, table, _, _ = _paged(16, max_blocks=2, seed=3)
    q, kc, vc, table = change(q, kc, vc, table)
    with pytest.raises(error, match=None) as err:
        attnlab.attention(q, kc, vc, block_table=table)
    assert says in str(err.value)
