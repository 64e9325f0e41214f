"""A transformers Llama that calls ``F.scaled_dot_product_attention``, run three ways on the same weights and
tokens: eager attention, SDPA on PyTorch's flash kernel, and SDPA with attnlab active as the flash provider
(:mod:`attnlab.sdpa_provider`). It reports how far the logits and one training step's gradients of each are from
eager's (the eager-vs-flash distance is the noise floor the provider is held to), the step time of each in
interleaved rounds, attnlab's calls and refusals per step, and the issue's criteria on them (:func:`checks`).

On a GPU: ``python -m attnlab.bench.llama_sdpa OUT.json`` (defaults: Hq 32, Hkv 8, D 128, 4 layers, bf16, B4 N4096,
causal, no padding mask: a mask would send SDPA to a kernel that takes masks, not to flash). transformers is
imported here only; attnlab does not depend on it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict, dataclass

import torch

from attnlab import sdpa_provider
from attnlab.bench.experiment import main as experiment_main
from attnlab.bench.experiment import run_environment, write
from attnlab.bench.timing import round_orders

VARIANTS = ("eager", "sdpa-flash", "attnlab")


@dataclass(frozen=True)
class Shape:
    B: int = 4
    N: int = 4096
    layers: int = 4
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    intermediate: int = 11008
    vocab: int = 32000


def model_and_tokens(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0):
    """A seeded Llama with random weights, and seeded tokens [B, N]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shape.Hq * shape.D, num_attention_heads=shape.Hq,
                         num_key_value_heads=shape.Hkv, head_dim=shape.D, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, vocab_size=shape.vocab, max_position_embeddings=shape.N)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    tokens = torch.randint(0, shape.vocab, (shape.B, shape.N), generator=g).to(device)
    return model, tokens


@contextlib.contextmanager
def variant(model, name: str):
    """Inside, ``model`` attends the way ``name`` says (eager, SDPA's flash kernel, or attnlab behind it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.set_attn_implementation("eager" if name == "eager" else "sdpa")
    with contextlib.ExitStack() as stack:
        if name != "eager" and model.device.type == "cuda":
            stack.enter_context(sdpa_kernel(SDPBackend.FLASH_ATTENTION))
        if name == "attnlab":
            sdpa_provider.activate()
            stack.callback(sdpa_provider.deactivate)
        yield


def step(model, tokens) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step's loss and the gradients of every attention projection (fresh each call)."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    grads = [p.grad.detach().clone() for n, p in model.named_parameters() if "self_attn" in n]
    return loss.detach(), grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def compare(model, tokens) -> dict:
    """Logits and gradients of each variant against eager's: the largest absolute logit difference and the
    largest relative gradient difference over the attention projections; attnlab's calls per step."""
    logits, grads, calls = {}, {}, {}
    for name in VARIANTS:
        with variant(model, name):
            before = sdpa_provider.stats()
            with torch.no_grad():
                logits[name] = model(tokens).logits.float()
            _, grads[name] = step(model, tokens)
            after = sdpa_provider.stats()
        calls[name] = {k: after[k] - before[k] for k in after}
    out = {}
    for name in VARIANTS[1:]:
        out[name] = {
            "logits_max_abs_vs_eager": float((logits[name] - logits["eager"]).abs().max()),
            "grads_max_rel_vs_eager": max(_relative(a, b) for a, b in zip(grads[name], grads["eager"])),
            "calls": calls[name],
        }
    out["attnlab"]["logits_max_abs_vs_sdpa_flash"] = float((logits["attnlab"] - logits["sdpa-flash"]).abs().max())
    out["attnlab"]["grads_max_rel_vs_sdpa_flash"] = max(
        _relative(a, b) for a, b in zip(grads["attnlab"], grads["sdpa-flash"]))
    return out


def time_steps(model, tokens, rounds: int = 5, steps: int = 3) -> dict:
    """Median step time (ms) of each variant over interleaved rounds, and attnlab's calls per step."""
    sync = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    per_step = {}
    for name in VARIANTS:  # warm-up: compiles, autotune-free first calls
        with variant(model, name):
            step(model, tokens)
    for order in round_orders(VARIANTS, rounds):
        for name in order:
            with variant(model, name):
                sync()
                before = sdpa_provider.stats()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(model, tokens)
                sync()
                times[name].append((time.perf_counter() - t0) * 1e3 / steps)
                after = sdpa_provider.stats()
                per_step[name] = {k: (after[k] - before[k]) / steps for k in after}
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    return {"step_ms": med, "attnlab_calls_per_step": per_step["attnlab"],
            "attnlab_over_flash": med["sdpa-flash"] / med["attnlab"]}


def checks(result: dict) -> dict[str, bool]:
    """The issue's criteria on a result: attnlab served every attention call of a step (one forward and one
    backward per layer) and refused none; its logits and gradients are no farther from eager's than twice the
    flash kernel's distance (the noise floor); its step is at least as fast as the flash kernel's."""
    layers = result["shape"]["layers"]
    calls = result["timing"]["attnlab_calls_per_step"]
    cmp = result["compare"]
    floor_logits = cmp["sdpa-flash"]["logits_max_abs_vs_eager"]
    floor_grads = cmp["sdpa-flash"]["grads_max_rel_vs_eager"]
    return {
        "served_every_call": calls["forward"] == layers and calls["backward"] == layers,
        "refused_none": calls["refused"] == 0,
        "logits_within_noise_floor": cmp["attnlab"]["logits_max_abs_vs_eager"] <= 2 * floor_logits,
        "grads_within_noise_floor": cmp["attnlab"]["grads_max_rel_vs_eager"] <= 2 * floor_grads,
        "step_at_least_flash": result["timing"]["attnlab_over_flash"] >= 1.0,
    }


def run(out: str, shape: Shape = Shape(), device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    model, tokens = model_and_tokens(shape, device, dtype)
    result = {"shape": asdict(shape), "dtype": str(dtype), "device": device,
              "environment": run_environment(device),
              "compare": compare(model, tokens), "timing": time_steps(model, tokens)}
    result["checks"] = checks(result)
    return write(result, out)


def main(argv: list[str] | None = None) -> int:
    return experiment_main("attnlab.bench.llama_sdpa", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
