"""attnlab as SDPA's flash provider (attnlab.sdpa_provider): registration on import, activation, and the ops'
meaning (PyTorch's flash kernel's), on the CPU through the interpreter and, marked ``gpu``, through
``F.scaled_dot_product_attention`` on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

import attnlab
from attnlab import sdpa_provider as provider

attention_registry = pytest.importorskip("torch.nn.attention")
HAS_REGISTRY = provider.available()
needs_registry = pytest.mark.skipif(not HAS_REGISTRY, reason=f"torch {torch.__version__} has no flash registry")


@contextlib.contextmanager
def _active():
    provider.activate()
    try:
        yield
    finally:
        provider.deactivate()


@needs_registry
def test_import_registers_and_activates_nothing():
    assert "attnlab" in attention_registry.list_flash_attention_impls()
    assert attention_registry.current_flash_attention_impl() != "attnlab"
    assert not provider.active()


def _served_by_attnlab(op: str) -> bool:
    """Whether the dispatcher's CUDA kernel of ``aten::<op>`` is the one attnlab registered."""
    lines = torch._C._dispatch_dump(f"aten::{op}").splitlines()
    return any("CUDA" in line and "sdpa_provider" in line for line in lines)


@needs_registry
def test_activation_and_deactivation():
    ops = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
           "_flash_attention_forward", "_flash_attention_backward")
    for _ in range(2):  # activate, deactivate, and again
        with _active():
            assert provider.active() and attention_registry.current_flash_attention_impl() == "attnlab"
            assert all(_served_by_attnlab(op) for op in ops)
            provider.activate()  # again: replaces itself
            assert provider.active() and all(_served_by_attnlab(op) for op in ops)
        assert not provider.active()
        assert not any(_served_by_attnlab(op) for op in ops)


def test_without_a_registry_activation_says_which_torch(monkeypatch):
    monkeypatch.setattr(provider, "_registry", lambda: None)
    assert provider.register() is False and not provider.available()
    with pytest.raises(RuntimeError, match=r"no flash-attention registry.*torch 2\.11"):
        provider.activate()


