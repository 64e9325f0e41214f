"""Launch configurations of the Triton kernels: the forward's :class:`Config` and its GPU space
(:func:`candidates`), the backward's :class:`BwdConfig` and its two spaces (:func:`dkdv_candidates`,
:func:`dq_candidates`), what a tuned forward config and a tuned backward pair are remembered by
(:func:`tune_key`, :func:`bwd_tune_key`), the one order every kernel's config is chosen in (:func:`choose`),
timing candidates (:func:`fastest`), and the TF32 opt-in. The forward kernel's compile-time choices that follow
from a config (D chunk, orientation) are here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from attnlab.backends.triton import tune_cache, tuned_table
from attnlab.problem import Problem


@dataclass(frozen=True, repr=False)
class Config:
    """One launch configuration: tile sizes, the compiler's warps and pipeline stages, and two float32
    options: the D chunk of the Q K^T product (0: one dot over all of D) and ``keys_major`` (the score
    tile held as S^T, keys by queries; see :func:`kernel_key_axis`)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    qk_chunk: int = 0
    keys_major: bool = False
    rows_outer: bool = False

    def __post_init__(self) -> None:
        if self.keys_major and self.qk_chunk:
            raise ValueError(f"keys_major and qk_chunk exclude each other (keys-major Q K^T is one dot); got "
                             f"qk_chunk={self.qk_chunk} with keys_major=True")

    def __repr__(self) -> str:
        chunk = f", qk_chunk={self.qk_chunk}" if self.qk_chunk else ""
        major = ", keys_major=True" if self.keys_major else ""
        outer = ", rows_outer=True" if self.rows_outer else ""
        return (f"Config(block_m={self.block_m}, block_n={self.block_n}, num_warps={self.num_warps}, "
                f"num_stages={self.num_stages}{chunk}{major}{outer})")


#: The one config of the interpreter: small tiles, so that the CPU tests' short sequences still span
#: several row and key tiles (full and partial phases both run). float32 runs keys-major, as its GPU
#: candidates do (the option is ignored for float16/bfloat16).
INTERPRETER_CONFIG = Config(16, 16, 1, 1, keys_major=True, rows_outer=True)

#: Whether a GPU launch of a problem not tuned before times the candidates first (ATTNLAB_AUTOTUNE=1); by default
#: it takes its config from the shipped table (:mod:`.tuned_table`), and tunes only when asked (:func:`tune`).
AUTOTUNE: bool = os.environ.get("ATTNLAB_AUTOTUNE", "0") == "1"

TF32 = False
#: Whether a forward that will be differentiated starts compiling the backward's kernels in the background
#: (ATTNLAB_COMPILE_AHEAD=0: not; each kernel then compiles when it is first launched).
COMPILE_AHEAD: bool = os.environ.get("ATTNLAB_COMPILE_AHEAD", "1") != "0"
#: Options every kernel is compiled with besides its config: floating-point contraction (FMA) on, as Triton has
#: always defaulted to. Said explicitly because triton 3.9 warns that its default turns it off from 3.10; the
#: kernels' speed and every recorded result assume it on.
COMPILE_OPTIONS: dict = {"enable_fp_fusion": True}
#: Whether launches ignore the configs tuned on this machine and take the shipped table's (:func:`shipped_only`).
SHIPPED_ONLY = False
#: Configs tuned in this process or found in the persistent cache, by tune key.
_tuned: dict[tuple, Config] = {}
#: Configs taken from the shipped table or the heuristic default, by tune key.
_picked: dict[tuple, Config] = {}


@contextlib.contextmanager
def allow_tf32() -> Iterator[None]:
    """Opt in to TF32 tensor-core dot products for float32 inputs inside this block (GPU only).

    TF32 keeps 10 mantissa bits, the same unit roundoff (2^-11) as float16, so a TF32 result is checked
    at float16's tolerances; without this, float32 uses exact IEEE products. The interpreter computes
    float32 products exactly in either case.
    """
    global TF32
    old, TF32 = TF32, True
    try:
        yield
    finally:
        TF32 = old


@contextlib.contextmanager
def shipped_only() -> Iterator[None]:
    """Inside this block GPU launches ignore configs tuned on this machine (in this process or on disk) and use
    the shipped table's, as a new user's first run does: the benchmark times both side by side this way."""
    global SHIPPED_ONLY
    old, SHIPPED_ONLY = SHIPPED_ONLY, True
    try:
        yield
    finally:
        SHIPPED_ONLY = old


