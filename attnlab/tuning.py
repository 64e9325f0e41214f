"""``attnlab.tune``: autotuning on request.

A GPU call never tunes unless asked: it compiles one config per kernel, taken from the configs tuned before on
this machine, else from the table shipped with the package, else the heuristic default
(:mod:`attnlab.backends.triton.tuned_table`). ``tune`` times every candidate config of the Triton forward (and of
the backward's two kernels) on the problem given, keeps the fastest in this process and in the persistent cache
(``$ATTNLAB_CACHE_DIR``, else ``~/.cache/attnlab``), so that later processes on this GPU model use them too.
``ATTNLAB_AUTOTUNE=1`` makes every new problem tune itself on its first call instead.
"""

from __future__ import annotations

from typing import Any

import torch


def tune(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backward: bool | None = None,
         **keywords: Any) -> dict[str, Any]:
    """Tune the Triton kernels for the problem of ``attention(q, k, v, **keywords)`` and keep the result.

    ``keywords`` are :func:`attnlab.attention`'s mask and layout keywords (``causal``, ``window``, ``align``,
    ``kv_len``, ``q_len``, ``mask``, ``scale``, ``layout``). ``backward`` tunes the backward kernels too; by default
    when q, k or v requires grad. The problem stands for every problem of its tune key (dtype, head dim, mask
    kind and the sizes' powers of two). Returns the chosen configs: ``{"fwd": Config, "bwd": (dK/dV config, dQ
    config)}`` (``bwd`` only when tuned). Calls made afterwards use them; nothing is tuned on CPU tensors (the
    interpreter has one config) or without triton.
    """
    from attnlab.backends.triton.forward_kernel import IMPORT_ERROR
    from attnlab.problem import make_problem

    for name in ("backend", "return_lse", "block_table"):
        if name in keywords:
            raise TypeError(f"tune() takes the problem's mask and layout keywords, not {name!r}")
    if backward is not None and not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool or None; got {backward!r}")
    if IMPORT_ERROR is not None:
        raise RuntimeError(f"attnlab.tune needs triton: {IMPORT_ERROR}")
    prob = make_problem(q.detach(), k.detach(), v.detach(), **keywords)
    if prob.device.type != "cuda":
        raise ValueError(f"attnlab.tune tunes GPU launches; got tensors on {prob.device} (the CPU interpreter runs "
                         "one fixed config)")
    if prob.descale is not None:  # (FP8: the forward alone, where the GPU has an 8-bit MMA)
        if backward:
            raise ValueError("the FP8 forward has no backward to tune; call tune() without backward=True")
        from attnlab import backends

        why = backends.why_not(backends.registry()["triton"], prob)
        if why is not None:
            raise ValueError(f"attnlab.tune cannot tune this FP8 call: {why}")
    if backward is None:
        backward = prob.descale is None and any(t.requires_grad for t in (q, k, v))
    from attnlab import fast_calls as calls
    from attnlab.backends.triton import backward as triton_backward
    from attnlab.backends.triton import configs, forward

    with torch.cuda.device(prob.device), torch.no_grad():
        out, lse = prob.new_out()[1], prob.new_lse()
        chosen: dict[str, Any] = {"fwd": configs.tune(prob, forward.autotune, out, lse)}
        if backward:  # the out and lse the backward starts from
            forward.jit_launch(prob, out, lse, chosen["fwd"], interpret=False)
            chosen["bwd"] = triton_backward.tune(prob, out, lse)
    forward.forget_plans()  # plans made before hold the configs they were made with
    calls.clear()
    return chosen
