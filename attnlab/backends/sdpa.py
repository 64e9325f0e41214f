"""Backend ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with attnlab's masks translated.

Top-left causal with Nq == Nk and nothing else goes through ``is_causal=True`` (so SDPA can pick its flash
or cuDNN kernels); every other mask (bottom-right, windows, lengths, q_len, explicit masks) is materialized
as a [B, 1 or Hq, Nq, Nk] bool mask or float bias, because that is the only other way SDPA takes one.
Rows with no allowed key are set to 0 afterwards: SDPA's own backends disagree there (math gives NaN,
cuDNN returned non-zero values on torch 2.11). ``lse`` is not exposed by SDPA: with ``return_lse`` it is
computed separately in float32, chunked. NaN in the inputs propagates as PyTorch's chosen kernel lets
it (on the recorded GPU its float32 kernel's NaN pattern differed from the contract's; attnlab does not patch it).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from attnlab.backends import Backend
from attnlab.problem import Problem
from attnlab.reference import DEFAULT_CHUNK_BYTES, masked_scores


@functools.cache
def _has_enable_gqa() -> bool:
    doc = F.scaled_dot_product_attention.__doc__ or ""
    return "enable_gqa" in doc


def sdpa_inputs(prob: Problem) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """(attn_mask, is_causal, empty_rows) that make SDPA compute ``prob``'s masking.

    ``empty_rows`` is a bool [B, Hm, Nq, 1] tensor of rows with no allowed key (None when there are none
    by construction).
    """
    spec = prob.spec
    if spec.kind == "causal" and prob.Nq == prob.Nk:
        return None, True, None
    if spec.kind == "dense":
        return None, False, None
    allowed = spec.allowed()
    if spec.bias is not None:
        bias = spec.bias.masked_fill(~allowed, float("-inf"))
        empty = (bias == float("-inf")).all(dim=-1, keepdim=True)
        return bias.to(prob.dtype), False, empty
    return allowed, False, ~allowed.any(dim=-1, keepdim=True)


class SdpaBackend(Backend):
    name = "sdpa"
    takes = ("every problem without score modifiers; masks other than plain causal are materialized for SDPA; "
             "packed sequences padded")
    description = "torch.nn.functional.scaled_dot_product_attention with attnlab's masks translated"

    def unsupported(self, prob: Problem) -> str | None:
        if prob.mods.any:
            return ("SDPA takes scores as scale * q.k plus a mask only: no soft cap, ALiBi slopes or sinks (the "
                    "reference, torch and triton backends take them)")
        return None

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        attn_mask, is_causal, empty = sdpa_inputs(prob)
        k, v, kw = prob.k, prob.v, {}
        if prob.group > 1:
            if _has_enable_gqa():
                kw["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(prob.group, dim=1), v.repeat_interleave(prob.group, dim=1)
        o = F.scaled_dot_product_attention(
            prob.q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=prob.scale, **kw
        )
        if empty is not None:
            o = o.masked_fill(empty, 0.0)
        out.copy_(o)
        if lse is not None:
            rows = max(1, DEFAULT_CHUNK_BYTES // max(1, prob.B * prob.Hq * prob.Nk * 4))
            for i0 in range(0, prob.Nq, rows):
                i1 = min(prob.Nq, i0 + rows)
                lse[:, :, i0:i1] = torch.logsumexp(masked_scores(prob, i0, i1, torch.float32), dim=-1)
