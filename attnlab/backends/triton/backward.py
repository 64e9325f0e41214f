"""The Triton backward of attention: dq, dk, dv of one validated :class:`~attnlab.problem.Problem`.

:func:`backward` takes what the forward saved (out and its lse) and the upstream gradient dout, and runs
three kernels (:mod:`attnlab.backends.triton.backward_kernels` explains the math, the tiling and the program mapping):
a preprocess (Delta = rowsum(dO * O), the base-2 lse), dK/dV with a key tile stationary (GQA/MQA groups
summed in registers, no atomics), and dQ in its own pass (deterministic, no atomics); or, with ``DQ_MODE``
``atomic``, dQ added up by atomics inside the dK/dV pass, and no third kernel. The whole contract is
supported: causal and windows in both alignments, kv_len and q_len, bool masks and additive biases (a
constant: it gets no gradient), GQA/MQA, any strides, float32 / float16 / bfloat16, D from 1 to 256.

On CUDA tensors the kernels are compiled, each with one config from a small space per dtype and padded head dim
(:func:`dkdv_candidates`, :func:`dq_candidates`): one tuned on this machine (:func:`tune`, or ``AUTOTUNE``; kept
on disk by :mod:`~attnlab.backends.triton.tune_cache`), else the shipped table's, else the first candidate; a
config that does not fit the GPU gives way to the next; :mod:`.bwd_launch` builds each launch and launches a
repeated one directly. :func:`compile_ahead` compiles them in the background while the forward runs. On sm_90,
the calls :mod:`.hopper_backward` takes run its kernel after the preprocess. On CPU tensors the kernels run
through Triton's interpreter with one small config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from concurrent.futures import Future

import torch

from attnlab.backends.triton import background, bwd_grid, configs, hopper_backward, tune_cache
from attnlab.backends.triton import bwd_launch as bl
from attnlab.backends.triton import runtime as _rt
from attnlab.backends.triton.bwd_launch import INTERPRETER_CONFIG
from attnlab.backends.triton.configs import (
    BwdConfig,
    dkdv_candidates,
    dq_candidates,
    fastest,
    padded_head_dim,
    problem_head_dim,
)
from attnlab.backends.triton.interpreter import interpreter
from attnlab.backends.triton.runtime import tile_grid
from attnlab.fast_calls import evict_oldest
from attnlab.problem import Problem

try:
    import triton

    from attnlab.backends.triton.backward_kernels import bwd_preprocess
except ImportError:  # the caller finds out when it calls backward()
    triton = None

#: Whether a GPU launch of a problem not tuned before times the candidates first (ATTNLAB_AUTOTUNE=1); by default
#: the configs come from the shipped table (:mod:`.tuned_table`) and tuning happens only when asked (:func:`tune`).
AUTOTUNE: bool = os.environ.get("ATTNLAB_AUTOTUNE", "0") == "1"
#: Whether a GPU backward may run its dQ pass on a second stream beside the dK/dV pass (ATTNLAB_BWD_STREAMS=0: one
#: stream, one pass after the other). Both passes read only what the preprocess wrote, so their grids may share
#: the GPU: dQ programs take the SMs that the dK/dV pass's last wave leaves idle. It does so when the dK/dV grid is
#: not short (:func:`~.bwd_grid.short`): below that the fork and the join cost more than the tail they fill
#: (docs/decisions.md, "The backward's two passes side by side").
TWO_STREAMS: bool = os.environ.get("ATTNLAB_BWD_STREAMS", "1") != "0"
#: How a backward computes dQ (ATTNLAB_BWD_DQ): ``pass``, its own pass over row tiles (deterministic); ``atomic``,
#: inside the dK/dV pass, added into a float32 dQ by atomics (two products fewer per tile pair; the sum's order
#: varies from run to run). ``atomic`` gives way to ``pass`` while torch.are_deterministic_algorithms_enabled(),
#: and above ONE_PASS_MAX_D (the larger padded head dim), where its dK/dV kernel spills in every candidate config.
DQ_MODES = ("pass", "atomic")
DQ_MODE: str = os.environ.get("ATTNLAB_BWD_DQ", "pass")
ONE_PASS_MAX_D = 128
#: Config pairs tuned in this process or found in the persistent cache, by tune key.
_tuned: dict[tuple, tuple[BwdConfig, BwdConfig]] = {}
#: Config pairs taken from the shipped table or the heuristic defaults, by tune key.
_picked: dict[tuple, tuple[BwdConfig, BwdConfig]] = {}
#: The one-pass mode's (:func:`one_pass`): tuned (``"bwd1"`` in the persistent cache; the shipped table has none)
#: and picked (its first candidates), by tune key.
_tuned1: dict[tuple, tuple[BwdConfig, BwdConfig]] = {}
_picked1: dict[tuple, tuple[BwdConfig, BwdConfig]] = {}


def _tables(one: bool) -> tuple[str, dict, dict]:
    """(the tune cache's kernel name, the tuned and the picked configs) of the two-pass or the one-pass mode."""
    return ("bwd1", _tuned1, _picked1) if one else ("bwd", _tuned, _picked)


def one_pass(prob: Problem) -> bool:
    """Whether ``prob``'s backward adds dQ up atomically in the dK/dV pass (:data:`DQ_MODE`)."""
    if DQ_MODE not in DQ_MODES:
        raise ValueError(f"ATTNLAB_BWD_DQ must be one of {DQ_MODES}; got {DQ_MODE!r}")
    return (DQ_MODE == "atomic" and problem_head_dim(prob) <= ONE_PASS_MAX_D
            and not torch.are_deterministic_algorithms_enabled())


# ---------------------------------------------------------------------------------------------------
# Compiling ahead: the backward's kernels compile in the background while the forward runs
# ---------------------------------------------------------------------------------------------------
#: Background compiles by :func:`_ahead_key`: the backward waits for them rather than compiling again.
_ahead: dict[tuple, list[Future]] = {}
MAX_AHEAD = 64
#: Forwards whose backward :func:`compile_ahead` has seen, by call signature, the layouts of out and lse, the mode,
#: the grid-order switch and whether the sinks require grad: a training step's repeated forward skips choosing
#: configs and building the key again (host time on every step). Emptied with the backward's other memo
#: (:func:`_forget_choices`).
_ahead_seen: dict[tuple, None] = {}


def _specialized(values) -> tuple:
    """What Triton's JIT specializes an integer argument on: whether it is 1 and whether 16 divides it."""
    return tuple((int(x) == 1, int(x) % 16 == 0) for x in values)


def _ahead_key(prob: Problem, out: torch.Tensor, cfgs: tuple[BwdConfig, BwdConfig]) -> tuple:
    """What a backward compiled ahead with configs ``cfgs`` is remembered by: the device, dtype and head dims, the
    configs, the mask and modifier constants, and the sizes, strides and addresses as the JIT specializes them
    (a key too coarse only skips a compile the launch then does itself). A new shape that maps to compiled
    variants finds its key taken and starts no background work (which would take the GIL from the call it runs
    beside)."""
    spec, mods = prob.spec, prob.mods
    ints = (*prob.q.stride(), *prob.k.stride(), *prob.v.stride(), *out.stride(), prob.Nq, prob.Nk, prob.D, prob.Dv,
            prob.Hq, prob.group, prob.q.shape[2], prob.k.shape[2], spec.left or 0, spec.right or 0)
    return (prob.device.index, prob.dtype, padded_head_dim(prob.D), padded_head_dim(prob.Dv), cfgs, one_pass(prob),
            _specialized(ints), any(abs(int(x)) >= 2**31 for x in ints),  # 64-bit integers: another signature
            tuple(t.data_ptr() % 16 == 0 for t in (prob.q, prob.k, prob.v, out)),
            configs.kind_of(prob), spec.align, mods.sinks is not None and mods.sinks.requires_grad,
            spec.explicit is not None and (spec.explicit.dtype, _specialized(spec.explicit.stride())),
            mods.alibi is not None and _specialized(mods.alibi.stride()),
            bwd_grid.tiles_outer(prob, "dkdv", cfgs[0].block_n), bwd_grid.tiles_outer(prob, "dq", cfgs[1].block_m))


def compile_ahead(prob: Problem, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Start compiling the three backward kernels of ``prob`` in background threads (Triton's compiler releases
    the GIL), for an upstream gradient laid out like ``out``, so that a first backward finds them compiled: a
    forward that will be differentiated calls this before its own launch. Nothing happens on CPU tensors, while
    tuning on every call (``AUTOTUNE``), or when this call's kernels were compiled ahead already (or it was seen
    before, :data:`_ahead_seen`); a guess that misses the real call's layout only costs the background work."""
    if triton is None or not prob.q.is_cuda or AUTOTUNE or not configs.COMPILE_AHEAD:
        return
    sinks_grad = prob.mods.sinks is not None and prob.mods.sinks.requires_grad
    seen = None if prob.packed is not None else (_rt.call_signature(prob), _rt.layout_key(out, lse), one_pass(prob),
                                                 bwd_grid.TILES_OUTER, sinks_grad)
    if seen in _ahead_seen:
        return
    if seen is not None:
        evict_oldest(_ahead_seen, MAX_AHEAD)
        _ahead_seen[seen] = None
    kv_cfg, q_cfg = configs_for(prob, *[None] * 6)  # no tuning here: the table's configs or the defaults
    key = _ahead_key(prob, out, (kv_cfg, q_cfg))
    if key in _ahead:
        return
    if len(_ahead) >= MAX_AHEAD:
        _ahead.pop(next(iter(_ahead)))
    # Stand-ins with the backward's layouts (nothing is launched): lse for the float32 rows, out for dout, and
    # q, k, v for dq, dk, dv where torch.empty_like (which makes those) keeps their strides.
    dq, dk, dv = (x if _like_its_gradient(x) else torch.empty_like(x) for x in (prob.q, prob.k, prob.v))
    # (the preprocess stores the sinks' shares when they require grad: the variant a backward without dlse runs)
    pre = bl.preprocess_launch(prob, out, lse, out, lse, lse, False, lse if sinks_grad else None)
    if one_pass(prob):  # lse stands in for the float32 dQ (with dq's strides: the kernel reads those)
        launches = (pre, bl.dkdv_launch(prob, out, lse, lse, dk, dv, kv_cfg, False, dq_acc=lse, dq_like=dq))
    else:
        launches = (pre, bl.dkdv_launch(prob, out, lse, lse, dk, dv, kv_cfg, False),
                    bl.dq_launch(prob, out, lse, lse, dq, q_cfg, False))
    _ahead[key] = [background.ahead(kernel, grid, args, kw, prob.device) for kernel, grid, args, kw in launches]


def _like_its_gradient(x: torch.Tensor) -> bool:
    """Whether ``x`` has the strides of ``torch.empty_like(x)`` (what the backward allocates its gradient as:
    the same for a dense tensor, contiguous for a view with gaps or broadcasts; asked of a meta tensor, so
    nothing is allocated) and a 16-byte aligned address (as a new allocation's)."""
    return torch.empty_like(x, device="meta").stride() == x.stride() and x.data_ptr() % 16 == 0


def _wait_ahead(prob: Problem, out: torch.Tensor) -> None:
    """Wait for the background compiles of ``prob``'s backward, if any (their errors are the real launch's)."""
    if AUTOTUNE or not configs.COMPILE_AHEAD or not _ahead:
        return
    background.wait(_ahead.get(_ahead_key(prob, out, configs_for(prob, *[None] * 6)), ()))


def _fastest(configs: list[BwdConfig], launch) -> BwdConfig:
    """The fastest of ``configs`` (see :func:`~attnlab.backends.triton.configs.fastest`)."""
    return fastest(configs, launch, "the backward")


def _spaces(prob: Problem, one: bool) -> tuple[list[BwdConfig], list[BwdConfig]]:
    """The dK/dV and dQ candidate configs of ``prob``'s GPU launch (``one``: the one-pass mode's), in the order
    its value dim and its GPU's shared memory suit (:func:`~attnlab.backends.triton.configs.wide_tiles_first`;
    off a GPU, tests: a Hopper SM's)."""
    shared = _rt.shared_optin(_rt.device_index(prob.device)) if prob.device.type == "cuda" else None
    block_d, wide = problem_head_dim(prob), configs.wide_tiles_first(padded_head_dim(prob.Dv), shared)
    return dkdv_candidates(prob.dtype, block_d, one, wide), dq_candidates(prob.dtype, block_d, wide)


def configs_for(prob: Problem, dout, delta, lse2, dq, dk, dv) -> tuple[BwdConfig, BwdConfig]:
    """(dK/dV config, dQ config) of a GPU launch (:func:`~attnlab.backends.triton.configs.choose`): tuned before,
    else the shipped table's, else each space's first candidate. With ``AUTOTUNE`` a key tuned nowhere yet is
    tuned now, which overwrites dq, dk, dv (the final launch comes after)."""
    key = configs.bwd_tune_key(prob)
    one = one_pass(prob)
    kv_space, q_space = _spaces(prob, one)
    kernel, tuned, picked = _tables(one)

    def parse(value: list) -> tuple[BwdConfig, BwdConfig] | None:
        kv, q = (BwdConfig(**c) for c in value)
        return (kv, q) if kv in kv_space and q in q_space else None

    return configs.choose(kernel, prob, key, parse, (kv_space[0], q_space[0]), tuned, picked, AUTOTUNE,
                          lambda: _tune(prob, dout, delta, lse2, dq, dk, dv, key))


def _tune(prob: Problem, dout, delta, lse2, dq, dk, dv, key: tuple) -> tuple[BwdConfig, BwdConfig]:
    """The fastest dK/dV and dQ configs of ``prob`` in its mode, stored; the one-pass mode times its dK/dV kernel
    (adding into a scratch dQ) and keeps the dQ space's first."""
    one = one_pass(prob)
    kv_space, q_space = _spaces(prob, one)
    if one:
        acc = torch.zeros_like(dq, dtype=torch.float32)
        got = (_fastest(kv_space, lambda c: bl.launch_dkdv(prob, dout, delta, lse2, dk, dv, c, False, dq_acc=acc)),
               q_space[0])
    else:
        got = (
            _fastest(kv_space, lambda c: bl.launch_dkdv(prob, dout, delta, lse2, dk, dv, c, False)),
            _fastest(q_space, lambda c: bl.launch_dq(prob, dout, delta, lse2, dq, c, False)),
        )
    tune_cache.store(_tables(one)[0], prob.device.index, key[1:], [dataclasses.asdict(c) for c in got])
    _forget_choices()
    return got


def tune(prob: Problem, out: torch.Tensor, lse: torch.Tensor) -> tuple[BwdConfig, BwdConfig]:
    """Tune ``prob``'s backward key now, given the forward's out and lse (a random upstream gradient, scratch
    gradients); keep the winners in this process and on disk, and return them."""
    dout = torch.randn_like(out)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=prob.device)
    lse2 = torch.empty_like(delta)
    bl.launch_preprocess(prob, out, lse, dout, delta, lse2, False)
    dq, dk, dv = torch.empty_like(prob.q), torch.empty_like(prob.k), torch.empty_like(prob.v)
    key = configs.bwd_tune_key(prob)
    got = _tables(one_pass(prob))[1][key] = _tune(prob, dout, delta, lse2, dq, dk, dv, key)
    _forget_choices()
    return got