#: Times the candidates of a problem and returns the fastest (:func:`attnlab.backends.triton.forward.autotune`).
Autotune = Callable[[Problem, torch.Tensor, "torch.Tensor | None"], Config]


def candidates(dtype: torch.dtype, block_d: int) -> list[Config]:
    """The GPU autotune space for a dtype and padded head dim; the first entry is the untuned default.

    Sized for Hopper/Ampere shared memory (Q tile plus ``num_stages`` K and V tiles).
    """
    if dtype == torch.float32:
        # IEEE products run on the FMA units, through shared memory: keys-major tiles (see kernel_key_axis) read it
        # without bank conflicts (docs/decisions.md, "float32 tiles"). One query-major candidate each keeps that
        # orientation in the space (and in the GPU tests).
        if block_d <= 64:
            return [Config(64, 32, 4, 2, keys_major=True, rows_outer=True), Config(32, 64, 4, 2, keys_major=True),
                    Config(32, 64, 4, 2, keys_major=True, rows_outer=True), Config(64, 64, 8, 2, keys_major=True),
                    Config(32, 64, 4, 2, qk_chunk=16)]
        if block_d <= 128:
            return [Config(32, 32, 4, 2, keys_major=True, rows_outer=True), Config(32, 64, 8, 2),
                    Config(32, 64, 8, 2, qk_chunk=16)]
        return [Config(16, 64, 8, 2)]
    if block_d <= 64:
        # (64, 64, 4, 2): for small causal problems (docs/decisions.md, "float32 tiles" and the tuned table)
        return [Config(128, 64, 4, 3), Config(128, 128, 8, 3), Config(128, 64, 8, 4), Config(64, 64, 4, 3),
                Config(64, 64, 4, 2)]
    if block_d <= 128:
        return [Config(128, 64, 8, 3), Config(128, 128, 8, 2), Config(64, 64, 4, 3), Config(128, 32, 4, 3)]
    return [Config(64, 32, 4, 2), Config(64, 64, 8, 2), Config(128, 64, 8, 2)]


# ---- the backward's configs (its kernels: attnlab.backends.triton.backward) --------------------------------
@dataclass(frozen=True)
class BwdConfig:
    """Launch configuration of one backward kernel: BLOCK_M query rows by BLOCK_N keys, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


#: A block's shared memory below which the backward at 256-wide head tiles starts from its narrow configs (its
#: wide first ones ask for up to about 192 KiB at D 256; docs/decisions.md, "The backward's 256-wide tiles").
WIDE_TILES_SHARED_BYTES = 200 * 1024
#: The widest padded value dim at which the backward at 256-wide head tiles starts from its wide configs (D 192 /
#: Dv 128, the MLA shape); at D = Dv = 256 the narrow ones are faster (docs/decisions.md, same entry).
WIDE_TILES_MAX_DV = 128


def wide_tiles_first(block_dv: int, shared_bytes: int | None) -> bool:
    """Whether the backward at 256-wide head tiles starts from its wide configs: the value tile (``block_dv``, the
    padded Dv) at most :data:`WIDE_TILES_MAX_DV` wide, and a block's shared memory (``shared_bytes``; None: a
    Hopper SM's) at least :data:`WIDE_TILES_SHARED_BYTES`, so that no wide candidate fails to fit first."""
    return block_dv <= WIDE_TILES_MAX_DV and (shared_bytes is None or shared_bytes >= WIDE_TILES_SHARED_BYTES)