CASES = [  # B, Hq, Hkv, Nq, Nk, D, is_causal
    (2, 4, 2, 37, 37, 32, True),
    (2, 4, 4, 20, 53, 32, True),  # Nq < Nk: the diagonal at the bottom right, as FlashAttention aligns it
    (1, 2, 1, 53, 20, 16, True),  # Nq > Nk: the first rows see no key
    (2, 4, 2, 33, 47, 32, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_the_ops_compute_the_flash_kernels_meaning(case):
    """The forward and the backward the dispatcher calls, run directly on CPU tensors (Triton's interpreter),
    against the float64 reference: values, lse, and gradients from the out and lse handed in."""
    B, Hq, Hkv, Nq, Nk, D, causal = case
    g = torch.Generator().manual_seed(sum(case))
    q = torch.randn(B, Nq, Hq, D, generator=g).bfloat16().transpose(1, 2)  # a view: out must take its strides
    k, v = (torch.randn(B, Hkv, Nk, D, generator=g).bfloat16() for _ in range(2))
    before = provider.stats()
    res = provider._forward(q, k, v, 0.0, causal, False, scale=0.3)
    out, lse = res[0], res[1]
    assert res[4:6] == (Nq, Nk) and out.stride() == q.stride() and lse.dtype == torch.float32
    kw = dict(causal=True, align="bottom_right") if causal else {}
    ref, ref_lse = attnlab.reference(q, k, v, scale=0.3, **kw)
    assert attnlab.check.compare(out, ref).passed
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)  # -inf rows compare equal
    dout = torch.randn(out.shape, generator=g).bfloat16()
    grads = provider._backward(dout, q, k, v, out, lse, None, None, Nq, Nk, 0.0, causal, res[6], res[7], scale=0.3)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    attnlab.reference(*leaves, scale=0.3, **kw)[0].backward(dout.double())
    for got, leaf in zip(grads, leaves):
        assert got.shape == leaf.shape and attnlab.check.compare(got, leaf.grad).passed
    after = provider.stats()
    assert (after["forward"] - before["forward"], after["backward"] - before["backward"]) == (1, 1)


@pytest.mark.parametrize(("kw", "why"), [(dict(dropout_p=0.1), "dropout_p = 0.1"),
                                         (dict(return_debug_mask=True), "return_debug_mask"),
                                         (dict(dtype=torch.float32), "float32")])
def test_what_attnlab_does_not_compute_is_refused_and_counted(kw, why):
    q = torch.randn(1, 2, 8, 16, dtype=kw.pop("dtype", torch.bfloat16))
    refused = provider.stats()["refused"]
    with pytest.raises(RuntimeError, match=why):
        provider._forward(q, q, q, **kw)
    assert provider.stats()["refused"] == refused + 1


_BR = {"align": "bottom_right"}


@pytest.mark.parametrize(("causal", "left", "right", "want"), [
    (False, -1, -1, {}), (True, -1, -1, {"causal": True, **_BR}), (False, 5, 3, {"window": (5, 3), **_BR}),
    (True, 7, -1, {"window": (7, 0), **_BR}), (True, None, None, {"causal": True, **_BR}),
    (False, -1, 0, {"causal": True, **_BR}),
])
def test_flashattentions_window_sides_are_attnlabs_window(causal, left, right, want):
    assert provider._mask_keywords(causal, left, right) == want


def _flash_allowed(Nq: int, Nk: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """FlashAttention's mask as its documentation states it: query i sees key j when i + Nk - Nq - left <= j <= i +
    Nk - Nq + right, a side of -1 unbounded, causal meaning right = 0."""
    i = torch.arange(Nq).view(-1, 1) + Nk - Nq
    j = torch.arange(Nk).view(1, -1)
    right = 0 if causal else right
    ok = torch.ones(Nq, Nk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


@pytest.mark.parametrize(("causal", "left", "right"), [(True, -1, -1), (False, -1, -1), (False, 5, 3), (True, 7, -1)])
def test_the_flash_attention_ops_dense_form(causal, left, right):
    """``_flash_attention_forward`` / ``_backward`` on [B, N, H, D] (GQA, Nq != Nk), run directly on the CPU."""
    g = torch.Generator().manual_seed(left + 10)
    B, Nq, Nk, H, Hkv, D = 2, 29, 41, 4, 2, 32
    q = torch.randn(B, Nq, H, D, generator=g).bfloat16()
    k, v = (torch.randn(B, Nk, Hkv, D, generator=g).bfloat16() for _ in range(2))
    sides = dict(window_size_left=left, window_size_right=right)
    out, lse, *_ = provider._flash_forward(q, k, v, None, None, Nq, Nk, 0.0, causal, False, **sides)
    kw = {"mask": _flash_allowed(Nq, Nk, causal, left, right)}  # FlashAttention's rule, written out here
    bhnd = [t.transpose(1, 2) for t in (q, k, v)]
    ref, ref_lse = attnlab.reference(*bhnd, **kw)
    assert out.shape == q.shape and out.stride() == q.stride()
    assert attnlab.check.compare(out.transpose(1, 2), ref).passed
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    dout = torch.randn(out.shape, generator=g).bfloat16()
    grads = provider._flash_backward(dout, q, k, v, out, lse, None, None, Nq, Nk, 0.0, causal, None, None, **sides)
    leaves = [t.double().requires_grad_() for t in bhnd]
    attnlab.reference(*leaves, **kw)[0].backward(dout.transpose(1, 2).double())
    for got, leaf in zip(grads, leaves):
        assert attnlab.check.compare(got.transpose(1, 2), leaf.grad).passed


def test_the_flash_attention_op_returns_the_querys_strides():
    """A [B, N, H, D] view of a [B, H, N, D] tensor: the output takes the view's strides (a copy), a contiguous
    query's output is attnlab's own (no copy)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 12, 16, generator=g).bfloat16().transpose(1, 2)
    out = provider._flash_forward(q, q, q, None, None, 12, 12, 0.0, True, False)[0]
    assert out.stride() == q.stride()
    plain = provider._flash_forward(q.contiguous(), q.contiguous(), q.contiguous(), None, None, 12, 12, 0.0, True,
                                    False)[0]
    assert plain.stride() == q.contiguous().stride() and torch.equal(plain, out)


@pytest.mark.parametrize(("causal", "left", "right"), [(True, -1, -1), (False, -1, -1), (False, 4, 2)])
def test_the_flash_attention_ops_packed_form(causal, left, right):
    """The packed form ``varlen_attn`` calls: [total, H, D] with prefix sums (an empty sequence among them),
    lse [H, total_q], against the float64 packed reference."""
    from attnlab.reference import reference_varlen

    g = torch.Generator().manual_seed(left + 20)
    lens_q, lens_k = [5, 17, 0, 9], [8, 17, 3, 20]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(sum(lens_k), 2, 32, generator=g).bfloat16() for _ in range(2))
    sides, mx = dict(window_size_left=left, window_size_right=right), (max(lens_q), max(lens_k))
    out, lse, *_ = provider._flash_forward(q, k, v, cu_q, cu_k, *mx, 0.0, causal, False, **sides)
    kw = provider._mask_keywords(causal, left, right)
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, *mx, **kw)
    assert lse.shape == (4, sum(lens_q)) and attnlab.check.compare(out, ref).passed
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    dout = torch.randn(out.shape, generator=g).bfloat16()
    grads = provider._flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, *mx, 0.0, causal, None, None, **sides)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference_varlen(*leaves, cu_q, cu_k, *mx, **kw)[0].backward(dout.double())
    for got, leaf in zip(grads, leaves):
        assert attnlab.check.compare(got, leaf.grad).passed


@pytest.mark.parametrize(("kw", "why"), [
    (dict(seqused_k=True), "seqused_k"), (dict(alibi_slopes=True), "alibi_slopes"),
    (dict(block_table=True), "block_table"), (dict(dropout_p=0.2), "dropout_p = 0.2"),
    (dict(return_debug_mask=True), "return_debug_mask"), (dict(dtype=torch.float32), "float32"),
    (dict(cum_seq_k=None), "without cum_seq_k"),
])
def test_the_flash_attention_op_refuses_what_it_does_not_compute(kw, why):
    q = torch.randn(6, 2, 16, dtype=kw.pop("dtype", torch.bfloat16))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    args = dict(cum_seq_q=cu, cum_seq_k=kw.pop("cum_seq_k", cu), dropout_p=kw.pop("dropout_p", 0.0),
                return_debug_mask=kw.pop("return_debug_mask", False))
    extra = {name: torch.ones(2) for name in kw}  # the tensors only need to be present
    refused = provider.stats()["refused"]
    with pytest.raises(RuntimeError, match=why):
        provider._flash_forward(q, q, q, args["cum_seq_q"], args["cum_seq_k"], 6, 6, args["dropout_p"], False,
                                args["return_debug_mask"], **extra)
    assert provider.stats()["refused"] == refused + 1


def test_attnlabs_own_refusals_are_the_providers():
    """A problem attnlab's validation turns down (k's head count not dividing q's) is a counted refusal."""
    q, k = torch.randn(1, 3, 8, 16).bfloat16(), torch.randn(1, 2, 8, 16).bfloat16()
    refused = provider.stats()["refused"]
    with pytest.raises(RuntimeError, match="cannot run this forward"):
        provider._forward(q, k, k)
    assert provider.stats()["refused"] == refused + 1


@pytest.fixture
def on_the_cpu_dispatcher():
    """The provider's kernels registered for the CPU key in a private library (the CUDA key's twin), so that the
    dispatcher binds the schemas' arguments and autograd reaches the backwards; removed afterwards."""
    lib = torch.library.Library("aten", "IMPL", "CPU")
    lib.impl("_scaled_dot_product_flash_attention", provider._forward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", provider._backward, "CPU")
    lib.impl("_flash_attention_forward", provider._flash_forward, "CPU")
    lib.impl("_flash_attention_backward", provider._flash_backward, "CPU")
    if hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"):
        lib.impl("_flash_attention_forward_no_dropout_inplace", provider._flash_forward_inplace, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def test_through_the_dispatcher_with_autograd(on_the_cpu_dispatcher):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 21, 16, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 21, 16, generator=g).bfloat16().requires_grad_() for _ in range(2))
    before = provider.stats()
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    out.backward(torch.ones_like(out))
    after = provider.stats()
    assert (after["forward"] - before["forward"], after["backward"] - before["backward"]) == (1, 1)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attnlab.reference(*leaves, causal=True)[0]
    ref.backward(torch.ones_like(ref))
    assert attnlab.check.compare(out.detach(), ref.detach()).passed
    for t, leaf in zip((q, k, v), leaves):
        assert attnlab.check.compare(t.grad, leaf.grad).passed


def test_the_flash_attention_op_through_the_dispatcher(on_the_cpu_dispatcher):
    """The packed op as varlen_attn calls it, window sides and (torch 2.13's) num_splits passed by keyword."""
    g = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, 2, 16, generator=g).bfloat16() for _ in range(3))
    kw = dict(scale=None, window_size_left=-1, window_size_right=0)
    if "num_splits" in str(torch.ops.aten._flash_attention_forward.default._schema):
        kw["num_splits"] = 1
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 11, 11, 0.0, True, False, **kw)
    from attnlab.reference import reference_varlen

    ref, _ = reference_varlen(q, k, v, cu, cu, 11, 11, causal=True, align="bottom_right")
    assert attnlab.check.compare(out, ref).passed and lse.shape == (2, 20)
    if hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"):
        into = torch.empty_like(q)
        lse2 = torch.ops.aten._flash_attention_forward_no_dropout_inplace(into, q, k, v, cu, cu, 11, 11, 0.0, True,
                                                                         False, **kw)
        assert torch.equal(into, out) and torch.equal(lse2, lse)


