"""Tests of the split-KV decode path (attnlab/backends/triton/decode.py) on CPU, through Triton's interpreter.

Every case runs the decode kernels with a forced split count (several splits per sequence, splits with
no keys, one split that normalizes itself) and is judged by the checker against the float64 reference:
out with attnlab.check.compare (half types also against the textbook baseline), lse with the verify
tolerances, and no NaN anywhere. The paged cache is checked against the dense cache it scatters.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.backends.triton import decode as td
from attnlab.cases import Case, make_inputs
from attnlab.check import _lse_atol, compare
from attnlab.problem import make_problem
from attnlab.reference import reference_forward

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _check(prob, out, lse) -> None:
    """out and lse against the reference; the half types' baseline is the textbook torch backend."""
    ref, ref_lse = reference_forward(prob)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    base = None
    if prob.dtype != F32:
        base = torch.empty_like(out)
        attnlab.backends.registry()["torch"].forward(prob, base, None)
    rep = compare(out, ref, dtype=prob.dtype, base=base)
    assert rep.passed, rep
    lrep = compare(lse, ref_lse, dtype=F32, atol=_lse_atol(prob.dtype), rtol=0.0)
    assert lrep.passed, lrep
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # -inf exactly where rows are empty


def _run_case(case: Case, dtype: torch.dtype = F32, splits: int | None = 3, seed: int = 0, **paged):
    q, k, v, kw = make_inputs(case, dtype=dtype, device="cpu", seed=seed)
    prob = make_problem(q, k, v, **kw)
    out = torch.full((prob.B, prob.Hq, prob.Nq, prob.D), float("nan"), dtype=dtype)
    lse = torch.full((prob.B, prob.Hq, prob.Nq), float("nan"))
    td.decode_forward(prob, out, lse, splits=splits, **paged)
    _check(prob, out, lse)
    return prob, out, lse


# ------------------------------------------------------------------------------------------------------
# Shapes: Nq, GQA packing (row tiles when group * Nq > 16), splits
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("Nq", [1, 2, 5, 16])
@pytest.mark.parametrize("heads", [(4, 1), (8, 2), (3, 1), (2, 2)], ids=["gqa4/1", "gqa8/2", "mqa3/1", "mha"])
def test_nq_and_gqa(Nq, heads):
    Hq, Hkv = heads
    case = Case("decode", B=2, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=77, D=24, causal=True, align="bottom_right",
                kv_len=(77, 40))
    _run_case(case, splits=3)


@pytest.mark.parametrize("splits", [1, 2, 5, 7, 25, 70])
def test_split_counts(splits):
    """300 keys are 19 tiles of 16: uneven runs, and with 25 splits some splits own no tile at all; 70
    splits are merged 64 at a time (two chunks, the second mostly empty)."""
    case = Case("splits", B=2, Hq=4, Hkv=2, Nq=1, Nk=300, D=24, kv_len=(300, 123))
    _run_case(case, splits=splits)


def test_ragged_kv_len_with_zero_and_full():
    case = Case("ragged", B=4, Hq=4, Hkv=1, Nq=2, Nk=77, D=24, causal=True, align="bottom_right",
                kv_len=(0, 77, 1, 33))
    _, out, lse = _run_case(case, splits=4)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # kv_len 0: out 0, lse -inf