def dkdv_candidates(dtype: torch.dtype, block_d: int, one_pass: bool = False,
                    wide_first: bool = False) -> list[BwdConfig]:
    """GPU configs of the dK/dV kernel (the first is the default): a large key tile (stationary: K, V
    and two float32 accumulators live for the whole program) and a smaller query tile that streams. With
    ``one_pass`` (dQ added up inside it; head dims up to 128) half types at D 128 start from 32-row query
    tiles: the third product's operands and dQ tile leave 64-row tiles spilling (ptxas, sm_90)."""
    if one_pass and dtype != torch.float32 and 64 < block_d <= 128:
        return [BwdConfig(32, 128, 8, 3), BwdConfig(32, 128, 8, 2), BwdConfig(64, 128, 8, 3), BwdConfig(64, 64, 8, 3)]
    if dtype == torch.float32:  # IEEE products on the FMA units: small tiles, registers are the limit
        if block_d <= 64:
            return [BwdConfig(32, 64, 4, 2), BwdConfig(32, 32, 4, 2), BwdConfig(16, 64, 4, 2)]
        if block_d <= 128:
            return [BwdConfig(16, 32, 4, 2), BwdConfig(32, 32, 8, 2)]
        return [BwdConfig(16, 16, 4, 1), BwdConfig(16, 32, 8, 1)]
    # Eight warps and a third stage, which hides the streaming Q and dO loads behind the five dots (docs/decisions.md,
    # "The backward's tiles").
    if block_d <= 64:
        return [BwdConfig(64, 128, 8, 3), BwdConfig(64, 64, 4, 3), BwdConfig(32, 128, 4, 3),
                BwdConfig(64, 128, 8, 2)]
    if block_d <= 128:
        return [BwdConfig(64, 128, 8, 3), BwdConfig(64, 128, 8, 2), BwdConfig(32, 64, 4, 2), BwdConfig(32, 128, 8, 3)]
    # 256-wide head tiles (D 129-256): one stage and 64 keys a program, or with ``wide_first``
    # (:func:`wide_tiles_first`) 128 keys and two stages, ordered by a sweep (docs/decisions.md, "The backward's
    # 256-wide tiles"); both lists hold the same configs, for the tuner.
    wide = [BwdConfig(32, 128, 8, 2), BwdConfig(16, 128, 8, 2), BwdConfig(32, 64, 4, 2)]
    narrow = [BwdConfig(32, 64, 8, 1), BwdConfig(32, 32, 4, 1), BwdConfig(16, 64, 4, 1)]
    return wide + narrow if wide_first else narrow + wide


def dq_candidates(dtype: torch.dtype, block_d: int, wide_first: bool = False) -> list[BwdConfig]:
    """GPU configs of the dQ kernel (the first is the default): a large row tile (stationary: Q, dO and
    the dQ accumulator), key tiles streaming."""
    if dtype == torch.float32:
        if block_d <= 64:
            return [BwdConfig(64, 32, 4, 2), BwdConfig(32, 32, 4, 2), BwdConfig(64, 16, 4, 2)]
        if block_d <= 128:
            return [BwdConfig(32, 16, 4, 2), BwdConfig(32, 32, 8, 2)]
        return [BwdConfig(16, 16, 4, 1), BwdConfig(32, 16, 8, 1)]
    if block_d <= 64:
        return [BwdConfig(128, 64, 8, 3), BwdConfig(128, 32, 4, 3), BwdConfig(64, 64, 4, 3)]
    if block_d <= 128:
        # ordered by a sweep (docs/decisions.md, "The backward's tiles")
        return [BwdConfig(128, 64, 8, 3), BwdConfig(64, 64, 4, 2), BwdConfig(128, 32, 8, 2), BwdConfig(64, 32, 4, 3)]
    wide = [BwdConfig(128, 64, 8, 1), BwdConfig(128, 32, 8, 1)]  # as the dK/dV space's, at 256-wide tiles
    narrow = [BwdConfig(64, 32, 8, 1), BwdConfig(64, 16, 4, 1), BwdConfig(32, 32, 4, 1)]
    return wide + narrow if wide_first else narrow + wide


def pow2_bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def padded_head_dim(D: int) -> int:
    """The head dim the kernel works on: D padded to a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, pow2_bucket(D))


def problem_head_dim(prob: Problem) -> int:
    """The head dim a problem's configs are chosen and tuned for: the larger of D and Dv, padded (the one that
    bounds the tiles' registers)."""
    return padded_head_dim(max(prob.D, prob.Dv))


def kernel_qk_chunk(cfg: Config, block_d: int) -> int:
    """The kernel's QK_CHUNK for ``cfg``: 0 (one dot) unless a chunk of at least 16 splits BLOCK_D."""
    return cfg.qk_chunk if 16 <= cfg.qk_chunk < block_d else 0


def kernel_key_axis(cfg: Config, dtype: torch.dtype) -> int:
    """The kernel's KEY_AXIS: 0 (keys-major, S^T = K Q^T; why: "Keys-major float32" in
    :mod:`attnlab.backends.triton.forward_kernel`) for a float32 ``keys_major`` config, else 1. Half types keep the
    tensor-core orientation."""
    return 0 if cfg.keys_major and dtype == torch.float32 else 1