# ---- context parallelism: torch's ring attention over two gloo ranks, on the CPU ---------------------------

_CP_RANK = """
import datetime, json, sys
import torch, torch.distributed as dist
import attnlab
from attnlab import sdpa_provider as provider
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard

rank, store, causal, Hq, Hkv = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
lib = torch.library.Library("aten", "IMPL", "CPU")  # the provider's kernels, as on the CUDA key
lib.impl("_scaled_dot_product_flash_attention", provider._forward, "CPU")
lib.impl("_scaled_dot_product_flash_attention_backward", provider._backward, "CPU")
mesh = init_device_mesh("cpu", (2,))
_cp_options.enable_load_balance = causal  # torch's head-tail balancing is for causal attention only
g = torch.Generator().manual_seed(11)
q = torch.randn(1, Hq, 64, 16, generator=g).bfloat16()
k, v = (torch.randn(1, Hkv, 64, 16, generator=g).bfloat16() for _ in range(2))
dout = torch.randn(1, Hq, 64, 16, generator=g).bfloat16()
shards = [t.clone() for t in (q, k, v, dout)]
with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2, 2]):
    leaves = [t.detach().requires_grad_() for t in shards[:3]]
    dq, dk, dv = (DTensor.from_local(t, mesh, [Shard(2)]) for t in leaves)
    out = torch.ops.aten._scaled_dot_product_flash_attention(dq, dk, dv, 0.0, causal)[0]
    out.backward(DTensor.from_local(shards[3], mesh, [Shard(2)]))
    got = [out.to_local().contiguous()] + [t.grad for t in leaves]
got = context_parallel_unshard(mesh, got, [2, 2, 2, 2])  # back to the sequence's order
exact = [t.double().requires_grad_() for t in (q, k, v)]
ref = attnlab.reference(*exact, causal=causal)[0]
ref.backward(dout.double())
passed = [bool(attnlab.check.compare(a, b.detach()).passed) for a, b in zip(got, [ref] + [t.grad for t in exact])]
print(json.dumps(dict(passed=passed, **provider.stats())), flush=True)
dist.destroy_process_group()
"""