# ------------------------------------------------------------------------------------------------------
# Masks
# ------------------------------------------------------------------------------------------------------
MASK_CASES = [
    # speculative decoding: Nq > 1 rows at the end of the cache; kv_len 3 < Nq leaves the first rows empty
    Case("causal_br_speculative", B=3, Hq=4, Hkv=2, Nq=5, Nk=77, D=24, causal=True, align="bottom_right",
         kv_len=(77, 3, 50)),
    Case("causal_tl", B=2, Hq=4, Hkv=2, Nq=5, Nk=77, D=24, causal=True, align="top_left"),
    Case("window_br", B=2, Hq=4, Hkv=2, Nq=3, Nk=300, D=24, window=(40, 0), align="bottom_right",
         kv_len=(300, 90)),
    Case("window_tl_two_sided", B=1, Hq=2, Hkv=1, Nq=4, Nk=77, D=24, window=(5, 30), align="top_left"),
    Case("window_misses_all_keys", B=1, Hq=2, Hkv=1, Nq=2, Nk=40, D=24, window=(-3, -1), align="bottom_right"),
    Case("q_len", B=3, Hq=4, Hkv=2, Nq=5, Nk=77, D=24, causal=True, align="bottom_right", q_len=(5, 0, 2),
         kv_len=(77, 30, 9)),
    Case("bool_full_false_row", B=2, Hq=4, Hkv=2, Nq=4, Nk=77, D=24, mask="bool_full"),
    Case("bool_broadcast_1h1k", B=2, Hq=4, Hkv=1, Nq=3, Nk=77, D=24, mask="bool_1h1k", kv_len=(77, 20)),
    Case("bias_b1qk_inf_row", B=2, Hq=4, Hkv=2, Nq=4, Nk=77, D=24, mask="bias_b1qk", causal=True,
         align="bottom_right"),
    Case("bias_full_per_head", B=1, Hq=6, Hkv=2, Nq=3, Nk=77, D=24, mask="bias_full"),
]


@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: c.name)
def test_masks(case):
    _run_case(case, splits=3)


def test_all_false_mask_row_is_empty():
    case = Case("bool_full_false_row", B=1, Hq=2, Hkv=1, Nq=3, Nk=77, D=24, mask="bool_full")
    _, out, lse = _run_case(case, splits=4)
    assert (out[:, :, 1] == 0).all() and torch.isneginf(lse[:, :, 1]).all()  # make_mask empties row 1


# ------------------------------------------------------------------------------------------------------
# Layouts, views, head dims, dtypes
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("layout", "view"), [("bnhd", "contiguous"), ("bhnd", "transposed"),
                                              ("bnhd", "strided_d")])
def test_layouts_and_views(layout, view):
    case = Case("views", B=2, Hq=4, Hkv=2, Nq=2, Nk=77, D=24, layout=layout, view=view, causal=True,
                align="bottom_right", kv_len=(77, 31))
    _run_case(case, splits=3)


@pytest.mark.parametrize("D", [1, 24, 128])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_head_dims_and_dtypes(D, dtype):
    case = Case("dims", B=2, Hq=4, Hkv=2, Nq=2, Nk=77, D=D, causal=True, align="bottom_right", kv_len=(77, 45))
    _run_case(case, dtype=dtype, splits=3)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_half_masks_and_single_split(dtype):
    case = Case("half_bias", B=2, Hq=4, Hkv=1, Nq=3, Nk=77, D=24, mask="bias_b1qk", kv_len=(77, 0))
    _run_case(case, dtype=dtype, splits=1)
    _run_case(case, dtype=dtype, splits=4)


