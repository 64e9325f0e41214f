"""attnlab as a transformers attention function: Gemma-2's softcap, gpt-oss's sinks and both models' sliding
windows reach :func:`attnlab.attention` as keywords, with no materialized mask.

    import attnlab.transformers_attention as ta
    ta.register()                                   # the name "attnlab", once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnlab")

transformers calls the function once per layer with q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] and the layer's
keywords (``scaling``, ``sliding_window``, ``softcap``, gpt-oss's ``s_aux``: its sinks). The rules, those of
transformers' own FlashAttention path:

- causal (unless the layer's ``is_causal`` is False), aligned bottom-right: a generation step's queries are the
  last positions; a sliding window of W keeps the keys ``i - W < j <= i`` (causal layers only);
- the mask transformers builds for the name is its FlashAttention one: None without padding, else the [B, L]
  padding mask of the keys, which becomes an explicit key mask beside the causal band. k and v longer than L
  (a static cache's unfilled slots) are cut to L; a static cache needs that mask (``generate`` passes one);
- packed documents (batch 1, ``position_ids`` restarting at each document, or the ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` keywords a flattening collator adds) go to :func:`attnlab.attention_varlen`, each document
  attending only to itself;
- dropout is refused: attnlab has none.

Tested with transformers 5.17. transformers is imported here only; attnlab does not depend on it.
"""

from __future__ import annotations

from typing import Any

import torch

import attnlab


def _packed_bounds(kwargs: dict, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(cu_q, cu_k, max_q, max_k) of packed documents, or None for an unpacked batch: from the collator's
    keywords, else from position ids that restart (batch 1 only: transformers' rule)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k", kwargs["cu_seq_lens_q"])
        return (cu_q.to(torch.int32), cu_k.to(torch.int32), int(kwargs["max_length_q"]),
                int(kwargs.get("max_length_k", kwargs["max_length_q"])))
    pos = kwargs.get("position_ids")
    if pos is None or batch != 1 or pos.shape[-1] != n:
        return None
    pos = pos.reshape(-1)
    starts = (pos == pos.min()).nonzero().view(-1)
    if starts.numel() <= 1:  # one document: the plain causal call
        return None
    cu = torch.cat((starts, torch.tensor([n], device=pos.device))).to(torch.int32)
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, *, backend: str = "auto",
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """One layer's attention the way transformers calls an attention function; returns ([B, Nq, Hq, D], None)
    (no attention weights: they are never materialized)."""
    if dropout:
        raise ValueError(f"attnlab has no attention dropout; got dropout={dropout} (set attention_dropout=0)")
    causal = bool(getattr(module, "is_causal", True))
    if sliding_window is not None and not causal:
        raise ValueError("attnlab's attention function takes sliding windows on causal layers only; this layer "
                         "is bidirectional (is_causal=False)")
    window = None if sliding_window is None else (int(sliding_window) - 1, 0)
    mods = dict(scale=scaling, softcap=softcap, sinks=s_aux, backend=backend)
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError("attnlab's attention function takes transformers' FlashAttention mask (None or the "
                             f"[B, L] padding mask); got a {attention_mask.dim()}-D mask: register() sets it")
        keys = attention_mask.shape[-1]
        if keys < key.shape[2]:  # a static cache: its slots past the mask are not filled yet
            key, value = key[:, :, :keys], value[:, :, :keys]
        mask = attention_mask[:, None, None, :].bool()  # the keys' padding, for every head and row
    elif query.shape[2] == key.shape[2]:
        packed = _packed_bounds(kwargs, query.shape[0], query.shape[2])
        if packed is not None:  # [1, H, N, D] -> [N, H, D] and back
            q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
            out = attnlab.attention_varlen(q, k, v, *packed, causal=causal, window=window,
                                           align="bottom_right" if causal else None, **mods)
            return out[None], None
    align = "bottom_right" if causal else None
    # transformers wants [B, Nq, Hq, D]: the "bnhd" layout writes it directly (and its q, k, v views of
    # transformers' [B, N, H, D] projections are contiguous), no copy of the output
    bnhd = (t.transpose(1, 2) for t in (query, key, value))
    out = attnlab.attention(*bnhd, causal=causal, window=window, align=align, mask=mask, layout="bnhd", **mods)
    return out, None


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