@needs_registry
@pytest.mark.parametrize("causal, Hq, Hkv", [(True, 4, 2), (False, 2, 2)], ids=["gqa_causal_balanced", "full"])
def test_context_parallel_rings_through_the_providers_ops(causal, Hq, Hkv, tmp_path):
    """torch's context parallelism (two gloo ranks, each holding a shard of the sequence) calls the flash ops
    once per ring step and merges the partial outputs by their lse; its backward hands the merged out and lse
    to the flash backward op. With the provider's kernels behind those ops, the unsharded output and gradients
    match the float64 reference."""
    pytest.importorskip("torch.distributed.tensor.experimental._attention")
    import json
    import subprocess
    import sys

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch has no gloo")
    store = tmp_path / "store"
    ranks, logs = [], []
    try:
        for r in range(2):  # output to files: a full pipe must not block a rank inside a collective
            out, err = (open(tmp_path / f"rank{r}.{x}", "w") for x in ("out", "err"))
            logs.append((out, err))
            ranks.append(subprocess.Popen([sys.executable, "-c", _CP_RANK, str(r), str(store), str(int(causal)),
                                           str(Hq), str(Hkv)], stdout=out, stderr=err, text=True))
        for rank in ranks:
            rank.wait(timeout=300)
    finally:
        for rank in ranks:  # a rank left waiting for its peer is stopped, never left behind
            if rank.poll() is None:
                rank.kill()
                rank.wait()
        for out, err in logs:
            out.close()
            err.close()
    for r, rank in enumerate(ranks):
        assert rank.returncode == 0, (tmp_path / f"rank{r}.err").read_text()[-3000:]
        got = json.loads((tmp_path / f"rank{r}.out").read_text().strip().splitlines()[-1])
        assert got["passed"] == [True] * 4, got  # out, dq, dk, dv
        assert (got["forward"], got["backward"], got["refused"]) == (2, 2, 0)  # one call per ring step


