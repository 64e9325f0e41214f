"""attnlab.fast_calls on the host: which calls have a signature, what it holds, and the cached entry's lengths."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import attnlab
from attnlab import fast_calls as calls


def _sig(q, k, v, **kw):
    args = dict(kv_len=None, q_len=None, mask=None, block_table=None, causal=False, window=None, align=None,
                scale=None, layout="bhnd", backend="auto", want_lse=False)
    args.update(kw)
    return calls.signature(q, k, v, **args)


class _CudaLike(torch.Tensor):
    pass


def test_cpu_calls_and_tensor_subclasses_take_the_whole_way():
    q = torch.randn(1, 2, 8, 4)
    assert _sig(q, q, q) is None
    assert _sig(q.as_subclass(_CudaLike), q, q) is None


def test_cpu_calls_leave_nothing_behind():
    calls.clear()
    q = torch.randn(1, 2, 8, 4)
    attnlab.attention(q, q, q, causal=True)
    assert not calls._CALLS


@pytest.mark.parametrize("kw", [
    dict(kv_len=[3]), dict(kv_len=torch.tensor([3])), dict(q_len=torch.tensor([3])), dict(kv_len=True),
    dict(causal=1), dict(scale=True), dict(window=(1, True)), dict(window=[[1], 2]),
    dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), dict(mask=torch.ones(8, 8, dtype=torch.bool)),
    dict(scale=np.float32(0.5)), dict(scale=Fraction(1, 2)),
])
def test_host_values_and_odd_keywords_have_no_signature(kw, monkeypatch):
    """Host lengths and masks are validated by value; keywords of the wrong type must reach the validation
    (a bool equals an int in a dict key)."""
    q = torch.randn(1, 2, 8, 4)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert _sig(q, q, q) is not None  # the patched q passes as a GPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.dim() == 4))
    assert _sig(q, q, q, **kw) is None


def test_the_signature_holds_layout_strides_values_and_keywords(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.randn(1, 2, 8, 4)
    base = _sig(q, q, q, causal=True, kv_len=5)
    assert base == _sig(torch.randn(1, 2, 8, 4), q, q, causal=True, kv_len=5)  # values do not count
    others = [
        _sig(q.transpose(2, 3).contiguous().transpose(2, 3), q, q, causal=True, kv_len=5),
        _sig(q, q, q, causal=True, kv_len=6),
        _sig(q, q, q, causal=False, kv_len=5),
        _sig(q, q, q, causal=True, kv_len=5, want_lse=True),
        _sig(q, q, q, causal=True, kv_len=5, backend="triton"),
        _sig(q.half(), q.half(), q.half(), causal=True, kv_len=5),
        _sig(torch.randn(65)[1:].view(1, 2, 8, 4), q, q, causal=True, kv_len=5),  # 4-byte aligned only
    ]
    assert all(s is not None and s != base for s in others)
    assert len(set(others)) == len(others)


def test_an_entry_clamps_gpu_lengths_anew_and_makes_an_int_length_per_call(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_full = torch.full
    monkeypatch.setattr(torch, "full", lambda size, value, **kw: real_full(size, value, dtype=kw["dtype"]))
    entry = calls._Entry(lambda *a: seen.append(a) or ("out", None), 0, kv=(3, 5), ql=7)
    assert entry(None, None, None, 5, torch.tensor([-3, 9, 4]), None, None) == ("out", None)
    assert entry(None, None, None, 5, torch.tensor([1, 2, 3]), None, None) == ("out", None)
    (kv1, ql1), (kv2, ql2) = (a[3:5] for a in seen)
    assert kv1.dtype == torch.int32 and kv1.tolist() == [5, 5, 5] and kv2 is not kv1  # a new tensor per call
    assert ql1.dtype == torch.int32 and ql1.tolist() == [0, 7, 4] and ql2.tolist() == [1, 2, 3]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert entry(None, None, None, None, None, None, None) is None  # another GPU is current: the whole way


@pytest.mark.parametrize("kw", [
    dict(kv_len=torch.tensor(5, dtype=torch.int32)),  # 0-dim: the full path expands it to [B]
    dict(mask=torch.zeros(1, 2, 8, 8, dtype=torch.uint8)),  # neither bool nor a bias dtype the kernels read
    dict(mask=torch.zeros(1, 2, 8, 8).to(torch.float8_e4m3fn)),  # a bias the full path converts to float32
])
def test_values_the_full_path_transforms_have_no_signature(kw, monkeypatch):
    """A 0-dim length or a float8 bias is made into another tensor by the full path: the caller's own buffer
    must never reach a fast call."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.randn(1, 2, 8, 4)
    assert _sig(q, q, q, **kw) is None


