"""The backward's grids: when one is short, in which order its programs start, and the side stream.

The GPU starts a grid's programs in its order, first axis fastest, each on the first SM to free up. Two rules of
the backward follow from how many programs a grid holds per SM. At MIN_WAVES or more, the dQ pass runs on a second
stream beside the dK/dV pass and takes the SMs its last wave leaves idle (``backward.TWO_STREAMS``). Below, in a
short grid, a long program started late runs on alone after the rest: under a causal mask the first key tile of
a head carries the most work (and with GQA its program loops over the group's query heads), so such a grid
starts one tile of every head before the next tile of any (:func:`tiles_outer`; the kernels' ``TILES_OUTER``
grid, ``(heads, B, tiles)``); a short dQ grid, whose row tiles differ in work the same way, gains from it too.
Where programs are many and alike, a head's tiles side by side (FlashAttention-2's order) read its rows close
together in time, from L2 (docs/decisions.md, "The backward's grid order"). :func:`side_by_side` forks the dQ
pass onto a side stream of the current one and joins it back.
"""

from __future__ import annotations

import os

import torch

from attnlab.backends.triton import runtime as _rt
from attnlab.problem import Problem

#: Programs per SM under which a grid is short (:func:`short`).
MIN_WAVES = 6
#: Which of the backward's grids put the tile index outermost, ATTNLAB_BWD_TILES_OUTER: ``auto`` (the rule of
#: :func:`tiles_outer`), ``none``, ``dkdv`` or ``all``.
TILES_OUTER_MODES = ("auto", "none", "dkdv", "all")
TILES_OUTER: str = os.environ.get("ATTNLAB_BWD_TILES_OUTER", "auto")
#: The most tiles the grid's last axis takes (CUDA's limit on its y and z axes).
MAX_TILES_OUTER = 65535


def short(programs: int, sms: int) -> bool:
    """Whether a grid of ``programs`` holds fewer than MIN_WAVES per SM on a GPU of ``sms`` SMs."""
    return programs < MIN_WAVES * sms


def tiles_outer(prob: Problem, kernel: str, block: int, sms: int | None = None) -> bool:
    """Whether ``kernel`` (``"dkdv"`` or ``"dq"``, tiles of ``block`` keys or rows) of ``prob``'s backward takes the
    grid with the tiles outermost (:data:`TILES_OUTER`: ``auto`` is :func:`auto_rule`). Never for a packed call,
    whose slots order themselves, nor past MAX_TILES_OUTER tiles."""
    if TILES_OUTER not in TILES_OUTER_MODES:
        raise ValueError(f"ATTNLAB_BWD_TILES_OUTER must be one of {TILES_OUTER_MODES}; got {TILES_OUTER!r}")
    if prob.packed is not None or _tiles_heads(prob, kernel, block)[0] > MAX_TILES_OUTER:
        return False
    if TILES_OUTER != "auto":
        return TILES_OUTER == "all" or TILES_OUTER == kernel
    if sms is None:
        if not prob.q.is_cuda:
            return False
        sms = _rt.sm_count(_rt.device_index(prob.device))
    return auto_rule(prob, kernel, block, sms)


def auto_rule(prob: Problem, kernel: str, block: int, sms: int) -> bool:
    """``auto``'s choice, where it was measured to gain: a grid that is short on ``sms`` SMs in a call whose keys
    are bounded on the right only (causal, or a window open to the left: a two-sided band gives every tile as many
    partners), whatever its group."""
    spec = prob.spec
    if spec.right is None or spec.left is not None:
        return False
    tiles, heads = _tiles_heads(prob, kernel, block)
    return short(tiles * heads * prob.B, sms)


def _tiles_heads(prob: Problem, kernel: str, block: int) -> tuple[int, int]:
    """(tiles of ``block`` keys or rows, heads) of ``kernel``'s grid: key tiles of the kv heads for dK/dV, row tiles
    of the query heads for dQ."""
    n, heads = (prob.Nk, prob.Hkv) if kernel == "dkdv" else (prob.Nq, prob.Hq)
    return -(-n // block), heads


#: The side stream of each (device, current stream) that the dQ pass runs on (``backward.TWO_STREAMS``): one per
#: current stream, so that a thread capturing a CUDA graph never shares a side stream with another thread's eager
#: backward. At most MAX_SIDE_STREAMS are remembered (a forgotten one is never destroyed: torch pools them).
_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
MAX_SIDE_STREAMS = 16


def side_by_side(two: bool, first, second, device: torch.device) -> tuple:
    """``(first(), second())``. With ``two``: first on the current stream, second on that stream's side stream,
    which starts after everything queued on the current stream so far; the current stream then waits for the
    side stream (also when a launch raised, so that a graph capture is never left forked), so that whatever
    follows (and every tensor's reuse by the caching allocator) comes after both; graph capture follows the fork
    and the join. Else one stream, one after the other."""
    if not two:
        return first(), second()
    index = _rt.device_index(device)
    main = torch.cuda.current_stream(index)
    key = (index, main.cuda_stream)
    side = _SIDE_STREAMS.get(key)
    if side is None:
        if len(_SIDE_STREAMS) >= MAX_SIDE_STREAMS:
            _SIDE_STREAMS.pop(next(iter(_SIDE_STREAMS)), None)
        side = _SIDE_STREAMS[key] = torch.cuda.Stream(index)
    side.wait_stream(main)
    try:
        a = first()
        with torch.cuda.stream(side):
            b = second()
    finally:
        main.wait_stream(side)
    return a, b
