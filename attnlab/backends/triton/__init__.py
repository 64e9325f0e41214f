"""Backend ``triton``: the Triton kernels of attnlab (the fused forward, its backward, the split-KV decode), laid
out by kernel: each ``*_kernel(s)`` module opens with its kernel's design; the host code is beside it.

Where the code is
-----------------
* :mod:`~attnlab.backends.triton.forward_kernel`: the @triton.jit code, in the order a program runs it:
  the tile bounds (``tiles.lengths``, ``tiles.key_tiles``), one inner loop per orientation
  (``_query_major_loop``, ``_keys_major_loop``) sharing ``tiles.score_mod``, ``_explicit``, ``tiles.band`` and
  ``tiles.softmax_update``, and
  ``_epilogue``; ``attn_fwd_kernel`` strings them together.
* :mod:`~attnlab.backends.triton.tiles`: the @triton.jit pieces the forward, the backward and the decode
  kernels share (tile loads, lengths and key tiles, loop phases, the scores' transform, the explicit mask or
  bias, the band, the online-softmax update), each written once.
* :mod:`~attnlab.backends.triton.configs`: :class:`Config`, :func:`candidates`, :func:`tune_key`,
  autotuning, :func:`allow_tf32`.
* :mod:`~attnlab.backends.triton.tune_cache`: tuned configs on disk (forward and backward).
* :mod:`~attnlab.backends.triton.tuned_table`: the shipped table of tuned configs (``tuned_table.json``).
* :mod:`~attnlab.backends.triton.forward`: the forward's host side: its arguments, the grid, the JIT launch,
  the plans of repeated launches, autotuning.
* :mod:`~attnlab.backends.triton.runtime`: what every kernel's plans share: the launch of a compiled kernel
  through its C launch function, the per-call arguments, the plan key.
* :mod:`~attnlab.backends.triton.interpreter`: the CPU path.
* :mod:`~attnlab.backends.triton.backend`: :class:`TritonBackend` and ``TritonDecodeBackend``.
* :mod:`~attnlab.backends.triton.decode_kernels` and :mod:`~attnlab.backends.triton.decode`: the split-KV
  decode path (``triton-decode``): its kernels, then its configs, split count, paged cache and plans.
* :mod:`~attnlab.backends.triton.backward_kernels` and :mod:`~attnlab.backends.triton.backward`: the
  FlashAttention-2 style backward kernels and their host side; :mod:`~attnlab.backends.triton.bwd_launch`, their
  launches (a repeated one launched directly), :mod:`~attnlab.backends.triton.bwd_grid`, their grids.
"""

from __future__ import annotations

from attnlab.backends.triton.backend import TritonBackend
from attnlab.backends.triton.configs import (
    INTERPRETER_CONFIG,
    Config,
    allow_tf32,
    candidates,
    config_for,
    tune_key,
)
from attnlab.backends.triton.forward_kernel import LOG2E

__all__ = ["INTERPRETER_CONFIG", "LOG2E", "Config", "TritonBackend", "allow_tf32", "candidates",
           "config_for", "tune_key"]
