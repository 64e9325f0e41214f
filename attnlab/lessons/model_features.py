"""Notebook 11: the features models ship with. Packed documents (the block-diagonal mask and the padding it
saves), softcap's curve and gradient, ALiBi's distance penalty, sinks as a virtual key, KV append in a decode
loop, and their recorded speed beside compiled Flex and cuDNN."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch

import attnlab
from attnlab.bench.plots import bench_dirs
from attnlab.paths import BENCH_DIR, DATA_DIR
from attnlab.score_mods import ScoreMods


# ---------------------------------------------------------------------------------------------------------
# Packed documents
# ---------------------------------------------------------------------------------------------------------
def prefix_sums(lengths: Sequence[int]) -> torch.Tensor:
    """int32 [B+1]: where each document starts in the packed stream, and the total."""
    return torch.tensor([0, *torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def packed_mask(lengths: Sequence[int], causal: bool = True) -> torch.Tensor:
    """bool [T, T] over the packed stream: token i may attend to token j when both are in one document (and,
    causal, j is not after i): the block-diagonal mask that ``attention_varlen`` never materializes."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.ones_like(allowed).tril()
    return allowed


def padding_saved(lengths: Sequence[int]) -> pd.DataFrame:
    """Tokens and causal score pairs per head of the packed batch against the same documents padded to the
    longest (what a [B, H, max_len, D] call holds and, with a per-sequence causal mask, computes)."""
    n, longest = len(lengths), max(lengths)
    packed_pairs = sum(x * (x + 1) // 2 for x in lengths)
    padded_pairs = n * longest * (longest + 1) // 2
    total = sum(lengths)
    return pd.DataFrame(
        {"packed": [total, packed_pairs], f"padded to {longest}": [n * longest, padded_pairs]},
        index=["tokens", "causal pairs per head"],
    ).assign(**{"padded / packed": lambda d: d.iloc[:, 1] / d.iloc[:, 0]})


def varlen_against_documents(lengths: Sequence[int], *, H: int = 2, D: int = 16, seed: int = 0) -> float:
    """Max |difference| between ``attention_varlen`` on the packed stream and ``attention`` on each document
    alone (float32, causal): the packed call is the batch of documents, without the padding."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, H, D, generator=g) for _ in range(3))
    cu = prefix_sums(lengths)
    m = max(lengths)
    packed = attnlab.attention_varlen(q, k, v, cu, cu, m, m, causal=True, align="bottom_right")
    worst = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = attnlab.attention(q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), causal=True,
                                layout="bnhd")[0]
        worst = max(worst, (packed[a:b] - one).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------------------------------
# Softcap, ALiBi, sinks
# ---------------------------------------------------------------------------------------------------------
def softcap_curve(cap: float, lo: float = -120.0, hi: float = 120.0, n: int = 241) -> pd.DataFrame:
    """The capped score ``cap * tanh(s / cap)`` and its derivative ``1 - tanh^2(s / cap)`` over scores s."""
    s = torch.linspace(lo, hi, n, dtype=torch.float64)
    t = torch.tanh(s / cap)
    return pd.DataFrame({"score": s.numpy(), "capped": (cap * t).numpy(), "gradient": (1 - t * t).numpy()})


def softcap_gradient_check(cap: float = 5.0, seed: int = 0) -> float:
    """Max |difference| between attnlab's float32 gradient of q with ``softcap`` (the public call's backward)
    and float64 autograd through the rule written out in PyTorch (the tanh's derivative)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 7, 8, generator=g) * 3 for _ in range(3))
    dout = torch.randn(1, 2, 7, 8, generator=g)
    leaf = q.clone().requires_grad_()
    (got,) = torch.autograd.grad(attnlab.attention(leaf, k, v, softcap=cap), leaf, dout)
    leaf = q.double().requires_grad_()
    s = cap * torch.tanh(leaf @ k.double().transpose(-1, -2) / math.sqrt(8) / cap)
    (want,) = torch.autograd.grad(torch.softmax(s, -1) @ v.double(), leaf, dout.double())
    return (got.double() - want).abs().max().item()


def alibi_slopes(H: int) -> torch.Tensor:
    """The ALiBi paper's slopes for H heads (a power of two): 2^(-8 (h + 1) / H), float32."""
    return torch.pow(2.0, -8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H).float()


def alibi_penalty(slope: float, Nq: int, Nk: int) -> torch.Tensor:
    """[Nq, Nk]: what ALiBi adds to the scores of one head, ``-slope * |i + Nk - Nq - j|`` (the contract's
    rule: distances measured from the query's own position at the end of the keys), from the one place the
    rule is written in PyTorch (:meth:`attnlab.score_mods.ScoreMods.scores`) applied to zero scores."""
    mods = ScoreMods(alibi=torch.tensor([[slope]], dtype=torch.float32))
    zeros = torch.zeros(1, 1, Nq, Nk, dtype=torch.float64)
    return mods.scores(zeros, 0, torch.tensor([Nq]), torch.tensor([Nk]))[0, 0]


def alibi_as_bias_check(H: int = 4, Nq: int = 6, Nk: int = 10, seed: int = 0) -> float:
    """Max |difference| between ``alibi_slopes`` and the same penalty passed as an explicit float bias."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, Nq, 16, generator=g)
    k, v = torch.randn(1, H, Nk, 16, generator=g), torch.randn(1, H, Nk, 16, generator=g)
    slopes = alibi_slopes(H)
    bias = torch.stack([alibi_penalty(float(s), Nq, Nk) for s in slopes]).unsqueeze(0).float()
    a = attnlab.attention(q, k, v, alibi_slopes=slopes)
    b = attnlab.attention(q, k, v, mask=bias)
    return (a - b).abs().max().item()


def sink_rows(sink: float = 1.5, seed: int = 0) -> pd.DataFrame:
    """One head, three query rows, five keys; row 2 has no allowed key. Without and with a sink: each row's
    weight on its keys (the sink takes the rest), the output's norm and the lse."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64) for n in (3, 5, 5))
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 2, :] = False
    sinks = torch.tensor([sink], dtype=torch.float64)
    rows = []
    for name, kw in (("no sink", {}), (f"sink {sink:g}", {"sinks": sinks})):
        out, lse = attnlab.reference(q, k, v, mask=mask, **kw)  # float64: the contract itself
        scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, float("-inf"))
        on_keys = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num().sum(-1)
        for i in range(3):
            rows.append({"call": name, "row": i, "weight on keys": on_keys[0, 0, i].item(),
                         "|out|": out[0, 0, i].norm().item(), "lse": lse[0, 0, i].item()})
    return pd.DataFrame(rows).set_index(["call", "row"])


