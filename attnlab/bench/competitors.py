"""What is timed: each attnlab backend, SDPA restricted to one of its backends, and compiled FlexAttention
(the package docstring, "How the competitors are called")."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from attnlab.bench.counting import empty_rows
from attnlab.bench.schema import DESIGN_BACKENDS, SDPA_KINDS
from attnlab.bench.truth import CaseInputs

if TYPE_CHECKING:
    from attnlab.backends import Backend
    from attnlab.problem import Problem

# ---------------------------------------------------------------------------------------------------------
# Competitors
# ---------------------------------------------------------------------------------------------------------


class Unsupported(Exception):
    """The competitor cannot run this case (status ``unsupported``)."""


class Unavailable(Exception):
    """The competitor cannot run on this machine at all (status ``unavailable``)."""


@dataclass
class Prepared:
    """A competitor set up for one case: ``call(i)`` runs on input set i and returns out [B, Hq, Nq, D]."""

    call: Callable[[int], torch.Tensor]
    setup_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    #: rows with no allowed key, zeroed in the output before checking (competitors only)
    zero_rows: torch.Tensor | None = None
    #: called after the timed calls: a reason the timing is not valid (e.g. flex fell back to eager), or None
    after_timing: Callable[[], str | None] | None = None
    #: the first (checked) call, when it differs from ``call`` (attnlab backends: NaN-poisoned output)
    check_call: Callable[[int], torch.Tensor] | None = None
    #: called after the first call and again just before the timed calls (flex: remember dynamo's graph
    #: count; returns a note when it changed since the last mark)
    mark: Callable[[], str | None] | None = None
    #: a context every call of this competitor runs in, entered once around its checked and timed calls
    #: rather than in each (SDPA restricted to one kernel: ``sdpa_kernel``), so its cost is not timed
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    #: called just before the call whose peak memory is measured: hands back what earlier calls left held
    #: for later ones (attnlab's decode split states), so that the peak counts it
    cold: Callable[[], None] | None = None


@dataclass
class Competitor:
    """A named way to compute attention. ``prepare(inputs)`` returns a :class:`Prepared` or raises
    :class:`Unsupported` / :class:`Unavailable`. ``path``: ``public`` (the call a user makes) or ``kernel``."""

    name: str
    family: str
    prepare: Callable[[CaseInputs], Prepared]
    path: str = "public"


#: Suffix of the validate-once kernel-path competitors: ``triton-kernel`` is triton's ``backend.forward``.
KERNEL_SUFFIX = "-kernel"


def _attnlab_backend(name: str, inp: CaseInputs):
    """(backend, set 0's Problem) for an attnlab competitor, or :class:`Unavailable` / :class:`Unsupported`."""
    from attnlab import backends as _b
    from attnlab.problem import make_problem

    prob = make_problem(inp.qs[0], inp.ks[0], inp.vs[0], **inp.kw)
    grad = inp.qs[0].requires_grad
    if name == "auto":
        return _b.resolve("auto", prob, needs_grad=grad), prob
    reg = _b.registry()
    if name not in reg:
        raise Unavailable(f"backend {name!r} is not in this build (its module is missing)")
    be = reg[name]
    avail = be.availability()
    if not avail.available:
        raise Unavailable(avail.reason)
    why = _b.why_not(be, prob)
    if why is not None:
        raise Unsupported(why)
    if grad and not be.differentiable:
        raise Unsupported(f"backend {name!r} has no backward")
    return be, prob


def call_keywords(inp: CaseInputs) -> list[dict[str, Any]]:
    """The keywords of attnlab's call on each input set. An ``append`` case's call writes the cache's last
    ``append`` keys and values itself (``k_new``/``v_new``, copies made here, untimed; ``kv_len`` = Nk -
    append on the GPU): the values those positions hold already, so every call writes the same and attends as
    the plain call over all Nk keys (the truth)."""
    n = inp.case.append
    if not n:
        return [inp.kw] * inp.sets
    if "kv_len" in inp.kw or inp.kw.get("layout", "bhnd") != "bhnd":
        raise Unsupported("an append case appends to a full cache in layout bhnd")
    nk = inp.case.nk
    before = torch.full((inp.case.B,), nk - n, dtype=torch.int32, device=inp.device)
    return [{**inp.kw, "kv_len": before, "k_new": k[:, :, nk - n:].clone(), "v_new": v[:, :, nk - n:].clone()}
            for k, v in zip(inp.ks, inp.vs)]


def append_notes(inp: CaseInputs) -> list[str]:
    n = inp.case.append
    return [f"k_new/v_new: the call writes {n} new key(s) per sequence, then attends"] if n else []


def _refuse_extras(inp: CaseInputs, who: str, takes_alibi: bool = False) -> None:
    """A rival without attnlab's extras: :class:`Unsupported` for the ones it cannot express."""
    case = inp.case
    if case.append:
        raise Unsupported(f"{who} has no KV append (a separate copy would be a different call)")
    if case.sinks:
        raise Unsupported(f"{who} has no attention sinks")
    if case.softcap is not None and who.startswith("SDPA"):
        raise Unsupported("SDPA has no softcap")
    if case.alibi is not None and not takes_alibi:
        raise Unsupported(f"{who} has no ALiBi slopes")


def _public_prepared(name: str, be, call: Callable[[int], torch.Tensor], notes: Sequence[str] = (),
                     setup_bytes: int = 0) -> Prepared:
    """A public-call competitor's :class:`Prepared`: ``call`` timed as it is, its checked call under
    ``poison_outputs`` (an element the backend does not write fails the check as NaN), and the backend
    ``auto`` picked in the notes."""
    from attnlab.api import poison_outputs

    def check_call(i: int) -> torch.Tensor:
        with poison_outputs():
            return call(i)

    notes = [*notes, *([f"auto picked {be.name}"] if name == "auto" else [])]
    return Prepared(call=call, check_call=check_call, setup_bytes=setup_bytes, notes=notes, cold=release_held)


def release_held() -> None:
    """Release the split-state buffers attnlab's decode fast calls hold (nothing without triton)."""
    try:
        from attnlab.backends.triton.decode_launch import release_workspaces
    except ImportError:
        return
    release_workspaces()


def _attnlab_competitor(name: str) -> Competitor:
    """The public call: ``attnlab.attention(q, k, v, **keywords, backend=name)`` as a user makes it, a new
    Problem (and its validation) every call; the checked call runs under ``poison_outputs``."""

    def prepare(inp: CaseInputs) -> Prepared:
        from attnlab.api import attention

        be, prob = _attnlab_backend(name, inp)
        qs, ks, vs, kws = inp.qs, inp.ks, inp.vs, call_keywords(inp)

        def call(i: int) -> torch.Tensor:
            return attention(qs[i], ks[i], vs[i], backend=name, **kws[i])

        return _public_prepared(name, be, call, [*append_notes(inp), *kernel_notes(be, prob)])

    return Competitor(name, "attnlab", prepare)


def kernel_notes(be: Backend, prob: Problem) -> list[str]:
    """``kernel <label>``: the compiled variant a CUDA C backend launches on the case (one family has several
    kernels for one problem, e.g. mma's wide and narrow tiles); nothing for other backends."""
    label = getattr(be, "kernel_label", None)
    return [f"kernel {label(prob)}"] if label is not None else []


#: Infix of the paged-cache competitors: ``auto-paged16`` is the public call reading caches of 16-key blocks.
PAGED_INFIX = "-paged"


def _paged_competitor(name: str) -> Competitor:
    """``<backend>-paged<block size>``: the public call with k and v as paged caches (attnlab.paged.to_paged,
    blocks shuffled over the cache, made outside the timed region) and their block table on the GPU."""
    base, size = name.split(PAGED_INFIX)
    block_size = int(size)

    def prepare(inp: CaseInputs) -> Prepared:
        from attnlab.api import attention
        from attnlab.paged import to_paged

        be, prob = _attnlab_backend(base, inp)
        if inp.qs[0].requires_grad:
            raise Unsupported("paged rows are forward only")
        if inp.kw.get("layout", "bhnd") != "bhnd" or prob.Nk % block_size:
            raise Unsupported(f"paged rows need layout bhnd and Nk a multiple of {block_size}")
        caches = [to_paged(k, v, block_size, seed=i) for i, (k, v) in enumerate(zip(inp.ks, inp.vs))]
        setup = sum(t.numel() * t.element_size() for c in caches for t in c)
        qs, kws = inp.qs, call_keywords(inp)

        def call(i: int) -> torch.Tensor:
            kc, vc, bt = caches[i]
            return attention(qs[i], kc, vc, block_table=bt, backend=base, **kws[i])

        return _public_prepared(base, be, call, [f"paged cache, blocks of {block_size} keys", *append_notes(inp),
                                                 *kernel_notes(be, prob)], setup)

    return Competitor(name, "attnlab", prepare)


def _kernel_competitor(name: str) -> Competitor:
    """``<backend>-kernel``: the backend's ``forward`` on a Problem validated once per input set, outside the
    timed region (the kernel without the public call's validation and dispatch). Forward only."""
    base = name[: -len(KERNEL_SUFFIX)]

    def prepare(inp: CaseInputs) -> Prepared:
        from attnlab.problem import make_problem

        if inp.qs[0].requires_grad:
            raise Unsupported("the kernel path has no autograd (time the public call)")
        if inp.case.append:
            raise Unsupported("the kernel path has no KV append (time the public call)")
        be, _ = _attnlab_backend(base, inp)
        probs = [make_problem(q, k, v, **inp.kw) for q, k, v in zip(inp.qs, inp.ks, inp.vs)]

        def call(i: int) -> torch.Tensor:
            prob = probs[i]
            out, ob = prob.new_out()
            be.forward(prob, ob, None)
            return out

        def check_call(i: int) -> torch.Tensor:
            prob = probs[i]
            out, ob = prob.new_out()
            out.fill_(float("nan"))  # an element the backend does not write fails the check as NaN
            be.forward(prob, ob, None)
            return out

        return Prepared(call=call, check_call=check_call, notes=kernel_notes(be, probs[0]))

    return Competitor(name, "attnlab", prepare, path="kernel")


def _sdpa_competitor(name: str) -> Competitor:
    kind = SDPA_KINDS[name]

    def prepare(inp: CaseInputs) -> Prepared:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from attnlab.backends.sdpa import sdpa_inputs
        from attnlab.problem import make_problem

        if not hasattr(SDPBackend, kind):
            raise Unavailable(f"this torch has no SDPBackend.{kind}")
        _refuse_extras(inp, "SDPA", takes_alibi=True)
        sdp = getattr(SDPBackend, kind)
        prob = make_problem(inp.qs[0], inp.ks[0], inp.vs[0], **inp.kw)
        notes: list[str] = []
        if name in ("sdpa-flash", "sdpa-efficient") and prob.spec.kind == "causal_br" and prob.Nq != prob.Nk:
            if prob.mods.alibi is not None:
                raise Unsupported("ALiBi with bottom-right causal and Nq != Nk is not materialized for this kernel")
            # Bottom-right causal without a materialized mask: the way flash and efficient take it natively.
            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "NaNs when seq_len_q > seq_len_kv": those rows are zeroed
                attn_mask = causal_lower_right(prob.Nq, prob.Nk)
            is_causal, empty = False, empty_rows(prob.spec)
            setup = 0
            notes.append("bottom-right causal as torch.nn.attention.bias.causal_lower_right")
        else:
            attn_mask, is_causal, empty = sdpa_inputs(prob)
            if prob.mods.alibi is not None:  # the bias materialized, the mask folded in (untimed)
                attn_mask, is_causal = alibi_mask(prob, attn_mask, is_causal), False
                notes.append("ALiBi as a materialized float bias [B, Hq, Nq, Nk] with the mask folded in")
            setup = attn_mask.numel() * attn_mask.element_size() if attn_mask is not None else 0
        group = prob.group
        ks, vs = inp.ks, inp.vs

        def run(q, k, v, gqa: bool) -> torch.Tensor:  # inside sdpa_kernel(sdp) (Prepared.context)
            kw = {"enable_gqa": True} if gqa else {}
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=prob.scale, **kw
            )

        def attempt(k, v, gqa):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel(sdp):
                        run(inp.qs[0], k, v, gqa)
                    return None
                except RuntimeError as e:
                    if "No available kernel" not in str(e) and "No viable backend" not in str(e):
                        raise
                    why = "; ".join(sorted({str(w.message).split("\n")[0][:160] for w in caught}))
                    return why or str(e)[:200]

        use_gqa = group > 1
        why = attempt(ks[0], vs[0], use_gqa)
        if why is not None and use_gqa:
            kr = [k.repeat_interleave(group, dim=1) for k in ks]
            vr = [v.repeat_interleave(group, dim=1) for v in vs]
            why2 = attempt(kr[0], vr[0], False)
            if why2 is None:
                ks, vs, use_gqa = kr, vr, False
                setup += sum(t.numel() * t.element_size() for t in kr + vr)
                notes.append("enable_gqa refused: K/V repeated outside the timed region")
                why = None
            else:
                why = f"{why} | with K/V repeated: {why2}"
        if why is not None:
            raise Unsupported(f"SDPA {kind}: no available kernel: {why}")

        def call(i: int) -> torch.Tensor:
            return run(inp.qs[i], ks[i], vs[i], use_gqa)

        return Prepared(call=call, setup_bytes=setup, notes=notes, zero_rows=empty, context=lambda: sdpa_kernel(sdp))

    return Competitor(name, "torch", prepare)