# ---- GPU: through F.scaled_dot_product_attention ----------------------------------------------------------


def _sdpa_flash(q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def _gpu_inputs(B, Hq, Hkv, Nq, Nk, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("case", [(2, 8, 2, 333, 333, 64, True), (1, 4, 4, 1000, 1000, 128, False),
                                  (2, 4, 1, 77, 77, 96, True)], ids=["gqa_causal", "dense_d128", "mqa_odd_d96"])
def test_sdpa_flash_runs_attnlabs_kernels_values_and_gradients(case):
    B, Hq, Hkv, Nq, Nk, D, causal = case
    q, k, v = _gpu_inputs(B, Hq, Hkv, Nq, Nk, D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator("cuda").manual_seed(1))
    before = provider.stats()
    with _active():
        out = _sdpa_flash(*leaves, is_causal=causal, enable_gqa=Hq != Hkv)
        out.backward(dout)
    after = provider.stats()
    assert (after["forward"] - before["forward"], after["backward"] - before["backward"]) == (1, 1)
    assert after["refused"] == before["refused"]
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attnlab.reference(*ref_leaves, causal=causal)[0]
    ref.backward(dout.double())
    ref = ref.detach()
    assert attnlab.check.compare(out.detach(), ref).passed
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert attnlab.check.compare(leaf.grad, ref_leaf.grad).passed
    torch.cuda.synchronize()
    plain = _sdpa_flash(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)  # deactivated: PyTorch's own again
    assert provider.stats()["forward"] == after["forward"]
    assert attnlab.check.compare(plain, ref).passed


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("shape", [(2, 4, 4, 64, 200, 64), (2, 4, 4, 200, 64, 64)], ids=["nq<nk", "nq>nk"])
def test_causal_with_unequal_lengths_means_what_pytorchs_flash_op_means(shape):
    """The op called directly (as context parallelism and varlen do), is_causal with Nq != Nk: attnlab's answer
    against PyTorch's own flash kernel's on the same inputs."""
    q, k, v = _gpu_inputs(*shape)
    op = torch.ops.aten._scaled_dot_product_flash_attention
    theirs = op(q, k, v, 0.0, True)[0]
    with _active():
        ours = op(q, k, v, 0.0, True)[0]
    assert attnlab.check.compare(ours, theirs.double()).passed


@pytest.mark.gpu
@needs_registry
def test_under_torch_compile_and_in_a_cuda_graph():
    from attnlab.bench.replay import capture

    q, k, v = _gpu_inputs(2, 8, 2, 256, 256, 64)
    before = provider.stats()["forward"]
    with _active():
        compiled = torch.compile(lambda a, b, c: _sdpa_flash(a, b, c, is_causal=True, enable_gqa=True),
                                 fullgraph=True)
        got = compiled(q, k, v)
        assert provider.stats()["forward"] > before, "the compiled call did not reach attnlab's kernels"
        assert attnlab.check.compare(got, attnlab.reference(q, k, v, causal=True)[0]).passed
        graph, out = capture(lambda: _sdpa_flash(q, k, v, is_causal=True, enable_gqa=True))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        fresh = _sdpa_flash(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, fresh)
    ref = attnlab.reference(q, k, v, causal=True)[0]
    assert attnlab.check.compare(out, ref).passed


@pytest.mark.gpu
@needs_registry
def test_varlen_attn_runs_attnlabs_kernels():
    """``torch.nn.attention.varlen.varlen_attn`` (the packed flash op) with attnlab active: values and gradients
    against attnlab's packed reference, served by attnlab (its stats count the calls)."""
    from torch.nn.attention.varlen import varlen_attn

    from attnlab.reference import reference_varlen

    g = torch.Generator(device="cuda").manual_seed(5)
    lens = [100, 7, 333, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    before = provider.stats()
    with _active():
        out = varlen_attn(*leaves, cu, cu, max(lens), max(lens), window_size=(-1, 0))  # causal
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
        out.backward(dout)
    after = provider.stats()
    assert (after["forward"] - before["forward"], after["backward"] - before["backward"]) == (1, 1)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_varlen(*ref_leaves, cu, cu, max(lens), max(lens), causal=True, align="bottom_right")[0]
    ref.backward(dout.double())
    assert attnlab.check.compare(out.detach(), ref.detach()).passed
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert attnlab.check.compare(leaf.grad, ref_leaf.grad).passed
