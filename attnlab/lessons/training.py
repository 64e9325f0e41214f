"""A tiny causal transformer block trained on a synthetic copy task, on the CPU, through a chosen attention
function: notebook 09 trains it once with ``attnlab.attention`` and once with PyTorch's SDPA and compares the
loss curves.

The task: a sequence of ``seq`` tokens whose second half repeats the first. Predicting the next token in the
second half needs attention to the token ``seq // 2 - 1`` positions back; the first half is random and is not
scored. The model is one block: token and learned position embeddings, pre-norm causal self-attention,
a pre-norm MLP, a final norm and a linear head. Every draw is seeded by the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

import attnlab

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attnlab_attn(backend: str = "torch") -> AttnFn:
    """Causal attention of [B, H, N, D] q, k, v through ``attnlab.attention(..., backend=backend)``."""

    def fn(q, k, v):
        return attnlab.attention(q, k, v, causal=True, backend=backend)

    fn.__name__ = f"attnlab[{backend}]"
    return fn


def sdpa_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention through ``torch.nn.functional.scaled_dot_product_attention``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TinyBlock(nn.Module):
    """One pre-norm transformer block (causal self-attention + MLP) with embeddings and a head."""

    def __init__(self, vocab: int = 16, seq: int = 32, d_model: int = 32, heads: int = 2, mlp: int = 4):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp * d_model), nn.GELU(), nn.Linear(mlp * d_model, d_model))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        B, N = x.shape
        h = self.tok(x) + self.pos(torch.arange(N, device=x.device))
        q, k, v = self.qkv(self.ln1(h)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, H, N, d]
        a = attn(q, k, v).transpose(1, 2).reshape(B, N, -1)
        h = h + self.proj(a)
        h = h + self.mlp(self.ln2(h))
        return self.head(self.ln_f(h))


def copy_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the copy task: targets are the next tokens, -100 (ignored) in the first half."""
    half = seq // 2
    first = torch.randint(0, vocab, (batch, half + 1), generator=generator)
    full = torch.cat([first, first[:, 1:]], dim=1)  # length seq + 1: x_{half + 1 + t} = x_{1 + t}
    x, y = full[:, :seq], full[:, 1:seq + 1].clone()
    y[:, :half] = -100
    return x, y


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch: int = 8
    seq: int = 32
    vocab: int = 16
    d_model: int = 32
    heads: int = 2
    lr: float = 3e-3
    seed: int = 0  #: model initialization and the data stream (the same for every attention function)
    #: CPU threads while training (restored afterwards): tensors this small run fastest on one, and a busy
    #: machine makes more threads slower still
    threads: int = 1


def train(attn: AttnFn, cfg: TrainConfig = TrainConfig()) -> pd.DataFrame:
    """Train a :class:`TinyBlock` with ``attn`` for ``cfg.steps`` AdamW steps; one row per step (loss).

    The initial weights and the batches depend on ``cfg.seed`` only, so two attention functions that compute
    the same function (and gradients) give the same curve up to float32 rounding. ``df.attrs["seconds"]``
    holds the wall time. Runs on ``cfg.threads`` CPU threads.
    """
    torch.manual_seed(cfg.seed)  # nn.Module initialization draws from the global generator
    model = TinyBlock(cfg.vocab, cfg.seq, cfg.d_model, cfg.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    try:
        for _ in range(cfg.steps):
            x, y = copy_batch(cfg.batch, cfg.seq, cfg.vocab, g)
            logits = model(x, attn)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    df = pd.DataFrame({"step": range(cfg.steps), "loss": losses})
    df.attrs["seconds"] = time.perf_counter() - t0
    return df


def smoothed(df: pd.DataFrame, window: int = 20) -> pd.Series:
    """The loss as a trailing mean over ``window`` steps."""
    return df["loss"].rolling(window, min_periods=1).mean()


def compare_runs(runs: dict[str, pd.DataFrame], window: int = 20) -> pd.DataFrame:
    """One row per run: first and last ``window``-step mean loss, and the ratio of the two."""
    rows = []
    for name, df in runs.items():
        first, last = df["loss"].iloc[:window].mean(), df["loss"].iloc[-window:].mean()
        rows.append({"run": name, "first_loss": first, "final_loss": last, "final/first": last / first,
                     "seconds": df.attrs.get("seconds", float("nan"))})
    return pd.DataFrame(rows)
