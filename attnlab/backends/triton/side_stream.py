"""Two launches side by side: the second on a side stream of the current one, joined before anything after.

The backward runs its dQ pass this way beside the dK/dV pass (:data:`~attnlab.backends.triton.backward.TWO_STREAMS`).
"""

from __future__ import annotations

import torch

from attnlab.backends.triton import runtime as _rt

#: The side stream of each (device, current stream) that the dQ pass runs on (see TWO_STREAMS): one per current
#: stream, so that a thread capturing a CUDA graph on its stream never shares a side stream with another thread's
#: eager backward. At most MAX_STREAMS are remembered (torch hands streams out from a pool: one forgotten is
#: never destroyed, and work queued on it runs on).
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
MAX_STREAMS = 16


def side_by_side(two: bool, first, second, device: torch.device) -> tuple:
    """``(first(), second())``. With ``two``: first on the current stream, second on that stream's side stream,
    which starts after everything queued on the current stream so far; the current stream then waits for the
    side stream (also when a launch raised, so that a graph capture is never left forked), so that whatever
    follows (and every tensor's reuse by the caching allocator) comes after both. Else one stream, one after the
    other. Graph capture follows the fork and the join."""
    if not two:
        return first(), second()
    index = _rt.device_index(device)
    main = torch.cuda.current_stream(index)
    key = (index, main.cuda_stream)
    side = _STREAMS.get(key)
    if side is None:
        if len(_STREAMS) >= MAX_STREAMS:
            _STREAMS.pop(next(iter(_STREAMS)), None)
        side = _STREAMS[key] = torch.cuda.Stream(index)
    side.wait_stream(main)
    try:
        a = first()
        with torch.cuda.stream(side):
            b = second()
    finally:
        main.wait_stream(side)
    return a, b
