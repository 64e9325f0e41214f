"""Backend ``triton``: one fused Triton forward kernel for the whole attention contract.

Tiling and program mapping
--------------------------
The score matrix of one (batch b, query head h) is cut into tiles of ``BLOCK_M`` query rows by
``BLOCK_N`` keys. One program owns one row tile: the grid is ``(ceil(Nq / BLOCK_M), Hq, B)``, the row
tiles of one head are neighbours in launch order (so they share that head's K/V in L2), and the row
tiles are handed out last-first so that under a causal mask the longest rows start first. A config
with ``rows_outer`` launches ``(Hq, B, ceil(Nq / BLOCK_M))`` instead: the longest row tiles of every
head first, so that a causal launch does not end on one long tile (:func:`_rows_outer`). Query head h
reads kv head ``h // group`` (GQA/MQA, grouped). The program loads its Q tile once ([BLOCK_M, BLOCK_D],
D padded to a power of two ``BLOCK_D`` >= 16 with zeros), then streams K/V tiles of ``BLOCK_N`` keys
through the online softmax and writes its [BLOCK_M, D] slice of the output and its lse once at the end.
Every address is computed from the caller's strides (any layout, transposed views, a non-unit D
stride); the large parts of an offset (batch, head, the tile's first row or key) are 64-bit scalars, the
in-tile parts 32-bit vectors.

Online softmax in base 2
------------------------
Scores are kept in the log2 domain: ``s = (q . k) * scale * log2(e) (+ bias * log2(e))``, so every
exponential is one ``exp2``. Per row the program carries ``m_i`` (running max of s), ``l_i`` (running sum
of ``exp2(s - m_i)``) and ``acc`` (running sum of ``exp2(s - m_i) * v``, float32). A new tile with
row max ``m_new = max(m_i, max_j s_ij)`` rescales the old state by ``alpha = exp2(m_i - m_new)``. A row
that has seen no allowed key yet has ``m_new = -inf``; ``exp2(-inf - (-inf))`` would be NaN, so the
subtraction uses ``m_safe = 0`` there, which makes both ``alpha`` and every ``p`` exactly 0. At the end
``out = acc / l_i`` and ``lse = (m_i + log2 l_i) * ln 2``; rows with ``l_i = 0`` (no allowed key) and
padding rows (``i >= Lq_b``) write out = 0 and lse = -inf. For float16/bfloat16 inputs P is rounded to
the input dtype before ``P @ V`` (as FlashAttention does); for float32 both products are exact IEEE
(``input_precision="ieee"``: no TF32 rounding of the inputs) unless the caller opts into TF32 with
:func:`allow_tf32`.

Keys-major float32
------------------
float32 products are exact IEEE ones, which Triton runs on the FMA units with both operands read from
shared memory that it does not swizzle. With K as the second operand of Q K^T, a warp's threads read K
rows D floats apart, all in one bank. A ``keys_major`` config (float32 only) holds the score tile
transposed: ``S^T = K Q^T`` ([BLOCK_N, BLOCK_M]), ``O^T += V^T P^T``, the running max and sum reduced
over axis 0 (the kernel's ``KEY_AXIS``). K is then read by two threads per warp, and Q^T, built once per
program as an exact product with the identity (a dot's result is query-contiguous), by all of them
without conflict (docs/decisions.md, "float32 tiles"). Keys-major runs one loop over its key tiles and finds
the partial ones at run time.

Block skipping
--------------
From the effective lengths and the band (causal/window, either alignment) the program computes, on the
device, the keys ``[lo, hi)`` that any of its rows may see (the same bounds as
:meth:`attnlab.masks.MaskSpec.key_range`) and, inside that, the keys ``[full_lo, full_hi)`` that *all*
its rows may see. Key tiles outside ``[lo, hi)`` are never loaded. Tiles wholly inside the full range run
a loop body without any predicate arithmetic (no bounds masks on the K/V loads, no band compares, no
-inf guard); only the partial tiles at either end pay for masking. A row tile of padding rows only
(``i0 >= Lq_b``) writes its zeros and lse = -inf and returns before it reads anything of Q, K or V. The
lengths are clamped to ``[0, N]`` as they are loaded, so no length makes an access leave the tensors. An
explicit bool mask or bias is data, not structure: where one is given, every visited tile reads it through
its broadcast strides (stride 0, never materialized), a bias in the caller's dtype (converted in
registers). The three phases (partial, full, partial) are one loop body specialized at compile time by
``tl.static_range``; the first is compiled only for a band with a left edge (without one it is empty).

Where it runs
-------------
On CUDA tensors the kernel is compiled by Triton with one config, from a small space (block sizes, warps,
stages, and for float32 the D chunk of Q K^T; :func:`candidates`) keyed on dtype, head dim, mask kind and
the sizes' powers of two (:func:`tune_key`): a config tuned on this machine, else the shipped table's
(:mod:`~attnlab.backends.triton.tuned_table`), else the first candidate. Tuning happens on request
(:func:`attnlab.tune`, or ``ATTNLAB_AUTOTUNE=1``); tuned configs persist on disk per GPU model, Triton version
and kernel source (:mod:`~attnlab.backends.triton.tune_cache`, ``$ATTNLAB_CACHE_DIR`` or ``~/.cache/attnlab``).
Launches of one call signature (shapes, strides, dtypes, mask kind, alignment: :func:`call_signature`) share a
plan (:class:`_Plan`): its arguments and compiled kernel, with Triton's launcher called directly rather than
through the JIT's per-call binding. :func:`attnlab.attention` goes further for a signature it has seen
(:mod:`attnlab.fast_calls`): the plan's fast call allocates the output and launches, with nothing validated or
looked up again (docs/decisions.md, "Host time of small calls"). ``FAST_LAUNCH = False`` (or
ATTNLAB_TRITON_FAST_LAUNCH=0) sends every launch through the JIT.

On CPU tensors the very same Python function runs through Triton's interpreter
(``triton.runtime.interpreter.InterpretedFunction``) with one small config, so the user sets no
``TRITON_INTERPRET``. The interpreter swaps ``triton.language``'s functions for its own while it runs;
:func:`~attnlab.backends.triton.interpreter.interpreter` routes the library's @triton.jit helpers
(``tl.max``, ``tl.sum``) to interpreted twins and restores ``triton.language`` afterwards, so interpreted
and compiled launches mix in one process. The code uses plain pointer arithmetic only (no
``tl.make_block_ptr``); its CPU tests pass with triton 3.4, 3.6 and 3.9.

Where the code is
-----------------
* :mod:`~attnlab.backends.triton.kernel`: the @triton.jit code, in the order a program runs it:
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
* :mod:`~attnlab.backends.triton.launch`: the kernel's arguments, the grid, the JIT launch and the fast
  path of repeated launches.
* :mod:`~attnlab.backends.triton.interpreter`: the CPU path.
* :mod:`~attnlab.backends.triton.backend`: :class:`TritonBackend` and ``TritonDecodeBackend``.
* :mod:`~attnlab.backends.triton.decode_kernels` and :mod:`~attnlab.backends.triton.decode`: the split-KV
  decode path (``triton-decode``): its kernels, then its configs, split count, paged cache and plans.
* :mod:`~attnlab.backends.triton.backward_kernels` and :mod:`~attnlab.backends.triton.backward`: the
  FlashAttention-2 style backward kernels and their launches.
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
from attnlab.backends.triton.kernel import LOG2E

__all__ = ["INTERPRETER_CONFIG", "LOG2E", "Config", "TritonBackend", "allow_tf32", "candidates",
           "config_for", "tune_key"]