def test_scale_keys_as_a_float(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.randn(1, 2, 8, 4)
    assert _sig(q, q, q, scale=1) == _sig(q, q, q, scale=1.0) != _sig(q, q, q)


def test_eviction_keeps_the_cache_bounded_and_tolerates_a_missing_key():
    cache = {i: i for i in range(5)}
    calls.evict_oldest(cache, 3)
    assert list(cache) == [3, 4]
    calls.evict_oldest({}, 0)  # an empty cache with no room: nothing to do, no error


def test_the_signature_holds_the_score_modifiers(monkeypatch):
    """The softcap by value, the slopes' and the sinks' shapes, strides and dtypes: each makes its own
    signature; values of the tensors do not."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.randn(1, 2, 8, 4)
    slopes, sinks = torch.rand(2), torch.randn(2)
    base = _sig(q, q, q, softcap=30.0, alibi_slopes=slopes, sinks=sinks)
    assert base == _sig(q, q, q, softcap=30, alibi_slopes=torch.rand(2), sinks=torch.randn(2))
    others = [
        _sig(q, q, q),
        _sig(q, q, q, softcap=20.0, alibi_slopes=slopes, sinks=sinks),
        _sig(q, q, q, softcap=30.0, alibi_slopes=torch.rand(1, 2), sinks=sinks),
        _sig(q, q, q, softcap=30.0, alibi_slopes=slopes, sinks=sinks.bfloat16()),
        _sig(q, q, q, softcap=30.0, sinks=sinks),
        _sig(q, q, q, softcap=30.0, alibi_slopes=slopes),
    ]
    assert all(s is not None and s != base for s in others)
    assert len(set(others)) == len(others)


def test_learned_sinks_as_a_parameter_have_a_signature(monkeypatch):
    """A model's sinks are an ``nn.Parameter``: under no_grad its calls are repeated calls like any other, with
    the signature of the same plain tensor; other tensor subclasses still take the whole way."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.randn(1, 2, 8, 4)
    sinks = torch.randn(2).bfloat16()
    param = torch.nn.Parameter(sinks.clone())
    assert _sig(q, q, q, sinks=param) == _sig(q, q, q, sinks=sinks) is not None
    assert _sig(q, q, q, sinks=sinks.as_subclass(_CudaLike)) is None
    frozen = torch.nn.Parameter(torch.rand(2), requires_grad=False)
    assert _sig(q, q, q, alibi_slopes=frozen) == _sig(q, q, q, alibi_slopes=torch.rand(2)) is not None
    assert _sig(q, q, q, alibi_slopes=torch.nn.Parameter(torch.rand(2))) is None  # requires grad: refused


@pytest.mark.parametrize("kw", [
    dict(softcap=np.float32(30.0)), dict(softcap=True),
    dict(alibi_slopes=torch.rand(2).half()),  # the whole way refuses it
    dict(alibi_slopes=torch.rand(2, requires_grad=True)),  # refused too
    dict(alibi_slopes=torch.rand(4)[::2]),  # [Hq] with a stride: the whole way makes a contiguous copy
    dict(sinks=torch.arange(2)),  # not floating: refused
    dict(sinks=[0.5, 0.5]), dict(alibi_slopes=[0.5, 0.25]),  # not tensors: the whole way says so
])
def test_modifiers_the_whole_way_refuses_or_copies_have_no_signature(kw, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q = torch.randn(1, 2, 8, 4)
    assert _sig(q, q, q, **kw) is None


def test_an_entry_gives_the_sinks_contiguous_in_their_dtype(monkeypatch):
    """Sinks go to the kernels contiguous and in their own dtype (the kernels compute in float32), as the whole
    way's: as given when they are contiguous, else a contiguous copy; never converted."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seen = []
    fast = lambda *a: seen.append(a) or ("out", None)
    bf16, strided = torch.randn(4).bfloat16(), torch.randn(8).bfloat16()[::2]
    calls._Entry(fast, 0, kv=None, ql=None, sinks_as_given=True)(*[None] * 7, None, bf16)
    calls._Entry(fast, 0, kv=None, ql=None, sinks_as_given=False)(*[None] * 7, None, strided)
    assert seen[0][8] is bf16
    assert seen[1][8].dtype == torch.bfloat16 and seen[1][8].is_contiguous() and torch.equal(seen[1][8], strided)
