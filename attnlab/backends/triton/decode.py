"""The split-KV decode path's host side: configs, the split count, the paged cache, launch plans and their
fast calls. The kernels, and how they tile and map programs, are in
:mod:`attnlab.backends.triton.decode_kernels`."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnlab.backends.triton import background
from attnlab.backends.triton import configs as _cfg
from attnlab.backends.triton import decode_launch as _launch
from attnlab.backends.triton import forward_kernel as _kern
from attnlab.backends.triton import interpreter as _interp
from attnlab.backends.triton import runtime as _rt
from attnlab.backends.triton.configs import padded_head_dim, pow2_bucket
from attnlab.backends.triton.decode_launch import Kernel
from attnlab.backends.triton.forward_kernel import triton
from attnlab.backends.triton.runtime import sm_count as _sm_count
from attnlab.fast_calls import evict_oldest, tensor_key
from attnlab.paged import PagedKV, paged_kv
from attnlab.problem import Problem

if TYPE_CHECKING:
    from attnlab.kv_append import Append

if triton is not None:
    from attnlab.backends.triton.decode_kernels import PDL_AVAILABLE, decode_merge_kernel, decode_split_kernel

#: The decode path is for at most this many query rows (larger Nq is a prefill: the fused forward).
MAX_DECODE_NQ = 16
#: Most packed rows one program holds; more are cut into row tiles (each re-reads K/V, mostly from L2).
MAX_BLOCK_M = 64
#: The most splits of one (batch, kv head, row tile), and the fewest key tiles a split should own.
MAX_SPLITS = 256
MIN_TILES_PER_SPLIT = 4
#: The most programs per SM the split count aims at, and what it assumes when the split kernel's occupancy
#: is unknown (no compile yet: the notebooks' tables). Where more fit, more and shorter splits were no faster
#: (docs/decisions.md, "The decode's split count").
PROGRAMS_PER_SM = 4
#: With ragged kv_len, when the (batch, kv head, row tile) programs alone already fill every SM (MHA at
#: B >= 8): the host cannot see the lengths, and many short programs even the load out, so the split aims at
#: 16 programs per SM (docs/decisions.md, "The decode's split count").
PROGRAMS_PER_SM_WIDE_RAGGED = 16
#: Columns of out per merge program (a row of D columns is merged by D / MERGE_BLOCK_D programs). A second
#: kernel merges, rather than the split kernel's last split (docs/decisions.md, "Host time of small calls, and
#: one launch or two for the decode").
MERGE_BLOCK_D = 32
#: The interpreter's fixed split count when none is forced (so CPU runs exercise the merge).
INTERPRETER_SPLITS = 3
#: Whether plans made from now on launch the merge by programmatic dependent launch on GPUs that have it
#: (compute capability 9.0 and newer, CUDA): the split kernel lets the merge launch at once and the merge waits
#: for it on the GPU, so no launch gap separates them (ATTNLAB_DECODE_PDL=0: a plain second launch).
PDL: bool = os.environ.get("ATTNLAB_DECODE_PDL", "1") != "0"

# ---------------------------------------------------------------------------------------------------
# Host side: configs, the split count, the paged cache, launches
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Key tile, warps and pipeline stages of the split kernel (BLOCK_M follows from the packed rows)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    #: a cap on registers per thread (Triton's ``maxnreg``), or None: more programs fit on an SM at once
    maxnreg: int | None = None
    #: the programs per SM the split count aims at, or None: as many as fit, at most PROGRAMS_PER_SM
    per_sm: int | None = None

    def options(self) -> dict:
        """The compile options of the split kernel: warps, stages and, when set, the register cap."""
        extra = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, **extra, **_cfg.COMPILE_OPTIONS)


#: The interpreter's config: 16-key tiles, so short CPU sequences span several tiles per split.
INTERPRETER_CONFIG = DecodeConfig(16, 1, 1)


#: The config of the contiguous cache, half types, D 128 and at most 16 packed rows: 128-key tiles, three stages
#: (two K/V tiles, 128 KiB, in flight while one is used), one program per SM: as fast as or faster than
#: (64, 4, 2) without ragged lengths, slower with them, where few long programs leave SMs idle once the short
#: sequences are done (docs/decisions.md, "The decode's tiles and schedule").
DEEP_CONFIG = DecodeConfig(128, 4, 3, per_sm=1)
#: Shared memory a block of DEEP_CONFIG's split kernel needs (136 KiB compiled for sm_90 with triton 3.6): GPUs
#: that give a block less (consumer GPUs: about 100 KiB) run (64, 4, 2).
DEEP_SHARED_BYTES = 144 * 1024


def default_config(dtype: torch.dtype, D: int, paged: bool = False, rows: int = 16,
                   ragged: bool = False, deep_fits: bool = True) -> DecodeConfig:
    """The GPU config for a dtype and head dim. Half types, D128, a contiguous cache: DEEP_CONFIG, but
    (64, 4, 2) at up to 4 programs per SM with kv_len (``ragged``: the host cannot see whether the lengths are
    equal, and with ragged ones more, shorter splits even the load out; :func:`num_splits`), with more than 16
    packed rows (``rows``: BLOCK_M; not measured deep) and for the paged cache, whose kernel was slower at one
    program per SM (its K/V loads gather rows block by block), and where a block cannot have
    DEEP_SHARED_BYTES of shared memory (``deep_fits``). A paged cache's kernel with 16 packed rows is capped at
    128 registers a thread, so that 4 programs fit on an SM (with the block size a compile-time constant the
    cap binds no more; kept for other compilers). Larger row tiles were not measured capped, and ROCm's Triton
    has no such option: uncapped there. The measurements: docs/decisions.md, "The decode's tiles and
    schedule"."""
    block_d = padded_head_dim(D)
    if dtype == torch.float32:
        return DecodeConfig(32, 4, 2) if block_d <= 128 else DecodeConfig(16, 4, 2)
    if block_d == 128 and not paged and rows <= 16 and not ragged and deep_fits:
        return DEEP_CONFIG
    if block_d <= 128:
        cap = paged and rows <= 16 and torch.version.hip is None
        return DecodeConfig(64, 4, 2, maxnreg=128 if cap else None)
    return DecodeConfig(32, 4, 2)