# ---------------------------------------------------------------------------------------------------------
# KV append
# ---------------------------------------------------------------------------------------------------------
def decode_loop(steps: int = 4, *, prompt: int = 6, capacity: int = 16, B: int = 2, Hq: int = 4, Hkv: int = 2,
                D: int = 16, seed: int = 0) -> pd.DataFrame:
    """A decode loop: a prompt of ``prompt`` keys in a cache of ``capacity``, then ``steps`` steps that each
    write one new key and value with the call (``k_new``/``v_new``, ``kv_len`` the length before) and attend
    over the longer cache. Each step's output against attention over the whole sequence so far, passed at once."""
    g = torch.Generator().manual_seed(seed)
    k_all = torch.randn(B, Hkv, prompt + steps, D, generator=g)
    v_all = torch.randn(B, Hkv, prompt + steps, D, generator=g)
    k_cache = torch.zeros(B, Hkv, capacity, D)
    v_cache = torch.zeros(B, Hkv, capacity, D)
    k_cache[:, :, :prompt], v_cache[:, :, :prompt] = k_all[:, :, :prompt], v_all[:, :, :prompt]
    rows = []
    for t in range(steps):
        n = prompt + t  # keys in the cache before this step
        q = torch.randn(B, Hq, 1, D, generator=g)
        kv_len = torch.full((B,), n, dtype=torch.int32)
        out = attnlab.attention(q, k_cache, v_cache, k_new=k_all[:, :, n:n + 1], v_new=v_all[:, :, n:n + 1],
                                kv_len=kv_len)
        want = attnlab.attention(q, k_all[:, :, :n + 1], v_all[:, :, :n + 1])
        written = torch.equal(k_cache[:, :, n], k_all[:, :, n]) and torch.equal(v_cache[:, :, n], v_all[:, :, n])
        rows.append({"step": t, "keys before": n, "keys attended": n + 1, "written into the cache": written,
                     "max |out - whole sequence|": (out - want).abs().max().item()})
    return pd.DataFrame(rows).set_index("step")


# ---------------------------------------------------------------------------------------------------------
# Recorded speed
# ---------------------------------------------------------------------------------------------------------
def _csv(name: str, gpu: str | None) -> pd.DataFrame | None:
    """``<gpu>/<name>.csv`` from the recorded GPU folders (:func:`attnlab.bench.plots.bench_dirs`: the first by
    name that has it when ``gpu`` is None), read as written (the varlen suite has columns of its own)."""
    for d in bench_dirs(BENCH_DIR):
        if (gpu is None or d.name == gpu) and (d / f"{name}.csv").is_file():
            df = pd.read_csv(d / f"{name}.csv")
            df.attrs["gpu"] = d.name
            return df
    return None


