"""attnlab as a transformers attention function (attnlab.transformers_attention), on the CPU: Gemma-2's softcap,
gpt-oss's sinks and both models' sliding windows against transformers' own eager attention, and the
client benchmark's criteria on a tiny shape."""

from __future__ import annotations

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
    keep[1, 40:] = 0  # the second sequence is 40 tokens, right-padded
    got = {}
    for impl in ("eager", registered):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            got[impl] = model(tokens, attention_mask=keep).logits
    assert (got[registered][keep.bool()] - got["eager"][keep.bool()]).abs().max() < 1e-4


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
        assert row["attnlab"]["attn_grads_max_rel"] <= row["attnlab"]["worst_param_rel"]
