"""Backend ``torch``: the textbook PyTorch attention in the input dtype, the baseline kernels are judged by.

QK^T, scale, bias, mask, softmax, @V: each a separate op that writes the [B, Hq, Nq, Nk] scores to memory.
That is exactly what the seeds compare against (memory and error in the same low dtype). The one addition
to the textbook is the contract's empty-row rule: rows with no allowed key give 0, not NaN.
"""

from __future__ import annotations

import torch

from attnlab.backends import Backend
from attnlab.problem import FP8, Problem
from attnlab.reference import dequantized, masked_scores


class TextbookBackend(Backend):
    name = "torch"
    takes = ("every problem, in the input dtype (materializes the [B, Hq, Nq, Nk] scores); packed sequences "
             "padded; float8_e4m3fn as float32 with exp(s - row max) rounded to e4m3")
    takes_fp8 = True
    description = "textbook PyTorch in the input dtype: QK^T, mask, softmax, @V (materializes the scores)"

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        fp8 = prob.descale is not None
        if fp8:  # FP8: the real values in float32, and P rounded to e4m3 for P V
            prob = dequantized(prob, torch.float32)
        B, Hq, Hkv, Nq, Nk, Dv = prob.B, prob.Hq, prob.Hkv, prob.Nq, prob.Nk, prob.Dv
        # The scores in the input dtype, as the textbook has them; with ALiBi in float32, as a model adds a float32
        # bias: the distance term grows with the sequence, and a half type's rounding of it swamps the scores.
        dtype = torch.float32 if prob.mods.alibi is not None else prob.dtype
        s = masked_scores(prob, 0, Nq, dtype)  # [B, Hq, Nq, Nk]
        sinks = prob.mods.sinks
        if sinks is not None:  # the sink as one more key of value 0: a column of logits, dropped after the softmax
            s = torch.cat([s, sinks.to(s.dtype).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)], dim=-1)
        if fp8:  # exp(s - the keys' max) rounded to e4m3 (as an FP8 kernel's P V takes it), over the unrounded sum;
            # the sink joins the sum only, as the kernel merges it after its key tiles
            keys = s[..., :Nk]
            m = keys.amax(dim=-1, keepdim=True)
            m = m.masked_fill(m == float("-inf"), 0.0)  # an empty row: every e is 0
            e = torch.exp(keys - m)
            l = e.sum(dim=-1, keepdim=True)
            if sinks is not None:
                l = l + torch.exp(s[..., Nk:] - m)
            p = e.to(FP8).to(prob.dtype) / l.masked_fill(l == 0, 1.0)
        else:
            p = torch.softmax(s, dim=-1)
            empty = (s == float("-inf")).all(dim=-1, keepdim=True)
            p = p.masked_fill(empty, 0.0).to(prob.dtype)  # softmax of an all -inf row is NaN; the contract says 0
        pv = torch.matmul(p[..., :Nk].reshape(B, Hkv, Hq // Hkv, Nq, Nk), prob.v.unsqueeze(2))
        out.copy_(pv.reshape(B, Hq, Nq, Dv))
        if lse is not None:  # from float32 scores, as sdpa's: lse is not a textbook output, and scores grown by
            # ALiBi would lose it in a half type
            s32 = masked_scores(prob, 0, Nq, torch.float32)
            if sinks is not None:
                s32 = torch.cat([s32, sinks.float().view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)], dim=-1)
            lse.copy_(torch.logsumexp(s32, dim=-1))