def kind_of(prob: Problem) -> str:
    """The mask kind a problem's configs are keyed by: its spec's, with ``+varlen`` for a packed call and the
    score modifiers in play."""
    mods = prob.mods
    extra = [n for n, on in (("varlen", prob.packed is not None), ("softcap", mods.softcap is not None),
                             ("alibi", mods.alibi is not None), ("sinks", mods.sinks is not None)) if on]
    return "+".join([prob.spec.kind, *extra])


def tune_key(prob: Problem) -> tuple:
    """What a tuned config is remembered by: device, dtype, head dim, mask kind and size buckets."""
    return (
        prob.device.index, prob.dtype, problem_head_dim(prob), kind_of(prob),
        TF32, pow2_bucket(prob.Nq), pow2_bucket(prob.Nk), pow2_bucket(prob.B * prob.Hq),
    )


def bwd_tune_key(prob: Problem) -> tuple:
    """What a tuned pair of backward configs is remembered by: device, dtype, head dim, mask kind (at 256-wide tiles
    with ``+dv<width>`` where the padded Dv is at most :data:`WIDE_TILES_MAX_DV`: there Dv orders the candidates,
    :func:`wide_tiles_first`), GQA group and size buckets."""
    block_d, block_dv = problem_head_dim(prob), padded_head_dim(prob.Dv)
    kind = kind_of(prob) + (f"+dv{block_dv}" if block_d > 128 and block_dv <= WIDE_TILES_MAX_DV else "")
    return (prob.device.index, prob.dtype, block_d, kind, prob.group, pow2_bucket(prob.Nq), pow2_bucket(prob.Nk),
            pow2_bucket(prob.B * prob.Hq))


#: How long autotune warms up and times each candidate (ms, ``do_bench``'s warmup and rep): longer timings picked
#: configs that the public call then ran slower (docs/decisions.md, "How long a tune times each candidate").
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 20
#: Candidates whose first timing is within CONFIRM_WITHIN of the fastest's are timed CONFIRM_ROUNDS more times,
#: interleaved, and the lowest median of their timings wins: one 20 ms timing cannot separate configs a few per
#: cent apart, and two tunes of one key then disagreed (docs/decisions.md, "The shipped table against tuning").
CONFIRM_WITHIN, CONFIRM_ROUNDS = 0.05, 3


