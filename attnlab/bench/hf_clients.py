"""Two models that ship score modifiers, from transformers, with attnlab as their attention function
(:mod:`attnlab.transformers_attention`): a Gemma-2 (softcapped logits, alternating sliding and full layers) and a
gpt-oss (a learned sink per head, alternating sliding and full layers, GQA), small and with random weights.

The reference is the same model run eager in float32 (TF32 off). Against it, the bf16 model run eager and run
with attnlab: the largest absolute logit error and, for one training step, the gradients' relative L2 error over
all parameters and the largest over the attention layers' parameters. attnlab's errors are held to at most 1.5x
eager bf16's (:func:`checks`); SDPA cannot be the floor, since it ignores Gemma-2's softcap and gpt-oss does not
support it. Also counted: the attention calls attnlab served per forward (one per layer), and each variant's
training-step time.

On a GPU: ``python -m attnlab.bench.hf_clients OUT.json``. transformers is imported here only.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

import torch

from attnlab import transformers_attention
from attnlab.bench.experiment import main as experiment_main
from attnlab.bench.experiment import run_environment, write
from attnlab.bench.timing import round_orders

#: attnlab's errors may be at most this many times eager bf16's.
BOUND = 1.5


@dataclass(frozen=True)
class Shape:
    B: int = 2
    N: int = 2048
    layers: int = 4
    hidden: int = 1024
    vocab: int = 8192
    window: int = 512


def _configs(shape: Shape) -> dict:
    """The two models' configs: Gemma-2 (Hq 8, Hkv 4, D 128, softcap 50) and gpt-oss (Hq 16, Hkv 2, D 64, four
    experts), both alternating sliding and full layers."""
    from transformers import Gemma2Config, GptOssConfig

    if shape.layers % 2:
        raise ValueError(f"the models alternate sliding and full layers: layers must be even; got {shape.layers}")
    layer_types = ["sliding_attention", "full_attention"] * (shape.layers // 2)
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  sliding_window=shape.window, layer_types=layer_types, attention_dropout=0.0,
                  max_position_embeddings=max(4096, shape.N))
    return {
        "gemma2": Gemma2Config(**common, intermediate_size=2 * shape.hidden, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=shape.hidden // 8, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0, query_pre_attn_scalar=shape.hidden // 8),
        "gpt_oss": GptOssConfig(**common, intermediate_size=shape.hidden, num_attention_heads=16,
                                num_key_value_heads=2, head_dim=shape.hidden // 16, num_local_experts=4,
                                num_experts_per_tok=2),
    }


def model_and_tokens(name: str, shape: Shape, device: str, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """The seeded float32 model (gpt-oss's sinks drawn from N(0, 1), so that they matter) and seeded tokens."""
    from transformers import Gemma2ForCausalLM, GptOssForCausalLM

    cls = {"gemma2": Gemma2ForCausalLM, "gpt_oss": GptOssForCausalLM}[name]
    torch.manual_seed(seed)
    model = cls(_configs(shape)[name]).to(device=device, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            with torch.no_grad():
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    tokens = torch.randint(0, shape.vocab, (shape.B, shape.N), generator=g).to(device)
    return model, tokens


def _step(model, tokens, impl: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits, then one training step's gradients, attending the way ``impl`` says."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    model(tokens, labels=tokens).loss.backward()
    return logits, {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_errors(got: dict, want: dict) -> dict:
    """Relative L2 errors of the gradients: over all parameters at once, the largest over the attention
    layers' parameters (projections, sinks), and the worst single parameter with its name (information: a
    parameter whose float32 gradient is nearly zero can read any relative error)."""
    rel = {n: float((got[n] - w).norm() / w.norm().clamp_min(1e-30)) for n, w in want.items()}
    diff2 = sum(float((got[n] - w).pow(2).sum()) for n, w in want.items())
    ref2 = sum(float(w.pow(2).sum()) for w in want.values())
    worst = max(rel, key=rel.get)
    return {"grads_rel_l2": (diff2 / ref2) ** 0.5,
            "attn_grads_max_rel": max(r for n, r in rel.items() if "self_attn" in n),
            "worst_param": worst, "worst_param_rel": rel[worst]}


def compare(name: str, shape: Shape, device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One model's errors against its float32 eager run, eager and attnlab in ``dtype``, and attnlab's calls."""
    model, tokens = model_and_tokens(name, shape, device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref_logits, ref_grads = _step(model, tokens, "eager")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    model.to(dtype)
    served = []
    name_ = transformers_attention.register()
    real = transformers_attention.attention_forward

    def counted(*args, **kwargs):
        served.append(1)
        return real(*args, **kwargs)

    transformers_attention.attention_forward = counted
    try:
        got = {impl: _step(model, tokens, impl) for impl in ("eager", name_)}
        calls = len(served)
    finally:
        transformers_attention.attention_forward = real
    row = {}
    for impl, label in (("eager", "eager"), (name_, "attnlab")):
        logits, grads = got[impl]
        row[label] = {"logits_max_abs": float((logits - ref_logits).abs().max()), **_grad_errors(grads, ref_grads)}
    row["attnlab"]["calls_per_pass"] = calls / 2  # the no-grad forward and the training forward
    row["step_ms"] = _time_steps(model, tokens, ("eager", name_))
    return row


def _time_steps(model, tokens, impls, rounds: int = 3) -> dict:
    """Median training-step time (ms) per implementation, interleaved (information, not a criterion)."""
    sync = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    times: dict[str, list[float]] = {i: [] for i in impls}
    for order in round_orders(impls, rounds):
        for impl in order:
            model.set_attn_implementation(impl)
            sync()
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(tokens, labels=tokens).loss.backward()
            sync()
            times[impl].append((time.perf_counter() - t0) * 1e3)
    return {("attnlab" if i != "eager" else i): sorted(t)[len(t) // 2] for i, t in times.items()}


def checks(result: dict) -> dict[str, bool]:
    """Per model: attnlab served one call per layer and forward pass, and its logit and gradient errors against
    float32 are at most :data:`BOUND` times eager bf16's."""
    layers = result["shape"]["layers"]
    out = {}
    for name, row in result["models"].items():
        a, e = row["attnlab"], row["eager"]
        out[f"{name}_served_every_layer"] = a["calls_per_pass"] == layers
        out[f"{name}_logits_within_bound"] = a["logits_max_abs"] <= BOUND * e["logits_max_abs"]
        out[f"{name}_grads_within_bound"] = a["grads_rel_l2"] <= BOUND * e["grads_rel_l2"]
        out[f"{name}_attention_grads_within_bound"] = a["attn_grads_max_rel"] <= BOUND * e["attn_grads_max_rel"]
    return out


def run(out: str | None, shape: Shape = Shape(), device: str = "cuda") -> dict:
    import transformers

    result = {"shape": asdict(shape), "dtype": "bfloat16", "bound": BOUND,
              "environment": {**run_environment(device), "transformers": transformers.__version__},
              "models": {name: compare(name, shape, device) for name in ("gemma2", "gpt_oss")}}
    result["checks"] = checks(result)
    return write(result, out)


def main(argv: list[str] | None = None) -> int:
    return experiment_main("attnlab.bench.hf_clients", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