def _ms(df: pd.DataFrame, case: str, backend: str, mode: str | None = None) -> float | None:
    sel = (df["case"] == case) & (df["backend"] == backend) & (df["status"] == "ok")
    if mode is not None:
        sel &= df["mode"] == mode
    got = df.loc[sel, "ms"]
    return float(got.iloc[0]) if len(got) else None


def speed_table(gpu: str | None = None) -> pd.DataFrame | None:
    """attnlab's recorded speed with each feature: the rival's time over attnlab's (> 1: attnlab is faster),
    from the ``scoremod`` and ``varlen`` suites (``data/bench/<gpu>/``), forward and backward alone; None
    before they are recorded."""
    sm = _csv("scoremod", gpu)
    if sm is None:
        return None
    vl = _csv("varlen", sm.attrs["gpu"])  # the same GPU's folder
    rows = []
    base = "bf16_b4_h16_n4096_d128"
    for mask in ("full", "causal"):
        for tag, rivals in (("softcap50", ("flex",)), ("alibi", ("flex", "sdpa-cudnn"))):
            for mode, suffix in (("forward", "fwd"), ("backward", "bwd")):
                case = f"{base}_{mask}_{tag}_{suffix}"
                ours = _ms(sm, case, "auto")
                for rival in rivals:
                    theirs = _ms(sm, case, rival)
                    if ours and theirs:
                        rows.append({"feature": f"{tag} ({mask})", "pass": mode, "rival": rival,
                                     "attnlab ms": ours, "rival ms": theirs, "rival / attnlab": theirs / ours})
    if vl is not None:
        for mode, name in (("fwd", "forward"), ("bwd", "backward")):
            ours = _ms(vl, "gqa32_8_d128", "attnlab", mode)
            for rival in ("flex", "varlen_attn", "sdpa-cudnn"):
                theirs = _ms(vl, "gqa32_8_d128", rival, mode)
                if ours and theirs:
                    rows.append({"feature": "packed documents", "pass": name,
                                 "rival": rival + (" (padded)" if rival.startswith("sdpa") else ""),
                                 "attnlab ms": ours, "rival ms": theirs, "rival / attnlab": theirs / ours})
    out = pd.DataFrame(rows)
    out.attrs["gpu"] = sm.attrs["gpu"]
    return out


def modifier_cost(gpu: str | None = None) -> pd.DataFrame | None:
    """The recorded time of calls with sinks (training) and of decode with sinks, softcap or a KV append, over
    the same call without them (< 1.05: the issue's bound for sinks), from one GPU's folder; None before the
    scoremod suite is recorded (the decode rows are left out while only they are missing)."""
    sm = _csv("scoremod", gpu)
    if sm is None:
        return None
    dec = _csv("scoremod-decode", sm.attrs["gpu"])  # the same GPU's folder; its rows only where recorded
    rows = []
    for base in ("bf16_b4_h16_n4096_d128_full", "bf16_b4_h16_n4096_d128_causal",
                 "bf16_b2_hq64_hkv8_n4096_d64_window128"):
        a, p = _ms(sm, f"{base}_sinks_fwdbwd", "auto"), _ms(sm, f"{base}_plain_fwdbwd", "auto")
        if a and p:
            rows.append({"call": base.removeprefix("bf16_") + ", fwd+bwd", "with": "sinks", "time / plain": a / p})
    b = "bf16_b8_hq32_hkv8_nk32768_d128"
    for cache, backend in (("dense", "auto"), ("paged", "auto-paged16")) if dec is not None else ():
        plain1, plain4 = _ms(dec, f"{b}_nq1_plain", backend), _ms(dec, f"{b}_nq4_causal_br_plain", backend)
        # the plain call with GPU lengths kv_len = Nk, as the append call has them (recorded from 2026-12-04)
        lens1, lens4 = _ms(dec, f"{b}_nq1_plain_kvlen", backend), _ms(dec, f"{b}_nq4_causal_br_plain_kvlen", backend)
        for what, case, plain in (("sinks", f"{b}_nq1_sinks", plain1), ("softcap", f"{b}_nq1_softcap50", plain1),
                                  ("append 1", f"{b}_nq1_append1", plain1),
                                  ("append 4", f"{b}_nq4_causal_br_append4", plain4),
                                  ("append 1 (plain with kv_len)", f"{b}_nq1_append1", lens1),
                                  ("append 4 (plain with kv_len)", f"{b}_nq4_causal_br_append4", lens4)):
            got = _ms(dec, case, backend)
            if got and plain:
                rows.append({"call": f"decode B8 Hq32 Nk32k, {cache}", "with": what, "time / plain": got / plain})
    return pd.DataFrame(rows)