# ---------------------------------------------------------------------------------------------------
# The public entry point
# ---------------------------------------------------------------------------------------------------
def _check(name: str, t: torch.Tensor, shape: tuple, prob: Problem) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    if t.device != prob.device:
        raise ValueError(f"{name} is on {t.device} but q is on {prob.device}")


def _minus_dlse(delta: torch.Tensor, dlse: torch.Tensor | None) -> None:
    """Delta -= dlse (rows with no allowed key have p = 0 everywhere: their -inf lse takes no gradient)."""
    if dlse is not None:
        delta.sub_(torch.nan_to_num(dlse.float(), nan=0.0, posinf=0.0, neginf=0.0))


def backward(prob: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
             dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of attention for ``prob`` given the upstream gradient ``dout`` (see
    :func:`gradients`, which also returns the sinks')."""
    return gradients(prob, out, lse, dout, dlse)[:3]


def _sink_shares(prob: Problem, dlse: torch.Tensor | None, interpret: bool) -> torch.Tensor | None:
    """The buffer of the preprocess's shares of the sinks' gradient (one float per program), or None: no sinks,
    or an lse gradient (which enters Delta after the preprocess: :func:`sinks_gradient` then sums in torch)."""
    if prob.mods.sinks is None or dlse is not None:
        return None
    grid = bl.preprocess_grid(prob, interpret)
    return torch.empty(grid[0] * grid[1] * grid[2], dtype=torch.float32, device=prob.device)


def _summed_shares(prob: Problem, shares: torch.Tensor) -> torch.Tensor:
    """d sinks [Hq] from the preprocess's shares, stored head-major (one row of programs per head) and negated
    (one torch op here: each costs tens of microseconds of host time)."""
    return shares.view(prob.Hq, -1).sum(dim=1)


def _sinks_result(prob: Problem, shares: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor,
                  wanted: bool) -> torch.Tensor | None:
    """d sinks of a backward: the preprocess's shares summed, else (with an lse gradient) :func:`sinks_gradient`;
    None when not ``wanted`` or without sinks."""
    if not wanted:
        return None
    return _summed_shares(prob, shares) if shares is not None else sinks_gradient(prob, lse, delta)


def sinks_gradient(prob: Problem, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """d sinks [Hq] float32 from the forward's lse and Delta - dlse (0 for rows no key reaches, before dlse):
    ``-sum over rows of p_sink * (Delta - dlse)``, ``p_sink = exp(sink - lse)``, each row's sink counted once."""
    sinks = prob.mods.kernel_sinks
    if sinks is None:
        return None
    sink = sinks.view(1, -1, 1)
    # a row no sequence covers (lse -inf: rows a too small max_seqlen leaves out) has no sink share; NaN propagates
    p_sink = torch.where(lse == float("-inf"), 0.0, torch.exp(sink - lse))
    return -(p_sink * delta).sum(dim=(0, 2))


def gradients(prob: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
              dlse: torch.Tensor | None = None, sinks_grad: bool = True,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients (dq, dk, dv, dsinks) of attention for ``prob`` given the upstream gradient ``dout``; dsinks
    is float32 [Hq], or None without sinks or when ``sinks_grad`` is False (nothing is computed for it then).

    ``out`` and ``dout`` are [B, Hq, Nq, Dv] (any strides), ``lse`` float32 [B, Hq, Nq] as the forward wrote
    them (natural log, -inf for rows with no allowed key); for a packed call [1, Hq, total, Dv] and [1, Hq, total].
    Returns tensors shaped like ``prob.q``, ``prob.k``, ``prob.v`` ([B, H, N, D], q's dtype, laid out like the
    inputs where they are dense). The bias, if any, is a constant. Rows with no allowed key and padding rows give
    dq = 0; keys no row sees give dk = dv = 0. Nothing is launched for an empty problem. ``dlse`` ([B, Hq, Nq], or
    None) is the gradient reaching the lse when the caller used it: since d lse / d s = p, it enters as Delta - dlse.
    """
    if triton is None:
        raise RuntimeError("the Triton backward needs triton (not importable)")
    packed = prob.packed
    rows = (1, prob.Hq, prob.q.shape[2]) if packed is not None else (prob.B, prob.Hq, prob.Nq)
    _check("out", out, (*rows, prob.Dv), prob)
    _check("dout", dout, (*rows, prob.Dv), prob)
    _check("lse", lse, rows, prob)
    if dout.dtype != prob.dtype:
        dout = dout.to(prob.dtype)
    if dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum(): laid out as out, so one compiled variant
        dout = torch.empty_like(out).copy_(dout)
    if lse.dtype != torch.float32:
        lse = lse.float()
    # A packed call whose sequences were not checked on the host may leave rows or keys out (a too small
    # max_seqlen): their gradients start as zeros rather than uninitialized.
    unchecked = packed is not None and not packed.checked
    new = torch.zeros_like if unchecked else torch.empty_like
    dq, dk, dv = new(prob.q), new(prob.k), new(prob.v)
    no_key = dq.numel() == 0 or dk.numel() == 0 or prob.B == 0
    interpret = not prob.q.is_cuda
    spec = prob.spec
    if no_key or (interpret and spec.kv_len is not None and not bool(spec.kv_len.any())):  # host tensor: no sync
        # every row's lse is its sink alone (or -inf): the sinks' gradient is the sum of dlse
        dsinks = None
        if prob.mods.sinks is not None and sinks_grad:
            dsinks = sinks_gradient(prob, lse, -_dlse_or_zero(dlse, lse))
        return dq.zero_(), dk.zero_(), dv.zero_(), dsinks
    # [B, Hq, Nq]; packed [1, Hq, total]. Prefix sums never checked may leave rows to no program (a too small
    # max_seqlen, or sums out of order): those rows start as Delta = 0 and lse2 = +inf, so that p = 0 wherever
    # the dK/dV pass meets them.
    delta = (torch.zeros if unchecked else torch.empty)(rows, dtype=torch.float32, device=prob.device)
    lse2 = torch.full_like(delta, float("inf")) if unchecked else torch.empty_like(delta)
    shares = _sink_shares(prob, dlse, interpret) if sinks_grad else None
    # one pass: dQ added up in float32 by the dK/dV pass, then rounded into dq
    dq_acc = torch.zeros_like(dq, dtype=torch.float32) if one_pass(prob) else None
    if interpret:
        with interpreter(bwd_preprocess):
            bl.launch_preprocess(prob, out, lse, dout, delta, lse2, True, sink_part=shares)
            _minus_dlse(delta, dlse)
            bl.launch_dkdv(prob, dout, delta, lse2, dk, dv, INTERPRETER_CONFIG, True, dq_acc=dq_acc)
            if dq_acc is None:
                bl.launch_dq(prob, dout, delta, lse2, dq, INTERPRETER_CONFIG, True)
            else:
                dq.copy_(dq_acc)
        return dq, dk, dv, _sinks_result(prob, shares, lse, delta, sinks_grad)
    same = torch.cuda.current_device() == prob.q.get_device()
    key = bl.launch_key(prob, out, dout, lse, delta, lse2, dq, dk, dv)
    if bl.preprocess_key(key, shares is not None, dq_acc is not None) not in bl.COMPILED:  # else compiled
        _wait_ahead(prob, out)
    with contextlib.nullcontext() if same else torch.cuda.device(prob.device):
        bl.launch_preprocess(prob, out, lse, dout, delta, lse2, False, key, shares, dq_acc is not None)
        _minus_dlse(delta, dlse)
        hopper_dq = hopper_backward.run(prob, dout, delta, lse2, dk, dv, dq_acc, key)  # None: refused or compiling
        if hopper_dq is not None:
            return dq.copy_(hopper_dq), dk, dv, _sinks_result(prob, shares, lse, delta, sinks_grad)
        one = dq_acc is not None
        kv_cfg, q_cfg, kv_space, q_space = _decide(prob, key, one, dout, delta, lse2, dq, dk, dv)
        kv_grid = tile_grid(prob, prob.Nk, prob.k.shape[2], kv_cfg.block_n, prob.Hkv)  # (its size, in any order)
        sms = _rt.sm_count(_rt.device_index(prob.device))

        def dkdv() -> BwdConfig:
            return bl.launch_fitting(lambda c: bl.launch_dkdv(prob, dout, delta, lse2, dk, dv, c, False, key, dq_acc),
                                     kv_cfg, kv_space, "the backward's dK/dV kernel")

        if one:
            kv_done, q_done = dkdv(), q_cfg
            dq.copy_(dq_acc)
        else:
            two = TWO_STREAMS and not bwd_grid.short(kv_grid[0] * kv_grid[1] * kv_grid[2], sms)
            kv_done, q_done = bwd_grid.side_by_side(two, dkdv,
                lambda: bl.launch_fitting(lambda c: bl.launch_dq(prob, dout, delta, lse2, dq, c, False, key), q_cfg,
                                          q_space, "the backward's dQ kernel"),
                prob.device)
        if (kv_done, q_done) != (kv_cfg, q_cfg):  # a config did not fit this GPU: keep the ones that did
            key = configs.bwd_tune_key(prob)
            _, tuned, picked = _tables(one)
            (tuned if key in tuned else picked)[key] = (kv_done, q_done)
            _forget_choices()
    return dq, dk, dv, _sinks_result(prob, shares, lse, delta, sinks_grad)


#: A GPU backward's (dK/dV config, dQ config, dK/dV space, dQ space) by mode, ``AUTOTUNE`` and launch key
#: (:func:`~.bwd_launch.launch_key`), so that a repeated backward does not choose them again: host time on every
#: training step. Emptied whenever a table changes (a tune, a config that did not fit: :func:`_forget_choices`).
_decided: dict[tuple, tuple] = {}
#: How many times the memos were emptied: a choice made across an emptying (another thread's tune) is not kept.
_forgotten = 0


def _forget_choices() -> None:
    """Empty the backward's memos of configs (a table changed)."""
    global _forgotten
    _forgotten += 1
    _decided.clear()
    _ahead_seen.clear()


def _decide(prob: Problem, key: tuple | None, one: bool, dout, delta, lse2, dq, dk, dv) -> tuple:
    """:func:`configs_for` and :func:`_spaces` of a GPU backward, remembered by its launch key (None: a packed
    call, chosen every time)."""
    memo = None if key is None else (one, AUTOTUNE, key)
    got = None if memo is None else _decided.get(memo)
    if got is None:
        before = _forgotten
        got = (*configs_for(prob, dout, delta, lse2, dq, dk, dv), *_spaces(prob, one))
        if memo is not None and before == _forgotten:
            evict_oldest(_decided, 3 * _rt.MAX_PLANS)
            _decided[memo] = got
    return got


def _dlse_or_zero(dlse: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if dlse is None:
        return torch.zeros_like(like)
    return torch.nan_to_num(dlse.float(), nan=0.0, posinf=0.0, neginf=0.0)
