"""attnlab as a transformers attention function: Gemma-2's softcap, gpt-oss's sinks and both models' sliding
windows reach :func:`attnlab.attention` as keywords, with no materialized mask.

    import attnlab.transformers_attention as ta
    ta.register()                                   # the name "attnlab", once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnlab")

transformers calls the function once per layer with q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] and the layer's
keywords (``scaling``, ``sliding_window``, ``softcap``, gpt-oss's ``s_aux``: its sinks). The attention is
causal, aligned bottom-right (a generation step's queries are the last positions), and a sliding window of W
keeps the keys ``i - W < j <= i``, as transformers' own masks do. The mask transformers builds for the name is
its FlashAttention one: None without padding, else the [B, Nk] padding mask, which becomes an explicit key
mask beside the causal band. Dropout is refused: attnlab has none. transformers is imported here only;
attnlab does not depend on it.
"""

from __future__ import annotations

from typing import Any

import torch

import attnlab


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, *, backend: str = "auto",
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """One layer's attention the way transformers calls an attention function; returns ([B, Nq, Hq, D], None)
    (no attention weights: they are never materialized)."""
    if dropout:
        raise ValueError(f"attnlab has no attention dropout; got dropout={dropout} (set attention_dropout=0)")
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError("attnlab's attention function takes transformers' FlashAttention mask (None or the "
                             f"[B, Nk] padding mask); got a {attention_mask.dim()}-D mask: register() sets it")
        mask = attention_mask[:, None, None, -key.shape[2]:].bool()  # the keys' padding, for every head and row
    window = None if sliding_window is None else (int(sliding_window) - 1, 0)
    out = attnlab.attention(query, key, value, causal=True, window=window, align="bottom_right", mask=mask,
                            scale=scaling, softcap=softcap, sinks=s_aux, backend=backend)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "attnlab", backend: str = "auto") -> str:
    """Register :func:`attention_forward` (with ``backend``) under ``name`` in transformers' attention functions,
    and transformers' FlashAttention mask function for it (no 4-D mask is ever built); returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    def forward(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    return name