def alibi_mask(prob, attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """SDPA's ``attn_mask`` for ``prob``'s ALiBi slopes: the bias of the contract's rule (FlashAttention's)
    materialized [B, Hq, Nq, Nk] in the input dtype, with the mask (``attn_mask`` or ``is_causal``) as -inf."""
    from attnlab.reference import effective_lengths

    zeros = torch.zeros(prob.B, prob.Hq, prob.Nq, prob.Nk, device=prob.device, dtype=torch.float32)
    bias = prob.mods.scores(zeros, 0, *effective_lengths(prob))
    if is_causal:
        bias = bias.masked_fill(~torch.ones(prob.Nq, prob.Nk, dtype=torch.bool, device=prob.device).tril(),
                                float("-inf"))
    elif attn_mask is not None:
        bias = bias.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else bias + attn_mask
    return bias.to(prob.dtype)


def _set_dynamo_limits() -> None:
    """Raise dynamo's recompile limit and make hitting it an error, not a silent fallback to eager."""
    import torch._dynamo.config as dcfg

    names = getattr(dcfg, "_config", {})
    for attr in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if attr in names or hasattr(dcfg, attr):
            with contextlib.suppress(Exception):
                setattr(dcfg, attr, max(int(getattr(dcfg, attr)), 256))
    for attr in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if attr in names or hasattr(dcfg, attr):
            with contextlib.suppress(Exception):
                setattr(dcfg, attr, True)


def flex_score_mod(case, kw: dict[str, Any], inner: Callable | None) -> Callable | None:
    """flex's ``score_mod`` for a case with softcap or ALiBi: the same rule as attnlab's (cap first, then
    -slope * |i + Nk - Nq - j|, on the scaled score), after the mask's own score_mod ``inner`` if any."""
    cap, slopes = case.softcap, kw.get("alibi_slopes")
    if cap is None and slopes is None:
        return inner
    if slopes is not None and ("kv_len" in kw or "q_len" in kw):
        raise Unsupported("flex ALiBi here assumes full lengths")
    if slopes is not None and slopes.dim() != 1:
        raise Unsupported("flex ALiBi here takes slopes [Hq], not [B, Hq]")
    shift = case.nk - case.Nq

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        if slopes is not None:
            score = score - slopes[h] * (q_idx + shift - kv_idx).abs()
        return score

    return score_mod


#: Compile and run flex on CPU tensors too (off: compiling there is slow; on for debugging the harness).
FLEX_ON_CPU = False


def _flex_competitor() -> Competitor:
    def prepare(inp: CaseInputs) -> Prepared:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as e:
            raise Unavailable(f"torch.nn.attention.flex_attention not importable: {e}") from None
        if inp.device.type != "cuda" and not FLEX_ON_CPU:
            raise Unsupported("flex is benchmarked on CUDA only (compiling it on a CPU costs more than a smoke run)")
        import torch._dynamo

        case, spec = inp.case, inp.spec
        _refuse_extras(inp, "flex", takes_alibi=True)
        mask_mod, score_mod, by_b, by_h = spec.flex_mods()
        score_mod = flex_score_mod(case, inp.kw, score_mod)
        torch._dynamo.reset()  # one static compilation per case
        _set_dynamo_limits()
        block_mask = None
        setup = 0
        if mask_mod is not None:
            block_mask = create_block_mask(
                mask_mod, case.B if by_b else None, case.Hq if by_h else None, case.Nq, case.nk, device=inp.device
            )
            with contextlib.suppress(Exception):
                setup = sum(t.numel() * t.element_size() for t in block_mask.as_tuple() if isinstance(t, torch.Tensor))
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        gqa = case.Hq != case.hkv
        scale = 1.0 / math.sqrt(case.D)

        def call(i: int) -> torch.Tensor:
            kw = {"enable_gqa": True} if gqa else {}
            return compiled(inp.qs[i], inp.ks[i], inp.vs[i], score_mod=score_mod, block_mask=block_mask,
                            scale=scale, **kw)

        from torch._dynamo.utils import counters

        state: dict[str, int | None] = {"graphs": None}

        def graphs() -> int:
            return int(counters["stats"]["unique_graphs"])

        def mark() -> str | None:
            old, state["graphs"] = state["graphs"], graphs()
            if old is not None and state["graphs"] != old:
                return f"dynamo compiled {state['graphs'] - old} more graph(s) after the first call (before timing)"
            return None

        def after_timing() -> str | None:
            if state["graphs"] is not None and graphs() != state["graphs"]:
                return "dynamo compiled a new graph during the timed calls (recompilation)"
            return None

        return Prepared(call=call, setup_bytes=setup, zero_rows=empty_rows(spec), after_timing=after_timing,
                        mark=mark)

    return Competitor("flex", "torch", prepare)


#: The Triton competitors that compare where the configs come from: the shipped table, as a new user's first run
#: has it, and ``attnlab.tune()``'s choice on the case's own inputs (tuned while the case is set up, untimed).
CONFIG_SOURCES = ("triton-table", "triton-tuned")


def _config_source_competitor(name: str) -> Competitor:
    """``triton-table``: the public call with ``backend="triton"`` inside ``configs.shipped_only()``;
    ``triton-tuned``: the public call after ``attnlab.tune`` on input set 0 (the backward too for a backward
    case), tuned into a scratch cache folder. Both through :func:`attnlab.attention`, so they can be interleaved
    in one run. The tuned configs stay in this process: a later plain ``triton`` row of the same tune key
    would use them."""

    def prepare(inp: CaseInputs) -> Prepared:
        from attnlab.api import attention
        from attnlab.backends.triton import configs
        from attnlab.tuning import tune

        be, _ = _attnlab_backend("triton", inp)
        if inp.device.type != "cuda":
            raise Unsupported("configs are tuned for GPU launches only")
        if inp.case.append:
            raise Unsupported("the config-source rows compare configs, not KV append")
        qs, ks, vs, kw = inp.qs, inp.ks, inp.vs, inp.kw
        notes = []
        if name == "triton-tuned":  # tuned into a scratch cache folder: the user's persistent cache stays as it is
            with tempfile.TemporaryDirectory(prefix="attnlab-bench-tune-") as scratch:
                old = os.environ.get("ATTNLAB_CACHE_DIR")
                os.environ["ATTNLAB_CACHE_DIR"] = scratch
                try:
                    chosen = tune(qs[0], ks[0], vs[0], backward=qs[0].requires_grad, **kw)
                finally:
                    if old is None:
                        os.environ.pop("ATTNLAB_CACHE_DIR", None)
                    else:
                        os.environ["ATTNLAB_CACHE_DIR"] = old
            notes.append("tuned " + ", ".join(f"{k} {v}" for k, v in chosen.items()))

        def call(i: int) -> torch.Tensor:
            return attention(qs[i], ks[i], vs[i], backend="triton", **kw)

        prep = _public_prepared("triton", be, call, notes)
        if name == "triton-table":
            prep.context = configs.shipped_only
        return prep

    return Competitor(name, "attnlab", prepare)


#: The Triton public call with its backward's dQ added up by atomics inside the dK/dV pass
#: (``backward.DQ_MODE = "atomic"`` around its calls): the one-pass backward beside the shipped two-pass one.
DQ_ATOMIC = "triton-dq-atomic"


def _dq_atomic_competitor() -> Competitor:
    """:data:`DQ_ATOMIC`: ``attnlab.attention(..., backend="triton")``, every call (and its backward) inside a
    context that switches the backward to its one-pass mode and back."""

    @contextlib.contextmanager
    def one_pass():
        from attnlab.backends.triton import backward

        was, backward.DQ_MODE = backward.DQ_MODE, "atomic"
        try:
            yield
        finally:
            backward.DQ_MODE = was

    def prepare(inp: CaseInputs) -> Prepared:
        prep = _attnlab_competitor("triton").prepare(inp)
        prep.context = one_pass
        prep.notes = [*prep.notes, "backward: dQ by atomics in the dK/dV pass"]
        return prep

    return Competitor(DQ_ATOMIC, "attnlab", prepare)


def competitors(names: Iterable[str] | None = None) -> list[Competitor]:
    """The competitors by name (default: every attnlab backend docs/contract.md lists or the registry holds,
    except ``reference``; then ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-math``, ``flex``).
    Also by name only: ``auto``, ``reference``, :data:`CONFIG_SOURCES`, :data:`DQ_ATOMIC`, ``<backend>-kernel``
    (:func:`_kernel_competitor`) and ``<backend>-paged<block size>`` (:func:`_paged_competitor`)."""
    from attnlab import backends as _b

    attn = list(DESIGN_BACKENDS) + [n for n in _b.registry() if n not in DESIGN_BACKENDS and n != "reference"]
    public = [*attn, "reference", "auto"]
    known = [*public, *(n + KERNEL_SUFFIX for n in attn), *SDPA_KINDS, "flex", *CONFIG_SOURCES, DQ_ATOMIC]
    names = [*attn, *SDPA_KINDS, "flex"] if names is None else list(names)
    out = []
    for n in names:
        if n in SDPA_KINDS:
            out.append(_sdpa_competitor(n))
        elif n == "flex":
            out.append(_flex_competitor())
        elif n in CONFIG_SOURCES:
            out.append(_config_source_competitor(n))
        elif n == DQ_ATOMIC:
            out.append(_dq_atomic_competitor())
        elif n in public or n in _b.registry():
            out.append(_attnlab_competitor(n))
        elif PAGED_INFIX in n and n.split(PAGED_INFIX)[0] in public and n.split(PAGED_INFIX)[1].isdigit():
            out.append(_paged_competitor(n))
        elif n.endswith(KERNEL_SUFFIX) and n[: -len(KERNEL_SUFFIX)] in [*public, *_b.registry()]:
            out.append(_kernel_competitor(n))
        else:
            raise ValueError(f"unknown competitor {n!r}; choose from {known}")
    return out
