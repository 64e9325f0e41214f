"""attnlab as a transformers attention function (attnlab.transformers_attention), on the CPU: Gemma-2's softcap,
gpt-oss's sinks and both models' sliding windows against transformers' own eager attention, and the
client benchmark's criteria on a tiny shape."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab import transformers_attention as ta  # noqa: E402
from attnlab.bench import hf_clients  # noqa: E402

TINY = hf_clients.Shape(B=2, N=48, layers=2, hidden=256, vocab=256, window=16)  # N > window: the windows bite


@pytest.fixture(scope="module")
def registered():
    return ta.register()


def _run(model, tokens, impl, **kw):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(tokens, labels=tokens, **kw)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_the_models_match_their_eager_attention_in_float32(name, registered, monkeypatch):
    model, tokens = hf_clients.model_and_tokens(name, TINY, "cpu")
    calls = []
    real = ta.attention_forward
    monkeypatch.setattr(ta, "attention_forward", lambda *a, **k: calls.append(k) or real(*a, **k))
    want_logits, want_grads = _run(model, tokens, "eager")
    got_logits, got_grads = _run(model, tokens, registered)
    assert len(calls) == TINY.layers  # every layer's attention went through attnlab
    assert {c.get("sliding_window") for c in calls} == {TINY.window, None}  # a sliding and a full layer
    assert (got_logits - want_logits).abs().max() < 1e-4
    for n, w in want_grads.items():
        assert float((got_grads[n] - w).norm() / w.norm().clamp_min(1e-30)) < 1e-4, n
    if name == "gpt_oss":
        assert all(c["s_aux"] is not None for c in calls)
        assert any("sinks" in n for n in got_grads)  # the sinks learn
    else:
        assert all(c["softcap"] == 50.0 for c in calls)


def test_a_padded_batch_masks_its_keys_like_eager(registered):
    model, tokens = hf_clients.model_and_tokens("gemma2", TINY, "cpu")
    keep = torch.ones_like(tokens)
    keep[1, :8] = 0  # the second sequence is left-padded: every kept row would see the pad keys without the mask
    got = {}
    for impl in ("eager", registered):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            got[impl] = model(tokens, attention_mask=keep).logits
    assert (got[registered][keep.bool()] - got["eager"][keep.bool()]).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_packed_documents_attend_only_within_themselves(name, registered):
    """Batch 1 with position ids restarting at each document (transformers' packing convention): each
    document's logits equal those of the document run alone."""
    model, tokens = hf_clients.model_and_tokens(name, TINY, "cpu")
    docs = [tokens[0, :20], tokens[0, 20:48]]
    packed = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        alone = torch.cat([model(d[None]).logits[0] for d in docs])
        model.set_attn_implementation(registered)
        got = model(packed, position_ids=pos).logits[0]
    assert (got - alone).abs().max() < 1e-4


def test_a_generation_step_attends_over_the_cache(registered):
    model, tokens = hf_clients.model_and_tokens("gpt_oss", TINY, "cpu")
    # transformers 5 renamed the cache argument and output field `past_key_values` to `cache` (the old name warns
    # that it will go): take whichever this version's forward names
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    got = {}
    for impl in ("eager", registered):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            first = model(tokens[:, :40], use_cache=True)
            got[impl] = model(tokens[:, 40:41], **{key: getattr(first, key)}, use_cache=True).logits
            whole = model(tokens[:, :41]).logits[:, -1:]
        assert (got[impl] - whole).abs().max() < 1e-4  # the step attended over the cache (alone it would not match)
    assert (got[registered] - got["eager"]).abs().max() < 1e-4


class _Layer(torch.nn.Module):
    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal


def test_the_function_follows_the_layer_the_mask_and_the_collators_bounds():
    import attnlab

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    got, _ = ta.attention_forward(_Layer(False), q, k, v, None)  # bidirectional: no causal band
    assert torch.allclose(got, attnlab.reference(q, k, v)[0].float().transpose(1, 2), atol=1e-5)
    with pytest.raises(ValueError, match="causal layers only"):
        ta.attention_forward(_Layer(False), q, k, v, None, sliding_window=4)
    keep = torch.ones(1, 9, dtype=torch.bool)  # a static cache of 12 slots, 9 filled
    got, _ = ta.attention_forward(_Layer(True), q[:, :, 8:], k, v, keep)
    want = attnlab.reference(q[:, :, 8:], k[:, :, :9], v[:, :, :9], causal=True, align="bottom_right")[0]
    assert torch.allclose(got, want.float().transpose(1, 2), atol=1e-5)
    cu = torch.tensor([0, 5, 12])
    got, _ = ta.attention_forward(_Layer(True), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  max_length_q=7, max_length_k=7)
    for a, b in ((0, 5), (5, 12)):
        want = attnlab.reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)[0]
        assert torch.allclose(got[:, a:b], want.float().transpose(1, 2), atol=1e-5)


def test_dropout_and_a_4d_mask_are_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no attention dropout"):
        ta.attention_forward(None, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="FlashAttention mask"):
        ta.attention_forward(None, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_the_client_benchmark_holds_attnlab_to_its_bound_on_a_tiny_shape():
    result = hf_clients.run(None, TINY, device="cpu")
    assert result["checks"] and all(result["checks"].values()), result
    for row in result["models"].values():
        assert row["attnlab"]["logits_max_abs"] > 0 and row["eager"]["grads_rel_l2"] > 0  # bf16 against float32