def block_m(prob: Problem, interpret: bool = False) -> int:
    """Packed rows per program: group * Nq rounded up to a power of two, at least 16 (tl.dot's minimum),
    at most MAX_BLOCK_M (16 in the interpreter, so CPU tests also run several row tiles)."""
    return 16 if interpret else min(MAX_BLOCK_M, max(16, pow2_bucket(prob.group * prob.Nq)))


def row_tiles(prob: Problem, interpret: bool = False) -> int:
    bm = block_m(prob, interpret)
    return (prob.group * prob.Nq + bm - 1) // bm


def num_splits(prob: Problem, cfg: DecodeConfig, sm_count: int, interpret: bool = False,
               resident: int | None = None) -> int:
    """How many splits each (batch entry, kv head, row tile) gets: as many programs as run on the SMs at
    once (one wave: ``resident`` programs per SM, :func:`resident_programs`, at most the config's ``per_sm`` or
    PROGRAMS_PER_SM), and no more, since a second, partial wave leaves most SMs idle at the end; each split at least
    MIN_TILES_PER_SPLIT key tiles; then evened out so that the tiles divide nearly equally. With ragged kv_len
    and the SMs already full, PROGRAMS_PER_SM_WIDE_RAGGED per SM. A host-side choice: device lengths are not
    read back."""
    tiles = max(1, (prob.Nk + cfg.block_n - 1) // cfg.block_n)
    base = max(1, prob.B * prob.Hkv * row_tiles(prob, interpret))
    per_sm = min(resident or PROGRAMS_PER_SM, cfg.per_sm or PROGRAMS_PER_SM)
    if wide_ragged(prob, sm_count, interpret):
        per_sm = PROGRAMS_PER_SM_WIDE_RAGGED
    want = (per_sm * sm_count) // base
    s = max(1, min(want, tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
    per = (tiles + s - 1) // s
    return (tiles + per - 1) // per


def wide_ragged(prob: Problem, sm_count: int, interpret: bool = False) -> bool:
    """Ragged kv_len while the (batch entry, kv head, row tile) programs alone fill the SMs (:func:`num_splits`
    then aims at PROGRAMS_PER_SM_WIDE_RAGGED per SM)."""
    return prob.spec.kv_len is not None and prob.B * prob.Hkv * row_tiles(prob, interpret) >= sm_count


def programs_per_sm(regs: int, shared: int, num_warps: int, *, regs_per_sm: int = 65536,
                    shared_per_sm: int = 233472, threads_per_sm: int = 2048, max_programs: int = 32) -> int:
    """How many programs of a kernel using ``regs`` registers per thread and ``shared`` bytes of shared
    memory fit on one SM at once: registers are given out per warp in units of 256, and the driver keeps 1 KiB
    of shared memory per program (the defaults are a Hopper SM's)."""
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // warp_regs // num_warps
    by_shared = shared_per_sm // (shared + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_shared, by_threads, max_programs))


def resident_programs(kernel, num_warps: int, device_index: int) -> int | None:
    """:func:`programs_per_sm` of a compiled Triton kernel on a GPU, or None when this Triton does not say
    what the kernel uses."""
    try:
        regs, shared = _rt.registers(kernel, device_index), int(kernel.metadata.shared)
    except Exception:  # another Triton's CompiledKernel
        return None
    props = torch.cuda.get_device_properties(device_index)
    return programs_per_sm(
        regs, shared, num_warps, regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536) or 65536,
        shared_per_sm=getattr(props, "shared_memory_per_multiprocessor", 0) or 233472,
        threads_per_sm=props.max_threads_per_multi_processor)


@functools.cache
def _deep_fits(device_index: int) -> bool:
    """Whether a block on GPU ``device_index`` may use DEEP_SHARED_BYTES of shared memory."""
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 0) >= DEEP_SHARED_BYTES


@functools.cache
def _has_pdl(device_index: int) -> bool:
    """Whether GPU ``device_index`` runs programmatic dependent launches (an NVIDIA GPU of compute capability
    9.0 or newer) and this Triton can ask for them."""
    return (triton is not None and PDL_AVAILABLE and torch.version.hip is None
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


def _state_rows(prob: Problem, splits: int) -> tuple[int, int]:
    """(rows, padded): the split states' rows, (b, h, i, split), and that count rounded up to a multiple of 4,
    so that l and acc, which follow m in one allocation, start 16-byte aligned like m (the compiled kernels
    are specialized on their pointers' alignment)."""
    rows = prob.B * prob.Hq * prob.Nq * splits
    return rows, -(-rows // 4) * 4


def workspace_bytes(prob: Problem, splits: int) -> int:
    """Extra device memory of the split states: m, l and acc (float32) per (b, h, i, split); 0 for one."""
    if splits <= 1:
        return 0
    rows, padded = _state_rows(prob, splits)
    return (2 * padded + rows * prob.D) * 4


def decode_supported(prob: Problem) -> str | None:
    """Why the decode path cannot (or should not) run ``prob``, or None when it can."""
    if _kern.IMPORT_ERROR is not None:
        return _kern.IMPORT_ERROR
    if prob.device.type not in ("cuda", "cpu"):
        return f"runs on CUDA tensors (compiled) or CPU tensors (interpreter); got {prob.device}"
    if prob.Nq > MAX_DECODE_NQ:
        return f"the decode path takes Nq <= {MAX_DECODE_NQ} query rows; got Nq={prob.Nq} (a prefill)"
    if prob.Dv != prob.D:
        return f"the decode kernels take one head dim for q, k and v; got D={prob.D}, Dv={prob.Dv}"
    if prob.B > 65535 or prob.Hkv * row_tiles(prob) > 65535:
        return f"grid limit: B and Hkv * row tiles must be at most 65535; got B={prob.B}, Hkv={prob.Hkv}"
    if prob.device.type == "cuda" and prob.dtype == torch.bfloat16:
        if torch.cuda.get_device_capability(prob.device)[0] < 8:
            return "bfloat16 needs compute capability 8.0 or newer"
    return None


def decode_forward(
    prob: Problem,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
    splits: int | None = None,
    config: DecodeConfig | None = None,
    paged: PagedKV | None = None,
    append: Append | None = None,
) -> None:
    """Split-KV decode of ``prob`` into ``out`` ([B, Hq, Nq, D] view, q's dtype) and ``lse`` ([B, Hq, Nq]
    float32, or None), writing every element (the backend contract of :meth:`attnlab.backends.Backend.forward`).

    Paged cache: pass ``k_cache``, ``v_cache`` ([num_blocks, block_size, Hkv, D]) and ``block_table`` (int32
    [B, max_blocks]) together; ``prob`` then supplies q, the masks, the scale and the shapes (Hkv, D and
    Nk = max_blocks * block_size), and its k and v are never read (they may be stride-0 placeholders).
    ``block_size`` is optional (it is the caches' second dim). ``splits`` forces the split count (default:
    :func:`num_splits`; a fixed INTERPRETER_SPLITS on CPU); ``config`` the GPU tile config. ``paged``: a cache
    :func:`attnlab.paged.paged_kv` has already validated (the backend's ``forward_paged`` passes it), in place
    of the three tensors. ``append``: a validated KV append (:class:`attnlab.kv_append.Append`) that the split
    kernel writes into the caches as it reads the new keys (``prob``'s kv_len then holds the lengths after it).

    GPU calls of one signature share a launch plan (:func:`gpu_plan`), launched without Triton's JIT dispatch.
    """
    given = [x is not None for x in (k_cache, v_cache, block_table)]
    if paged is None and any(given):
        if not all(given):
            raise ValueError("a paged cache needs k_cache, v_cache and block_table together")
        paged = paged_kv(k_cache, v_cache, block_table, B=prob.B, Hkv=prob.Hkv, D=prob.D, Nk=prob.Nk,
                         dtype=prob.dtype, device=prob.device, block_size=block_size, kv_len=prob.spec.kv_len)
    if out.numel() == 0 or prob.Nk == 0:
        if append is not None:  # nothing to attend: the append is still written
            append.write()
        out.zero_()
        if lse is not None:
            lse.copy_(prob.mods.empty_lse(lse))
        return
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be at least 1; got {splits}")
    if not prob.q.is_cuda:
        _Plan(prob, config or INTERPRETER_CONFIG, splits or INTERPRETER_SPLITS, paged, True, append).launch(
            prob, paged, out, lse, append)
        return
    with torch.cuda.device(prob.device):
        gpu_plan(prob, config, splits, paged, append).launch(prob, paged, out, lse, append)


def gpu_plan(prob: Problem, cfg: DecodeConfig | None = None, n_split: int | None = None,
             paged: PagedKV | None = None, append: Append | None = None) -> _Plan:
    """The plan of ``prob``'s call signature (attnlab.attention makes a new Problem per call): what the fused
    forward's plans are keyed by, plus the decode config, the split count (None: the plan picks it from its
    compiled kernel's occupancy), the paged caches' layout and the append's new keys. The default config
    (``cfg`` None) follows from the signature alone, so it is chosen only when the plan is made."""
    key = (_rt.call_signature(prob), cfg, n_split, None if paged is None else tuple(
        tensor_key(t) for t in (paged.k_cache, paged.v_cache, paged.block_table)),
        None if append is None else (append.layout, *(tensor_key(t) for t in (append.k_new, append.v_new))))
    plan = _PLANS.get(key)
    if plan is None:
        evict_oldest(_PLANS, _rt.MAX_PLANS)
        cfg = cfg or default_config(prob.dtype, prob.D, paged is not None, block_m(prob),
                                    prob.spec.kv_len is not None, _deep_fits(prob.device.index or 0))
        plan = _PLANS[key] = _Plan(prob, cfg, n_split, paged, False, append)
    return plan


_PLANS: dict[tuple, _Plan] = {}  # decode plans by call signature (bounded like the fused forward's)

def _explicit(prob: Problem) -> torch.Tensor | None:
    """The explicit mask (as bytes) or bias, or None."""
    spec = prob.spec
    explicit = spec.mask if spec.mask is not None else spec.bias
    return explicit.view(torch.uint8) if explicit is not None and explicit.dtype == torch.bool else explicit


def _stand_ins(prob: Problem) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """What a warmup compiles the decode's kernels for without the real buffers: a float32 tensor standing in
    for the split states, and the strides out will have (its [B, Hq, Nq, D] view of the caller's layout)."""
    Hq, Nq, D = prob.Hq, prob.Nq, prob.D
    strides = (Hq * Nq * D, Nq * D, D, 1) if prob.layout == "bhnd" else (Nq * Hq * D, D, Hq * D, 1)
    return torch.empty(4, dtype=torch.float32, device=prob.device), strides


def _tensors(prob: Problem, paged: PagedKV | None, append: Append | None = None) -> tuple:
    """The split kernel's eleven tensor arguments (placeholders stand in for absent ones; never read). With an
    append the kernel takes the lengths before it, and the new keys and values."""
    spec, q, mods = prob.spec, prob.q, prob.mods
    k, v, bt = (prob.k, prob.v, q) if paged is None else (paged.k_cache, paged.v_cache, paged.block_table)
    e = _explicit(prob)
    kv_len = append.before if append is not None else spec.kv_len
    return (q, k, v, bt, kv_len if kv_len is not None else q,
            spec.q_len if spec.q_len is not None else q, e if e is not None else q,
            mods.alibi if mods.alibi is not None else q, _sinks(prob),
            *((q, q) if append is None else (append.k_new, append.v_new)))


def _new_keys(append: Append) -> tuple[torch.Tensor, torch.Tensor]:
    """An append's new keys and values as [B, Hkv, Nnew, D] views (their strides are what the kernel takes)."""
    if append.layout == "bhnd":
        return append.k_new, append.v_new
    return append.k_new.transpose(1, 2), append.v_new.transpose(1, 2)


def _sinks(prob: Problem) -> torch.Tensor:
    """The sinks as the kernels read them (contiguous, in their dtype), or q standing in (never read)."""
    return prob.mods.kernel_sinks if prob.mods.sinks is not None else prob.q


class _Plan:
    """The launches of one problem with one config, split count and cache: the split kernel and, with more
    than one split, the merge. The split states are allocated per call on the whole way (stream-ordered by
    torch's allocator); fast calls use the buffer held for their stream (:func:`.decode_launch.held_workspace`)."""

    def __init__(self, prob: Problem, cfg: DecodeConfig, n_split: int | None, paged: PagedKV | None,
                 interpret: bool, append: Append | None = None):
        spec, q = prob.spec, prob.q
        self.has_append = append is not None
        self.interpret, self.merge_rows = interpret, prob.B * prob.Hq * prob.Nq
        if paged is None:
            k, v = prob.k, prob.v
            k_strides, v_strides, s_bt, nb = k.stride(), v.stride(), 0, 1
        else:
            k, v, bt = paged.k_cache, paged.v_cache, paged.block_table
            # caches [block, slot, head, d], passed as (block, head, slot, d): the dense argument order
            (k0, k1, k2, k3), (v0, v1, v2, v3) = k.stride(), v.stride()
            k_strides, v_strides = (k0, k2, k1, k3), (v0, v2, v1, v3)
            s_bt, nb = bt.stride(0), paged.num_blocks
        e_strides = (0, 0, 0, 0) if _explicit(prob) is None else _explicit(prob).stride()
        mods = prob.mods
        a_strides = mods.alibi.stride() if mods.alibi is not None else (0, 0)
        n_rt = row_tiles(prob, interpret)
        new_strides = (0,) * 8 if append is None else tuple(x for t in _new_keys(append) for x in t.stride())
        # Everything but the eleven tensors, which change from call to call (see _tensors).
        self.fixed = (
            *q.stride(), *k_strides, *v_strides, s_bt, *e_strides, *a_strides, *new_strides,
            prob.Hq, prob.Nq, prob.Nk, prob.D, prob.group, n_rt, nb, prob.scale * _kern.LOG2E,
            spec.left if spec.left is not None else 0, spec.right if spec.right is not None else 0,
            mods.softcap * _kern.LOG2E if mods.softcap is not None else 0.0, 0 if append is None else append.n_new,
        )
        self.has_sinks = mods.sinks is not None
        self.block_d = padded_head_dim(prob.D)
        self.cfg = cfg
        self.pdl = PDL and not interpret and _has_pdl(prob.device.index or 0)
        if n_split is None:  # one wave of as many programs as the compiled split kernel fits on the SMs
            device = prob.device.index or 0
            sms = _sm_count(device)
            n_split = num_splits(prob, cfg, sms)  # assuming PROGRAMS_PER_SM
            if not interpret:
                self._merge_ahead(prob, n_split)
            # The occupancy only ever lowers the aim: compile first and look, unless even one program per SM
            # gives the same count (one split, or the ragged rule, which ignores it).
            if num_splits(prob, cfg, sms, resident=1) != n_split:
                n_split = num_splits(prob, cfg, sms, resident=self._resident(prob, paged, n_rt, device, append))
        self.n_split = n_split
        self.constants = self._constants(prob, paged, n_rt, n_split == 1)
        self.grid = (n_split, prob.Hkv * n_rt, prob.B)
        self.kernels: dict[bool, tuple[Kernel, Kernel]] = {}  # write_lse -> (split, merge)

    def _constants(self, prob: Problem, paged: PagedKV | None, n_rt: int, final: bool) -> dict:
        """The split kernel's constexpr arguments but WRITE_LSE."""
        spec, bd = prob.spec, self.block_d
        return dict(
            BLOCK_M=block_m(prob, self.interpret), BLOCK_N=self.cfg.block_n, BLOCK_D=bd, EVEN_D=bd == prob.D,
            BLOCK_SIZE=1 if paged is None else paged.block_size,
            HAS_LEFT=spec.left is not None, HAS_RIGHT=spec.right is not None,
            BOTTOM_RIGHT=spec.align == "bottom_right", HAS_KV_LEN=spec.kv_len is not None,
            HAS_Q_LEN=spec.q_len is not None, HAS_MASK=spec.mask is not None, HAS_BIAS=spec.bias is not None,
            PAGED=paged is not None, FINAL=final,
            # the interpreter multiplies bfloat16 bit patterns as integers in tl.dot: upcast first (exact)
            UPCAST=self.interpret and prob.dtype != torch.float32, DOT_PRECISION="ieee", PDL=self.pdl and not final,
            HAS_SOFTCAP=prob.mods.softcap is not None, HAS_ALIBI=prob.mods.alibi is not None,
            HAS_SINKS=prob.mods.sinks is not None, HAS_APPEND=self.has_append,
        )

    def _resident(self, prob: Problem, paged: PagedKV | None, n_rt: int, device: int,
                  append: Append | None) -> int | None:
        """Programs per SM of the split kernel that stores split states (compiled, not launched, on the
        first call's tensors, as a call without lse launches it, so that such a call finds it compiled), or
        None when that cannot be said (the split count then assumes PROGRAMS_PER_SM)."""
        cfg = self.cfg
        f32, o_strides = _stand_ins(prob)
        args = (*_tensors(prob, paged, append), *self.fixed, prob.q, prob.q, f32, f32, f32, *o_strides, 0, 0, 0)
        try:
            kernel = _rt.compile_only(decode_split_kernel, args, dict(**cfg.options(), WRITE_LSE=False,
                                      **self._constants(prob, paged, n_rt, False)), device)
        except Exception:  # a Triton whose warmup differs (tests bind these arguments to the signature)
            return None
        return resident_programs(kernel, cfg.num_warps, device)

    def _merge(self, write_lse: bool, n_split: int) -> Kernel:
        merge_fn = _interp.interpreted_fn(decode_merge_kernel) if self.interpret else decode_merge_kernel
        merge_d = min(MERGE_BLOCK_D, self.block_d)
        return Kernel(merge_fn, (self.merge_rows, self.block_d // merge_d, 1),
                       dict(BLOCK_S=min(64, pow2_bucket(n_split)), BLOCK_D=merge_d, WRITE_LSE=write_lse,
                            PDL=self.pdl, HAS_SINKS=self.has_sinks),
                       dict(num_warps=2, num_stages=1, **({"launch_pdl": True} if self.pdl else {}),
                            **_cfg.COMPILE_OPTIONS))

    def _merge_ahead(self, prob: Problem, n_split: int) -> None:
        """Start compiling the merge of a call without lse for ``n_split`` splits on a worker thread, while this
        thread compiles the split kernel (a split count the occupancy lowers later only costs the background
        work)."""
        if n_split == 1 or not _cfg.COMPILE_AHEAD:
            return
        merge = self._merge(False, n_split)
        f32, o_strides = _stand_ins(prob)
        o = torch.empty(8, dtype=prob.dtype, device=prob.device)  # for out (and lse, which out stands in for)
        args = (f32, f32, f32, o, o, _sinks(prob), *o_strides, 0, 0, 0, prob.Hq, prob.Nq, prob.D, n_split)
        background.ahead(merge.fn, merge.grid, args, {**merge.constants, **merge.options}, prob.device)

    def _kernels(self, write_lse: bool) -> tuple[Kernel, Kernel]:
        got = self.kernels.get(write_lse)
        if got is None:
            split_fn = _interp.interpreted_fn(decode_split_kernel) if self.interpret else decode_split_kernel
            split = Kernel(split_fn, self.grid, dict(self.constants, WRITE_LSE=write_lse), self.cfg.options())
            got = self.kernels[write_lse] = (split, self._merge(write_lse, self.n_split))
        return got

    def _workspace(self, prob: Problem, out: torch.Tensor) -> tuple:
        """The split states m, l, acc (float32 views of one allocation); out stands in with one split."""
        if self.n_split == 1:
            return out, out, out
        rows, padded = _state_rows(prob, self.n_split)
        ws = torch.empty(workspace_bytes(prob, self.n_split) // 4, dtype=torch.float32, device=prob.device)
        return ws[:rows], ws[padded:padded + rows], ws[2 * padded:]

    def fast_call(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None):
        """As the fused forward's :meth:`attnlab.backends.triton.forward._Plan.fast_call`: ``(q, k, v, kv_len,
        q_len, mask, block_table, alibi_slopes, sinks[, k_new, v_new]) -> (out, lse or None)``, allocating out and
        lse as :meth:`launch` does and keeping the split states in the buffer held for the stream (a new one under
        graph capture, with HOLD_WORKSPACE off, or while that buffer's lock is taken); with a paged cache k and v
        are the caches; with an append (a plan made for one) kv_len holds the lengths before it."""
        write_lse = lse is not None
        split, merge = self._kernels(write_lse)
        lse_arg = lse if write_lse else out
        key = _rt.layout_key(out, lse_arg, *self._workspace(prob, out))
        strides = (*out.stride(), *(lse.stride() if write_lse else (0, 0, 0)))
        merge_tail = (prob.Hq, prob.Nq, prob.D, self.n_split)
        # split: (q, k, v, block table, kv_len, q_len, mask, slopes, sinks, k_new, v_new; fixed; out, lse, m, l, acc;
        # strides),
        # merge: (m, l, acc, out, lse, sinks; strides and sizes).
        go_split = split.direct(key, 11, self.fixed, strides)
        go_merge = merge.direct(key, 6, (), (*strides, *merge_tail)) if self.n_split > 1 else None
        if go_split is None or (self.n_split > 1 and go_merge is None):
            return None
        empty_like, contiguous = torch.empty_like, torch.contiguous_format
        lse_shape, dev, index = (prob.B, prob.Hq, prob.Nq), prob.device, prob.device.index
        current_stream, pointers = _rt.current_stream, _rt.pointers
        _, padded = _state_rows(prob, self.n_split)
        ws_numel = workspace_bytes(prob, self.n_split) // 4
        lock = _launch.HELD_LOCK

        def call(q, k, v, kv_len, q_len, mask, block_table, alibi_slopes, sinks, k_new=None, v_new=None):
            if not _rt.FAST_LAUNCH:
                return None  # every launch through the JIT: take the whole way
            o = empty_like(q, memory_format=contiguous)  # q's shape, dtype and device: out's (cheaper than empty)
            m = torch.empty(lse_shape, dtype=torch.float32, device=dev) if write_lse else None
            stream = current_stream(index)
            # (placeholders, never read, stand in for absent tensors)
            *tensors, o_ptr, l_ptr = pointers((q, k, v, q if block_table is None else block_table,
                                               q if kv_len is None else kv_len, q if q_len is None else q_len,
                                               q if mask is None else mask, q if alibi_slopes is None else alibi_slopes,
                                               q if sinks is None else sinks, q if k_new is None else k_new,
                                               q if v_new is None else v_new, o, o if m is None else m))
            if go_merge is None:
                go_split(stream, *tensors, o_ptr, l_ptr, o_ptr, o_ptr, o_ptr)
                return o, m
            # One allocation for the split states m, l and acc: the stream's held buffer (under the lock, if
            # free), or under graph capture (the graph's private pool), with HOLD_WORKSPACE off or the lock
            # taken a new one, kept (ws) until both launches are queued: freed earlier, another thread's
            # allocation on this stream could take it first.
            held = _launch.HOLD_WORKSPACE and not _launch.capturing() and lock.acquire(blocking=False)
            try:
                ws = (_launch.held_workspace(index, stream, ws_numel) if held
                      else torch.empty(ws_numel, dtype=torch.float32, device=dev))
                ws_m = ws.data_ptr()
                ws_l, ws_acc = ws_m + 4 * padded, ws_m + 8 * padded
                go_split(stream, *tensors, o_ptr, l_ptr, ws_m, ws_l, ws_acc)
                go_merge(stream, ws_m, ws_l, ws_acc, o_ptr, l_ptr, tensors[8])  # (the sinks, or q standing in)
            finally:
                if held:
                    lock.release()
            return o, m

        return call

    def launch(self, prob: Problem, paged: PagedKV | None, out: torch.Tensor, lse: torch.Tensor | None,
               append: Append | None = None) -> None:
        """Launch for ``prob`` (of this plan's signature: only its tensors differ from the plan's first)."""
        S = self.n_split
        split, merge = self._kernels(lse is not None)
        lse_arg = lse if lse is not None else out  # never written without WRITE_LSE
        l_strides = lse.stride() if lse is not None else (0, 0, 0)
        ws_m, ws_l, ws_acc = self._workspace(prob, out)
        per_call = (out, lse_arg, ws_m, ws_l, ws_acc, *out.stride(), *l_strides)
        key = _rt.layout_key(out, lse_arg, ws_m, ws_l, ws_acc)
        device = prob.device.index or 0
        with _interp.interpreter(decode_merge_kernel) if self.interpret else contextlib.nullcontext():
            split.launch((*_tensors(prob, paged, append), *self.fixed, *per_call), key, device)
            if S > 1:
                merge.launch((ws_m, ws_l, ws_acc, out, lse_arg, _sinks(prob), *out.stride(), *l_strides, prob.Hq,
                              prob.Nq, prob.D, S), key, device)