def _latest_record(stem: str, gpu: str) -> tuple[str, dict] | None:
    """The newest ``data/experiments/<gpu>/<stem>-<commit>.json`` (by its recorded ``date_utc``; files without
    one count as oldest, then by name) and its contents; None when there is none."""
    import json

    found = [(p.name, json.loads(p.read_text())) for p in (DATA_DIR / "experiments" / gpu).glob(f"{stem}-*.json")]
    if not found:
        return None
    return max(found, key=lambda f: (str(f[1].get("environment", {}).get("date_utc", "")), f[0]))


def sinks_replay(gpu: str = "nvidia-h200") -> pd.DataFrame | None:
    """The gpt-oss-like window layer's fwd+bwd plain, with sinks and with sinks requiring grad (from
    ``data/experiments/<gpu>/window-sinks-graph-<commit>.json``): GPU time by CUDA-graph replay and eager wall
    time, each also over the plain call's; None before it is recorded."""
    got = _latest_record("window-sinks-graph", gpu)
    if got is None:
        return None
    rec = got[1]
    out = pd.DataFrame(rec["rows"]).set_index("variant")[["graph_ms", "graph_over_plain", "eager_ms",
                                                            "eager_over_plain"]]
    out.attrs["commit"] = str(rec["environment"].get("commit", "?"))[:7]
    return out


def provider_steps(gpu: str = "nvidia-h200") -> pd.DataFrame | None:
    """The recorded training steps through SDPA's flash backend, PyTorch's kernel against attnlab's as its
    provider (``python -m attnlab.bench.llama_sdpa`` and ``.varlen_attn_step``, from
    ``data/experiments/<gpu>/``): one row per model, the step times, their ratio (> 1: attnlab faster), the calls
    attnlab served per step, and whether every check of the run passed; None before either is recorded."""
    rows = []
    for stem, rival in (("llama-sdpa", "sdpa-flash"), ("varlen-attn-step", "pytorch-flash")):
        got = _latest_record(stem, gpu)
        if got is None:
            continue
        name, rec = got
        if "shape" in rec:
            sh = rec["shape"]
            model = f"transformers Llama, {sh['layers']} layers, B{sh['B']} N{sh['N']}"
        else:
            model = f"varlen_attn, {rec['batch']['docs']} packed documents"
        ms, calls = rec["timing"]["step_ms"], rec["timing"]["attnlab_calls_per_step"]
        rows.append({"model step": model, "PyTorch flash ms": ms[rival], "attnlab ms": ms["attnlab"],
                     "PyTorch / attnlab": ms[rival] / ms["attnlab"],
                     "attnlab calls (fwd, bwd, refused)": f"{calls['forward']:g}, {calls['backward']:g}, "
                                                          f"{calls['refused']:g}",
                     "checks passed": all(rec["checks"].values()),
                     "commit": str(rec["environment"].get("commit", "?"))[:7], "file": name})
    return pd.DataFrame(rows).set_index("model step") if rows else None


def client_models(gpu: str = "nvidia-h200") -> pd.DataFrame | None:
    """The recorded Gemma-2 and gpt-oss runs with attnlab as their transformers attention function
    (``python -m attnlab.bench.hf_clients``, from ``data/experiments/<gpu>/``): per model and implementation
    (eager bf16, attnlab bf16), the errors against the float32 eager model (logits: max abs; gradients: relative
    L2 over all parameters, and the worst over the attention's) and the training step's time, with whether
    every check of the run passed; None before it is recorded."""
    got = _latest_record("hf-clients", gpu)
    if got is None:
        return None
    rec = got[1]
    rows = []
    for model, row in rec["models"].items():
        for impl in ("eager", "attnlab"):
            got = row[impl]
            rows.append({"model": model, "bf16 attention": impl, "logits err": got["logits_max_abs"],
                         "grads err": got["grads_rel_l2"], "attn grads err": got["attn_grads_max_rel"],
                         "step ms": row["step_ms"][impl]})
    out = pd.DataFrame(rows).set_index(["model", "bf16 attention"])
    out.attrs.update(checks_passed=all(rec["checks"].values()), commit=str(rec["environment"]["commit"])[:7],
                     bound=rec["bound"])
    return out