# ------------------------------------------------------------------------------------------------------
# Paged KV cache
# ------------------------------------------------------------------------------------------------------
def _paged_from_dense(k: torch.Tensor, v: torch.Tensor, block_size: int, kv_len: list[int], seed: int = 0):
    """Scatter dense [B, Hkv, Nk, D] k, v into caches [num_blocks, block_size, Hkv, D] through a shuffled
    block table (a spare block too); entries past each kv_len hold ids far out of range."""
    B, Hkv, Nk, D = k.shape
    max_blocks = Nk // block_size
    gen = torch.Generator().manual_seed(seed)
    num_blocks = B * max_blocks + 1
    perm = torch.randperm(num_blocks, generator=gen)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(k.dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(k.dtype)
    for b in range(B):
        for j in range(max_blocks):
            blk = int(perm[b, j])
            k_cache[blk] = k[b, :, j * block_size:(j + 1) * block_size].transpose(0, 1)
            v_cache[blk] = v[b, :, j * block_size:(j + 1) * block_size].transpose(0, 1)
    table = perm.clone()
    for b, n in enumerate(kv_len):
        used = -(-n // block_size)
        table[b, used:] = torch.tensor([10**6, -5] * max_blocks, dtype=torch.int32)[: max_blocks - used]
    return k_cache, v_cache, table


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_paged_matches_dense(block_size, dtype):
    """Paged (block ids read one key tile ahead of the K and V loads) is the dense result bit for bit."""
    Nk = 4 * 64
    kv_len = [Nk, 100, 0]
    case = Case("paged", B=3, Hq=4, Hkv=2, Nq=2, Nk=Nk, D=24, causal=True, align="bottom_right",
                kv_len=tuple(kv_len))
    q, k, v, kw = make_inputs(case, dtype=dtype, device="cpu", seed=3)
    k_cache, v_cache, table = _paged_from_dense(k, v, block_size, kv_len)
    prob = make_problem(q, k, v, **kw)
    dense_out, dense_lse = torch.empty_like(q), torch.empty(3, 4, 2)
    td.decode_forward(prob, dense_out, dense_lse, splits=3)
    # the dense k and v are not read: the problem may hold stride-0 placeholders of their shape
    placeholder = k.new_zeros(()).expand(k.shape)
    prob_paged = make_problem(q, placeholder, placeholder, **kw)
    out, lse = torch.empty_like(q), torch.empty(3, 4, 2)
    td.decode_forward(prob_paged, out, lse, k_cache=k_cache, v_cache=v_cache, block_table=table,
                      block_size=block_size, splits=3)
    _check(prob, out, lse)
    assert torch.equal(out, dense_out) and torch.equal(lse, dense_lse)  # same keys, same order, same sums


@pytest.mark.parametrize("block_size, Nk", [(48, 240), (1, 40)])
def test_paged_block_sizes_not_powers_of_two(block_size, Nk):
    """The block size is a compile-time constant of the kernel: any size divides keys into blocks right."""
    kv_len = [Nk, Nk // 3]
    case = Case("paged_odd", B=2, Hq=4, Hkv=2, Nq=1, Nk=Nk, D=16, kv_len=tuple(kv_len))
    q, k, v, kw = make_inputs(case, dtype=F32, device="cpu", seed=9)
    k_cache, v_cache, table = _paged_from_dense(k, v, block_size, kv_len, seed=3)
    prob = make_problem(q, k, v, **kw)
    dense, out = torch.empty_like(q), torch.empty_like(q)
    td.decode_forward(prob, dense, None, splits=2)
    td.decode_forward(prob, out, None, k_cache=k_cache, v_cache=v_cache, block_table=table, splits=2)
    assert torch.equal(out, dense)


def test_paged_with_masks_and_gqa_rows():
    Nk, block_size = 80, 16
    case = Case("paged_masks", B=2, Hq=8, Hkv=2, Nq=3, Nk=Nk, D=24, mask="bias_b1qk", kv_len=(80, 37))
    q, k, v, kw = make_inputs(case, dtype=F16, device="cpu", seed=5)
    k_cache, v_cache, table = _paged_from_dense(k, v, block_size, [80, 37], seed=1)
    prob = make_problem(q, k, v, **kw)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 3)
    td.decode_forward(prob, out, lse, k_cache=k_cache, v_cache=v_cache, block_table=table, splits=2)
    _check(prob, out, lse)


def test_paged_validation():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    prob = make_problem(q, k, v)
    cache = torch.randn(4, 16, 2, 8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="together"):
        td.decode_forward(prob, out, None, k_cache=cache, v_cache=cache)
    with pytest.raises(ValueError, match="int32"):
        td.decode_forward(prob, out, None, k_cache=cache, v_cache=cache, block_table=table.long())
    with pytest.raises(ValueError, match="max_blocks"):
        td.decode_forward(prob, out, None, k_cache=cache, v_cache=cache, block_table=torch.zeros(1, 3).int())
    with pytest.raises(ValueError, match="block_size"):
        td.decode_forward(prob, out, None, k_cache=cache, v_cache=cache, block_table=table, block_size=8)
    with pytest.raises(TypeError, match="dtype"):
        td.decode_forward(prob, out, None, k_cache=cache.half(), v_cache=cache.half(), block_table=table)


# ------------------------------------------------------------------------------------------------------
# Host-side choices
# ------------------------------------------------------------------------------------------------------
def test_supported_and_lse_optional():
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16)
    assert td.decode_supported(make_problem(q, k, k)) is None
    why = td.decode_supported(make_problem(torch.randn(1, 4, 17, 16), k, k))
    assert why is not None and "Nq" in why
    prob = make_problem(q, k, k, kv_len=[7])
    out = torch.empty_like(q)
    td.decode_forward(prob, out, None, splits=2)  # no lse requested
    assert compare(out, reference_forward(prob)[0]).passed


def test_num_splits_fills_the_gpu():
    def prob(B, Hq, Hkv, Nk):
        return make_problem(torch.empty(B, Hq, 1, 128), torch.empty(B, Hkv, Nk, 128).expand(B, Hkv, Nk, 128),
                            torch.empty(B, Hkv, Nk, 128))

    cfg = td.DecodeConfig(64)
    for B, Hq, Hkv, Nk in [(1, 32, 8, 32768), (8, 32, 8, 8192), (1, 32, 32, 131072), (16, 32, 8, 4096)]:
        p = prob(B, Hq, Hkv, Nk)
        tiles = Nk // 64
        for resident in (None, 3, 5):
            s = td.num_splits(p, cfg, sm_count=132, resident=resident)
            assert 1 <= s <= td.MAX_SPLITS and tiles // s >= td.MIN_TILES_PER_SPLIT
            per_sm = min(resident or td.PROGRAMS_PER_SM, td.PROGRAMS_PER_SM)
            # one wave: at least one program per SM, never more than fit at once
            assert 132 <= B * Hkv * s <= per_sm * 132, (B, Hkv, resident, s)
        assert td.workspace_bytes(p, s) == B * Hq * s * (128 + 2) * 4
    assert td.num_splits(prob(64, 32, 8, 256), cfg, sm_count=132) == 1  # enough programs already
    # B * Hkv alone fill the SMs (MHA): what fits besides them, or with ragged lengths (unknown on the host)
    # PROGRAMS_PER_SM_WIDE_RAGGED per SM
    assert td.num_splits(prob(8, 32, 32, 8192), cfg, sm_count=132) == 2
    assert td.num_splits(prob(8, 32, 32, 8192), cfg, sm_count=132, resident=5) == 2
    k = torch.empty(1, 1, 1, 1).expand(16, 32, 16384, 128)  # shapes only: no memory behind them
    ragged = make_problem(torch.empty(16, 32, 1, 128), k, k, kv_len=[16384 - 100 * b for b in range(16)])
    assert td.num_splits(ragged, cfg, sm_count=132) == 4
    assert td.workspace_bytes(prob(1, 2, 2, 64), 1) == 0


def test_deep_config_aims_at_one_program_per_sm():
    """The contiguous cache's bf16/fp16 D128 config keeps two 128-key K/V tiles in flight and one program per
    SM: one split per (batch, kv head) where those fill the SMs, no merge; the other cases (kv_len, paged,
    more rows, D64, too little shared memory) keep (64, 4, 2)."""
    def prob(B, Hq, Hkv, Nk, **kw):
        k = torch.empty(1, 1, 1, 1).expand(B, Hkv, Nk, 128)  # shapes only
        return make_problem(torch.empty(B, Hq, 1, 128), k, k, **kw)

    deep = td.default_config(BF16, 128)
    assert deep == td.DEEP_CONFIG == td.default_config(F16, 128) and deep.per_sm == 1
    for B, Hkv, Nk, want in [(16, 8, 4096, 1), (8, 8, 8192, 2), (1, 8, 32768, 16), (1, 32, 131072, 4),
                             (8, 32, 8192, 1)]:
        assert td.num_splits(prob(B, 32, Hkv, Nk), deep, 132) == want
        assert td.num_splits(prob(B, 32, Hkv, Nk), deep, 132, resident=3) == want  # per_sm caps what fits
    shallow = td.DecodeConfig(64, 4, 2)
    assert td.default_config(BF16, 128, paged=True) == td.DecodeConfig(64, 4, 2, maxnreg=128)
    assert td.default_config(BF16, 128, rows=32) == shallow
    assert td.default_config(BF16, 128, ragged=True) == shallow
    assert td.default_config(BF16, 128, deep_fits=False) == shallow
    assert td.default_config(BF16, 64) == shallow
    ragged = prob(16, 32, 32, 16384, kv_len=[16384 - 100 * b for b in range(16)])
    assert td.wide_ragged(ragged, 132) and not td.wide_ragged(prob(16, 32, 32, 16384), 132)


def test_plan_splits_by_the_compiled_kernels_occupancy(monkeypatch):
    """A GPU plan with no forced split count compiles its split kernel first (warmup, bound here to the
    kernel's own signature: an argument list out of step with it fails) and fills one wave of what fits."""
    import inspect
    from types import SimpleNamespace

    real = td.decode_split_kernel
    params = inspect.signature(real.fn).parameters
    constexprs = {p.name for p in real.params if p.is_constexpr}
    seen = {}

    class Compiled:
        n_regs, metadata = 153, SimpleNamespace(shared=38912)

        def _init_handles(self):
            pass

    class Stub:
        params = real.params

        def warmup(self, *args, grid, num_warps, num_stages, enable_fp_fusion, **constants):
            bound = inspect.signature(real.fn).bind(*args, **constants)  # a TypeError when out of step
            assert set(constants) == constexprs and len(args) == len(params) - len(constexprs)
            assert bound.arguments["Out"] is bound.arguments["Q"]  # as a launch without lse
            seen["warps"], seen["pdl"] = num_warps, constants["PDL"]
            return Compiled()

    merges = []

    def merge_ahead(kernel, grid, args, kw, device):  # bound to the merge kernel's signature, as its launch is
        constants = {k: v for k, v in kw.items()
                     if k not in ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion")}
        merges.append(inspect.signature(td.decode_merge_kernel.fn).bind(*args, **constants).arguments)

    monkeypatch.setattr(td, "decode_split_kernel", Stub())
    monkeypatch.setattr(td.background, "ahead", merge_ahead)
    monkeypatch.setattr(td, "_sm_count", lambda device: 132)
    monkeypatch.setattr(td, "_has_pdl", lambda device: True)
    monkeypatch.setattr(td.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
        regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048))
    q, k = torch.empty(1, 32, 1, 128), torch.empty(1, 8, 1, 1).expand(1, 8, 32768, 128)
    prob = make_problem(q, k, k)
    cfg = td.DecodeConfig(64)
    plan = td._Plan(prob, cfg, None, None, interpret=False)
    assert seen["warps"] == cfg.num_warps and seen["pdl"] is True  # the kernel that stores split states
    assert plan.n_split == td.num_splits(prob, cfg, 132, resident=3) < td.num_splits(prob, cfg, 132)
    assert prob.Hkv * plan.n_split <= 3 * 132  # one wave of 3 a SM (153 registers)
    # the merge of the first guess (before the occupancy is known) was compiled ahead, for a call without lse
    (merge,) = merges
    assert merge["S"] == td.num_splits(prob, cfg, 132) and merge["WRITE_LSE"] is False
    assert merge["BLOCK_S"] == min(64, td.pow2_bucket(merge["S"])) and merge["Lse"] is merge["Out"]
    seen.clear()  # one split whatever fits: nothing compiled, not even ahead
    merges.clear()
    short = make_problem(q, k[:, :, :128], k[:, :, :128])
    assert td._Plan(short, cfg, None, None, interpret=False).n_split == 1 and not seen and not merges


def test_programs_per_sm_counts_registers_shared_memory_and_threads():
    # registers by warp in units of 256: 96 regs -> 3072 a warp, 21 warps, 5 programs of 4 warps
    assert td.programs_per_sm(96, 0, 4) == 5
    assert td.programs_per_sm(153, 0, 4) == 3  # 160 * 32 = 5120 a warp: 12 warps
    assert td.programs_per_sm(128, 0, 4) == 4
    # shared memory: 38 KiB + 1 KiB reserved each, 228 KiB an SM
    assert td.programs_per_sm(32, 38912, 4) == 5
    assert td.programs_per_sm(32, 0, 4) == 16  # threads: 2048 an SM, 128 a program
    assert td.programs_per_sm(255, 200_000, 8) == 1  # never less than one


def test_paged_dense_view_gathers_the_table():
    k = torch.randn(2, 3, 32, 8)
    k_cache, v_cache, table = _paged_from_dense(k, -k, 16, [32, 16])
    paged = td.paged_kv(k_cache, v_cache, table, B=2, Hkv=3, D=8, Nk=32, dtype=k.dtype, device=k.device,
                         kv_len=torch.tensor([32, 16]))  # entries past sequence 1 hold out-of-range ids
    dk, dv = paged.dense()
    assert torch.equal(dk[0], k[0]) and torch.equal(dk[1, :, :16], k[1, :, :16]) and torch.equal(dv[0], -k[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_public_calls_reuse_one_decode_plan_gpu(dtype, monkeypatch):
    """Each attnlab.attention call makes a new Problem: the decode plan is found by the call's signature, and
    every call with fresh tensors writes what a JIT launch writes, bit for bit."""
    from attnlab.backends.triton import runtime as truntime

    case = Case("reuse", B=2, Hq=8, Hkv=2, Nq=3, Nk=700, D=64, causal=True, align="bottom_right", kv_len=(700, 90))
    td._PLANS.clear()
    for seed in range(3):
        q, k, v, kw = make_inputs(case, dtype=dtype, device="cuda", seed=seed)
        got = attnlab.attention(q, k, v, backend="triton-decode", **kw)
        monkeypatch.setattr(truntime, "FAST_LAUNCH", False)
        want = attnlab.attention(q, k, v, backend="triton-decode", **kw)
        monkeypatch.setattr(truntime, "FAST_LAUNCH", True)
        assert torch.equal(got, want)
    assert len(td._PLANS) == 1


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_half_bias_is_made_float32_before_log2e(dtype):
    """A large half-type bias: bias * log2(e) rounded in the bias's dtype would move a score by up to
    |bias| * 2^-8 (bf16), i.e. weights off by several percent; the fused forward's rule is float32 first."""
    B, Hq, Hkv, Nk, D = 1, 4, 2, 80, 16
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype) * 0.1
    k, v = (torch.randn(B, Hkv, Nk, D, generator=g).to(dtype) for _ in range(2))
    bias = (torch.rand(B, Hq, 1, Nk, generator=g) * 8 + 90).to(dtype)  # 90..98: coarse steps in bf16
    prob = make_problem(q, k, v, mask=bias)
    out = torch.empty(B, Hq, 1, D, dtype=dtype)
    td.decode_forward(prob, out, None, splits=2)
    ref = reference_forward(prob)[0]
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * torch.finfo(dtype).eps * ref.abs().max().item() + 1e-3, err


@pytest.mark.gpu
def test_merge_by_dependent_launch_matches_a_plain_launch_gpu(monkeypatch):
    """The merge launched by programmatic dependent launch (waiting on the GPU for the split kernel) writes
    what a plain second launch writes, bit for bit, on every one of many back-to-back public calls that
    alternate between two input sets (a merge that read the split states before the split kernel had stored
    them would read the other set's states, left in the stream's held buffer by the call before), and under
    CUDA-graph capture."""
    if not td._has_pdl(0):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    case = Case("pdl", B=3, Hq=16, Hkv=4, Nq=2, Nk=9000, D=128, causal=True, align="bottom_right",
                kv_len=(9000, 4100, 0))
    sets = []
    for seed in (7, 8):
        q, k, v, kw = make_inputs(case, dtype=BF16, device="cuda", seed=seed)
        kw["kv_len"] = torch.as_tensor(kw["kv_len"], dtype=torch.int32, device="cuda")
        sets.append((q, k, v, kw))
    runs = {}
    for pdl in (False, True):
        monkeypatch.setattr(td, "PDL", pdl)
        td._PLANS.clear()
        attnlab.fast_calls.clear()
        runs[pdl] = [attnlab.attention(q, k, v, backend="triton-decode", return_lse=True, **kw)
                     for i in range(20) for q, k, v, kw in [sets[i % 2]]]
        plan = next(iter(td._PLANS.values()))
        assert plan.n_split > 1 and plan.pdl is pdl
    for i, (q, k, v, kw) in enumerate(sets):
        want_out, want_lse = runs[False][i]
        _check(make_problem(q, k, v, **kw), want_out, want_lse)
        assert not torch.equal(want_out, runs[False][1 - i][0])  # the two sets' answers differ
        for out, lse in runs[False][i::2] + runs[True][i::2]:
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    q, k, v, kw = sets[0]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attnlab.attention(q, k, v, backend="triton-decode", **kw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        got = attnlab.attention(q, k, v, backend="triton-decode", **kw)
    for _ in range(3):
        got.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, runs[True][0][0])