def fastest(configs: list, launch, what: str):
    """The config among ``configs`` whose ``launch(cfg)`` takes the least median GPU time (``do_bench`` clears
    the L2 before each call); a config that does not fit the GPU (shared memory, registers) is skipped. Every
    candidate is compiled (and launched once) first, in parallel threads: Triton's compiler releases the GIL.
    Candidates close to the fastest are timed again before one is kept (CONFIRM_WITHIN); ties keep the earlier."""
    from triton.testing import do_bench

    gpu = torch.cuda.is_available()
    device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if gpu else (None, None)

    def on_callers_stream() -> contextlib.AbstractContextManager:
        if not gpu:
            return contextlib.nullcontext()
        both = contextlib.ExitStack()
        both.enter_context(torch.cuda.device(device))
        both.enter_context(torch.cuda.stream(stream))
        return both

    def fits(cfg) -> bool:
        try:
            with on_callers_stream():
                launch(cfg)
        except Exception as err:
            if out_of_resources(err):
                return False
            raise
        return True

    # The first candidate on this thread (it sets up the JIT's per-device state once), the rest in parallel,
    # each loading its launcher in turn.
    from attnlab.backends.triton import background

    background.serialize_kernel_loads()
    first = fits(configs[0])
    with ThreadPoolExecutor(max_workers=max(1, min(len(configs) - 1, os.cpu_count() or 1))) as pool:
        oks = [first, *pool.map(fits, configs[1:])]
    fitting = [cfg for cfg, ok in zip(configs, oks) if ok]
    if gpu:
        torch.cuda.synchronize()
    if not fitting:
        raise RuntimeError(f"no Triton config fits this GPU for {what}")

    def timed(cfg) -> float:
        return do_bench(lambda: launch(cfg), warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median")

    times = {i: [timed(cfg)] for i, cfg in enumerate(fitting)}  # by position: configs need not be hashable
    first_best = min(t[0] for t in times.values())
    close = [i for i, t in times.items() if t[0] <= first_best * (1 + CONFIRM_WITHIN)]
    if len(close) > 1:
        for _ in range(CONFIRM_ROUNDS):
            for i in close:
                times[i].append(timed(fitting[i]))
    return fitting[min(close, key=lambda i: (statistics.median(times[i]), i))]


def out_of_resources(err: BaseException) -> bool:
    """Whether ``err`` says a config does not fit the GPU (shared memory, registers): Triton's OutOfResources."""
    return "OutOfResources" in type(err).__name__ or "out of resource" in str(err).lower()


def next_fitting(space: list, cfg, what: str):
    """The candidate after ``cfg`` in ``space`` (a config that did not fit this GPU), with a warning; None when
    there is none."""
    later = space[space.index(cfg) + 1:] if cfg in space else []
    if not later:
        return None
    warnings.warn(f"attnlab: the Triton config {cfg} for {what} does not fit this GPU; using {later[0]} "
                  "(attnlab.tune() finds the fastest that fits)", stacklevel=3)
    return later[0]


def fall_back(prob: Problem, cfg: Config) -> Config | None:
    """The forward's next candidate after ``cfg``, which did not fit this GPU; kept for ``prob``'s tune key."""
    nxt = next_fitting(candidates(prob.dtype, problem_head_dim(prob)), cfg, "the forward")
    if nxt is not None:
        key = tune_key(prob)
        (_tuned if key in _tuned else _picked)[key] = nxt
    return nxt


def choose(kernel: str, prob: Problem, key: tuple, parse, default, tuned: dict, picked: dict, autotune: bool,
           tune_now):
    """The config (or configs) a GPU launch of ``kernel`` (``"fwd"``, ``"bwd"``) uses, in the one order both
    kernels follow: tuned before (``tuned``: this process; then the persistent cache), else, with ``autotune``,
    ``tune_now()`` (which stores its result), else the shipped table's for this GPU family (kept in ``picked``),
    else ``default``. ``parse`` turns a stored value into a config, or None (or raises TypeError/ValueError)
    when it is no longer a candidate. Inside :func:`shipped_only`: the table's, or ``default``."""

    def parsed(value):
        with contextlib.suppress(TypeError, ValueError):
            return None if value is None else parse(value)
        return None

    def shipped():
        got = parsed(tuned_table.lookup(kernel, tuned_table.gpu_family(prob.device), key[1:]))
        return default if got is None else got

    if SHIPPED_ONLY:
        return shipped()
    got = tuned.get(key)
    if got is not None:
        return got
    if not autotune and (got := picked.get(key)) is not None:
        return got
    got = parsed(tune_cache.load(kernel, prob.device.index, key[1:]))
    if got is None and autotune:
        got = tune_now()
    if got is not None:
        tuned[key] = got
        return got
    got = picked[key] = shipped()
    return got


def config_for(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, autotune: Autotune) -> Config:
    """The config a GPU launch uses (:func:`choose`): one tuned before, else the shipped table's, else the
    heuristic default (the first candidate); with ``AUTOTUNE``, a key tuned nowhere yet is tuned now by
    ``autotune(prob, out, lse)`` (the launch module's, which times each candidate's launch)."""
    key = tune_key(prob)
    space = candidates(prob.dtype, problem_head_dim(prob))

    def parse(value: dict) -> Config | None:
        cfg = Config(**value)
        return cfg if cfg in space else None

    return choose("fwd", prob, key, parse, space[0], _tuned, _picked, AUTOTUNE,
                  lambda: _tune(prob, out, lse, key, autotune))


def tune(prob: Problem, autotune: Autotune, out: torch.Tensor | None = None,
         lse: torch.Tensor | None = None) -> Config:
    """Tune ``prob``'s key now with ``autotune`` (into ``out`` and ``lse``, or scratch ones), keep the winner in
    this process and on disk, return it."""
    if out is None:
        out, lse = prob.new_out()[1], prob.new_lse()
    key = tune_key(prob)
    cfg = _tuned[key] = _tune(prob, out, lse, key, autotune)
    return cfg


def _tune(prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, key: tuple, autotune: Autotune) -> Config:
    cfg = autotune(prob, out, lse)
    tune_cache.store("fwd", prob.device.index, key[1:], dataclasses.asdict(cfg))
    return cfg
