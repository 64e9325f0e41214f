"""Test cases: the shapes and masks every backend is checked on, and seeded inputs for each.

A :class:`Case` is a description (shapes, layout, how the tensors are laid out in memory, mask keywords);
:func:`make_inputs` draws the tensors from a seed. :func:`default_cases` is the matrix that
``attnlab.check.verify`` sweeps: odd lengths, Nq != Nk with both alignments, every mask kind, GQA/MQA,
both layouts, transposed views and a non-unit stride on D. ``scale`` multiplies the default sizes for
GPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from attnlab.problem import FP8

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: How q, k, v are laid out in memory: "contiguous" in the layout; "transposed": made [B, N, H, D]
#: contiguous and passed as a bhnd view (or the reverse for bnhd); "strided_d": D is not the unit stride.
VIEWS = ("contiguous", "transposed", "strided_d")

#: Explicit masks make_inputs can draw. Each is (shape over [B, H, Nq, Nk] with 1 = broadcast, kind).
MASKS = {
    "bool_full": ("BHQK", "bool"),
    "bool_b1qk": ("B1QK", "bool"),
    "bool_qk": ("QK", "bool"),  # 2-D, broadcast over B and H
    "bool_1h1k": ("1H1K", "bool"),
    "bias_full": ("BHQK", "bias"),
    "bias_11qk": ("11QK", "bias"),
    "bias_b1qk": ("B1QK", "bias"),
}


class ShapeDefaults:
    """Shared by test and benchmark cases: Hkv and Nk default to Hq and Nq."""

    Hq: int
    Hkv: int | None
    Nq: int
    Nk: int | None

    @property
    def hkv(self) -> int:
        return self.Hq if self.Hkv is None else self.Hkv

    @property
    def nk(self) -> int:
        return self.Nq if self.Nk is None else self.Nk


@dataclass(frozen=True)
class Case(ShapeDefaults):
    """One attention problem to check: shapes, layout, memory view and mask keywords."""

    name: str
    B: int = 2
    Hq: int = 3
    Hkv: int | None = None
    Nq: int = 33
    Nk: int | None = None
    D: int = 16
    layout: str = "bhnd"
    view: str = "contiguous"
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    align: str | None = None
    kv_len: tuple[int, ...] | None = None
    q_len: tuple[int, ...] | None = None
    mask: str | None = None  #: a key of MASKS
    dtypes: tuple[torch.dtype, ...] = field(default=ALL_DTYPES)
    Dv: int | None = None  #: v's head dim (None: D)
    #: Packed sequences (attention_varlen): one (query length, key length) per sequence; B, Nq and Nk are then
    #: ignored (the sequences' count and longest lengths stand in for them), as are layout and view.
    seqs: tuple[tuple[int, int], ...] | None = None
    softcap: float | None = None  #: the soft cap c (attnlab.score_mods)
    alibi: str | None = None  #: ALiBi slopes drawn per head ("h": [Hq]) or per batch entry and head ("bh": [B, Hq])
    sinks: bool = False  #: a sink logit per head, drawn
    scale: float | None = None  #: the softmax scale (None: 1 / sqrt(D))

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    def describe(self) -> dict[str, Any]:
        B, Nq, Nk = self.B, self.Nq, self.nk
        if self.seqs is not None:
            B, Nq, Nk = len(self.seqs), max((a for a, _ in self.seqs), default=0), max((b for _, b in self.seqs),
                                                                                      default=0)
        return {
            "case": self.name, "B": B, "Hq": self.Hq, "Hkv": self.hkv, "Nq": Nq, "Nk": Nk,
            "D": self.D, "Dv": self.dv, "layout": "packed" if self.seqs is not None else self.layout,
            "view": self.view,
        }

    def scaled(self, factor: int) -> Case:
        """The same case with sequence lengths (and explicit lengths) multiplied by ``factor``."""
        f = lambda t: None if t is None else tuple(x * factor for x in t)
        win = None if self.window is None else tuple(None if w is None else w * factor for w in self.window)
        seqs = None if self.seqs is None else tuple((a * factor, b * factor) for a, b in self.seqs)
        return replace(
            self, Nq=self.Nq * factor, Nk=None if self.Nk is None else self.Nk * factor,
            kv_len=f(self.kv_len), q_len=f(self.q_len), window=win, seqs=seqs,
        )


def _tensor(shape_bhnd: tuple[int, int, int, int], layout: str, view: str, dtype, device, gen) -> torch.Tensor:
    """Draw N(0, 1) data in the requested layout and memory arrangement."""
    B, H, N, D = shape_bhnd
    if view == "contiguous":
        x = torch.randn(B, H, N, D, generator=gen)
        x = x if layout == "bhnd" else x.transpose(1, 2).contiguous()
    elif view == "transposed":
        # Stored the other way round, handed over as a (non-contiguous) view in the requested layout.
        stored = (B, N, H, D) if layout == "bhnd" else (B, H, N, D)
        x = torch.randn(stored, generator=gen).transpose(1, 2)
    elif view == "strided_d":
        # D is the slowest dimension: stride(-1) != 1.
        x = torch.randn(D, B, H, N, generator=gen).permute(1, 2, 3, 0)
        x = x if layout == "bhnd" else x.transpose(1, 2)
    else:
        raise ValueError(f"view must be one of {VIEWS}; got {view!r}")
    # Move without making the tensor contiguous: keep the strides the case asks for.
    out = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=device)
    out.copy_(x)
    return out


def make_mask(kind: str, B: int, H: int, Nq: int, Nk: int, device, gen: torch.Generator) -> torch.Tensor:
    """A seeded explicit mask of ``kind`` (a key of MASKS), with some rows entirely masked out."""
    dims, what = MASKS[kind]
    sizes = {"B": B, "H": H, "Q": Nq, "K": Nk, "1": 1}
    shape = tuple(sizes[c] for c in dims)
    if what == "bool":
        m = torch.rand(shape, generator=gen) < 0.7
        if "Q" in dims and Nq > 2:
            m[..., 1, :] = False  # a fully masked row
        return m.to(device)
    bias = torch.randn(shape, generator=gen)
    bias = bias.masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
    if "Q" in dims and Nq > 2:
        bias[..., 2, :] = float("-inf")  # a fully masked row
    return bias.to(device)


def mask_keywords(case: Any, device) -> dict[str, Any]:
    """The structural mask keywords of a case-like object (``causal``, ``window``, ``align``, ``kv_len``,
    ``q_len`` attributes) for attention()/reference(), lengths as int32 tensors on ``device``."""
    kw: dict[str, Any] = {}
    if case.causal:
        kw["causal"] = True
    if case.window is not None:
        kw["window"] = case.window
    if case.align is not None:
        kw["align"] = case.align
    if case.kv_len is not None:
        kw["kv_len"] = torch.tensor(case.kv_len, dtype=torch.int32, device=device)
    if case.q_len is not None:
        kw["q_len"] = torch.tensor(case.q_len, dtype=torch.int32, device=device)
    return kw


def make_inputs(case: Case, *, dtype: torch.dtype, device, seed: int):
    """(q, k, v, keywords) for ``case``, drawn from ``seed``; keywords go to attention() and reference(), or for
    a packed case (``seqs``) to attention_varlen() and reference_varlen() (:func:`attnlab.check.run`)."""
    gen = torch.Generator().manual_seed(seed)
    if case.seqs is not None:
        return _packed_inputs(case, dtype, device, gen)
    q = _tensor((case.B, case.Hq, case.Nq, case.D), case.layout, case.view, dtype, device, gen)
    k = _tensor((case.B, case.hkv, case.nk, case.D), case.layout, case.view, dtype, device, gen)
    v = _tensor((case.B, case.hkv, case.nk, case.dv), case.layout, case.view, dtype, device, gen)
    kw: dict[str, Any] = {"layout": case.layout, **mask_keywords(case, device)}
    if case.mask is not None:
        kw["mask"] = make_mask(case.mask, case.B, case.Hq, case.Nq, case.nk, device, gen)
    if dtype == FP8:
        kw.update(fp8_descales(case.B, case.Hq, case.hkv, device, gen))
    return q, k, v, {**kw, **_scale(case), **score_mod_keywords(case, case.B, dtype, device, gen)}


def _scale(case: Case) -> dict[str, Any]:
    """The case's softmax scale as a keyword, where it sets one."""
    return {} if case.scale is None else {"scale": case.scale}


def fp8_descales(B: int, Hq: int, Hkv: int, device, gen: torch.Generator) -> dict[str, Any]:
    """Descales for FP8 inputs drawn in [0.5, 1.5): q's and v's per head ([B, Hq], [B, Hkv]), k's per tensor."""
    draw = lambda *shape: (torch.rand(shape, generator=gen) + 0.5).to(device)
    return {"q_descale": draw(B, Hq), "k_descale": draw(1), "v_descale": draw(B, Hkv)}


def takes_dtype(case: Case, dtype: torch.dtype) -> bool:
    """Whether ``case`` is checked in ``dtype``: its own dtypes, and FP8 where it is not packed (asked for
    explicitly: FP8 is a forward of its own, :mod:`attnlab.fp8`)."""
    return dtype in case.dtypes or (dtype == FP8 and case.seqs is None)


def score_mod_keywords(case: Case, B: int, dtype: torch.dtype, device, gen: torch.Generator) -> dict[str, Any]:
    """A case's score modifiers as keywords: the soft cap, ALiBi slopes in (0, 1] (float32), sinks ~ N(0, 2^2)
    in the input dtype."""
    kw: dict[str, Any] = {}
    if case.softcap is not None:
        kw["softcap"] = case.softcap
    if case.alibi is not None:
        shape = (case.Hq,) if case.alibi == "h" else (B, case.Hq)
        kw["alibi_slopes"] = (torch.rand(shape, generator=gen) * 0.9 + 0.1).to(device)
    if case.sinks:  # (FP8 inputs: bfloat16 sinks, the output's dtype)
        kw["sinks"] = (2 * torch.randn(case.Hq, generator=gen)).to(device=device,
                                                                  dtype=torch.bfloat16 if dtype == FP8 else dtype)
    return kw


def _packed_inputs(case: Case, dtype: torch.dtype, device, gen: torch.Generator):
    """Packed q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] and attention_varlen's keywords
    (prefix sums int32 on ``device``, the longest lengths, the band)."""
    lq = [a for a, _ in case.seqs]
    lk = [b for _, b in case.seqs]

    def draw(n: int, h: int, d: int) -> torch.Tensor:
        return torch.randn(n, h, d, generator=gen).to(device=device, dtype=dtype)

    q, k, v = draw(sum(lq), case.Hq, case.D), draw(sum(lk), case.hkv, case.D), draw(sum(lk), case.hkv, case.dv)
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                                      dtype=torch.int32, device=device)
    kw = {"cu_seqlens_q": cu(lq), "cu_seqlens_k": cu(lk), "max_seqlen_q": max(lq, default=0),
          "max_seqlen_k": max(lk, default=0), **{k: v for k, v in mask_keywords(case, device).items()
                                                  if k in ("causal", "window", "align")}}
    return q, k, v, {**kw, **_scale(case), **score_mod_keywords(case, len(case.seqs), dtype, device, gen)}


def default_cases(scale: int = 1) -> list[Case]:
    """The verify matrix. Sizes are small and odd (CPU and Triton's interpreter); ``scale`` grows N."""
    halves = (torch.float16, torch.bfloat16)
    cases = [
        Case("dense", B=2, Hq=3, Nq=33, D=16),
        Case("dense_d1", B=1, Hq=2, Nq=17, D=1, dtypes=(torch.float32,)),
        Case("dense_d40_nq<nk", B=1, Hq=2, Nq=19, Nk=47, D=40),
        Case("dense_d100", B=1, Hq=2, Nq=21, Nk=29, D=100, dtypes=(torch.float32, torch.bfloat16)),
        Case("dense_d128", B=1, Hq=1, Nq=18, Nk=35, D=128, dtypes=(torch.float32, torch.float16)),
        Case("dense_d256", B=1, Hq=1, Nq=9, Nk=20, D=256, dtypes=(torch.float32,)),
        Case("causal", B=2, Hq=2, Nq=37, D=32, causal=True),
        Case("causal_tl_nq<nk", B=1, Hq=2, Nq=17, Nk=45, D=16, causal=True, align="top_left"),
        Case("causal_br_nq<nk", B=2, Hq=2, Nq=17, Nk=45, D=16, causal=True, align="bottom_right"),
        Case("causal_br_nq>nk", B=2, Hq=2, Nq=45, Nk=17, D=16, causal=True, align="bottom_right"),
        Case("causal_tl_nq>nk", B=1, Hq=2, Nq=40, Nk=23, D=16, causal=True, align="top_left", dtypes=halves),
        Case("kv_len", B=3, Hq=2, Nq=31, Nk=45, D=16, kv_len=(0, 23, 45)),
        Case("kv_len_causal_br", B=3, Hq=2, Nq=20, Nk=41, D=16, causal=True, align="bottom_right",
             kv_len=(41, 7, 30)),
        Case("q_len_kv_len", B=3, Hq=2, Nq=29, Nk=29, D=16, kv_len=(29, 13, 0), q_len=(29, 20, 5)),
        Case("q_len_causal_br", B=3, Hq=2, Nq=24, Nk=40, D=16, causal=True, align="bottom_right",
             kv_len=(40, 31, 10), q_len=(24, 9, 17)),
        Case("window", B=2, Hq=2, Nq=41, D=16, window=(8, 4)),
        Case("window_left_only", B=1, Hq=2, Nq=35, D=16, window=(6, None)),
        Case("window_causal_br", B=2, Hq=2, Nq=19, Nk=50, D=16, causal=True, window=(5, None),
             align="bottom_right"),
        Case("window_misses", B=1, Hq=2, Nq=30, Nk=12, D=16, window=(2, 1), align="top_left"),
        Case("bool_full", B=2, Hq=2, Nq=23, Nk=31, D=16, mask="bool_full"),
        Case("bool_qk_2d", B=2, Hq=3, Nq=25, Nk=25, D=16, mask="bool_qk"),
        Case("bool_1h1k_causal", B=2, Hq=3, Nq=27, D=16, mask="bool_1h1k", causal=True),
        Case("bias_full", B=2, Hq=2, Nq=21, Nk=26, D=16, mask="bias_full"),
        Case("bias_11qk_causal", B=2, Hq=2, Nq=28, D=16, mask="bias_11qk", causal=True),
        Case("bias_b1qk_kv_len", B=2, Hq=2, Nq=22, Nk=30, D=16, mask="bias_b1qk", kv_len=(30, 11)),
        Case("gqa", B=2, Hq=6, Hkv=2, Nq=26, Nk=33, D=16),
        Case("gqa_causal_br", B=1, Hq=6, Hkv=3, Nq=14, Nk=39, D=32, causal=True, align="bottom_right"),
        Case("mqa_bool", B=2, Hq=4, Hkv=1, Nq=19, D=16, mask="bool_b1qk"),
        Case("bnhd", B=2, Hq=3, Nq=29, Nk=35, D=16, layout="bnhd"),
        Case("bnhd_gqa_causal", B=1, Hq=4, Hkv=2, Nq=33, D=24, layout="bnhd", causal=True),
        Case("transposed_view", B=2, Hq=3, Nq=27, Nk=30, D=16, view="transposed"),
        Case("strided_d_causal", B=1, Hq=2, Nq=31, D=40, view="strided_d", causal=True),
        Case("bnhd_transposed_kv_len", B=2, Hq=2, Nq=26, Nk=34, D=16, layout="bnhd", view="transposed",
             kv_len=(34, 17)),
    ]
    return [c.scaled(scale) for c in cases] if scale != 1 else cases


# ---- the named case lists ------------------------------------------------------------------------------
# Every list a test sweeps lives here, so the next backend is tested on all of them by registering it
# (tests/test_contract.py). Sizes are odd on purpose; the CPU lists stay small for Triton's interpreter.


def extra_cases() -> list[Case]:
    """Cases beyond the default matrix, named after what they single out: D 40/64/100/128, both alignments with
    Nq < Nk and Nq > Nk, kv_len 0, q_len 0, one-sided and negative windows, broadcast masks with windows and
    lengths, MQA with a transposed bnhd view, a strided D, tile-aligned sizes, Nq = 1, Nk = 1."""
    return [
    Case("d64_causal", B=1, Hq=2, Nq=35, D=64, causal=True),
    Case("d40_window_br_nq>nk", B=2, Hq=2, Nq=37, Nk=21, D=40, window=(6, 3), align="bottom_right"),
    Case("d100_causal_tl_nq<nk", B=1, Hq=2, Nq=20, Nk=43, D=100, causal=True, align="top_left"),
    Case("d128_causal_br_nq>nk_kv_len", B=2, Hq=1, Nq=34, Nk=19, D=128, causal=True, align="bottom_right",
         kv_len=(19, 4)),
    Case("causal_tl_nq>nk_f32", B=1, Hq=2, Nq=40, Nk=23, D=16, causal=True, align="top_left", dtypes=(torch.float32,)),
    Case("kv_len_zero_causal_br", B=3, Hq=2, Nq=21, Nk=33, D=16, causal=True, align="bottom_right",
         kv_len=(0, 33, 5)),
    Case("q_len_zero_window", B=2, Hq=2, Nq=27, D=16, window=(4, 4), q_len=(0, 19)),
    Case("window_right_only_br", B=2, Hq=2, Nq=18, Nk=40, D=16, window=(None, 3), align="bottom_right"),
    Case("window_negative_right", B=1, Hq=2, Nq=33, D=16, window=(9, -2)),
    Case("bool_1h1k_window", B=2, Hq=3, Nq=26, Nk=34, D=16, mask="bool_1h1k", window=(7, 2), align="top_left"),
    Case("bias_11qk_kv_len_q_len", B=2, Hq=2, Nq=23, Nk=29, D=16, mask="bias_11qk", kv_len=(29, 9),
         q_len=(14, 23)),
    Case("bias_full_gqa_causal", B=1, Hq=4, Hkv=2, Nq=25, D=16, mask="bias_full", causal=True),
    Case("mqa_bnhd_transposed_window", B=2, Hq=4, Hkv=1, Nq=30, Nk=38, D=16, layout="bnhd", view="transposed",
         window=(5, 5), align="bottom_right"),
    Case("strided_d_bnhd_gqa", B=1, Hq=6, Hkv=2, Nq=22, D=40, layout="bnhd", view="strided_d", causal=True),
    Case("tile_aligned", B=1, Hq=2, Nq=32, Nk=48, D=64, causal=True, align="bottom_right"),
    Case("decode_nq1", B=3, Hq=4, Hkv=2, Nq=1, Nk=37, D=64, causal=True, align="bottom_right",
         kv_len=(37, 1, 20)),
    Case("nk1", B=2, Hq=2, Nq=17, Nk=1, D=16),
]


def chunk_cases() -> list[Case]:
    """D of at least 32 (so that a 16-wide chunk of D splits the padded head dim) with every mask kind: the
    Triton kernel's D-chunked Q K^T and its second orientation are checked on these."""
    return [
    Case("chunk_d64_causal", B=1, Hq=2, Nq=35, D=64, causal=True),
    Case("chunk_d40_window_br_kv_len", B=2, Hq=2, Nq=37, Nk=21, D=40, window=(6, 3), align="bottom_right",
         kv_len=(21, 9)),
    Case("chunk_d100_bias_gqa", B=1, Hq=4, Hkv=2, Nq=20, Nk=43, D=100, mask="bias_full"),
    Case("chunk_d128_bool_strided", B=1, Hq=2, Nq=18, Nk=30, D=128, layout="bnhd", view="strided_d",
         mask="bool_1h1k", q_len=(13,)),
]


def head_dim_cases() -> list[Case]:
    """A value head dim of its own (Dv != D): larger and smaller than D, odd, with GQA, masks and views."""
    return [
    Case("dv_d48_dv24_causal", B=2, Hq=2, Nq=29, D=48, Dv=24, causal=True),
    Case("dv_d24_dv40_gqa_window", B=1, Hq=4, Hkv=2, Nq=23, Nk=37, D=24, Dv=40, window=(5, 2),
         align="bottom_right"),
    Case("dv_d64_dv128_kv_len", B=2, Hq=2, Nq=19, Nk=33, D=64, Dv=128, kv_len=(33, 0), dtypes=(torch.bfloat16,)),
    Case("dv_d192_dv128_causal_br", B=1, Hq=2, Nq=17, Nk=26, D=192, Dv=128, causal=True, align="bottom_right",
         dtypes=(torch.bfloat16, torch.float32)),
    Case("dv_d128_dv64_bias_bnhd", B=1, Hq=2, Nq=21, Nk=30, D=128, Dv=64, mask="bias_b1qk", layout="bnhd",
         view="transposed", dtypes=(torch.float16,)),
    Case("dv_d16_dv7_bool", B=2, Hq=3, Hkv=1, Nq=25, D=16, Dv=7, mask="bool_b1qk", dtypes=(torch.float32,)),
]


def varlen_cases() -> list[Case]:
    """Packed sequences (attention_varlen): empty sequences and sequences of one row, one long sequence among
    short ones, Nq != Nk per sequence in both alignments, windows, GQA/MQA, Dv != D."""
    return [
    Case("varlen_dense", Hq=2, D=16, seqs=((5, 7), (0, 3), (17, 17), (1, 0), (33, 20))),
    Case("varlen_causal_br_gqa", Hq=4, Hkv=2, D=32, seqs=((9, 30), (40, 40), (1, 1), (0, 0), (21, 5)),
         causal=True, align="bottom_right"),
    Case("varlen_causal_tl_mqa", Hq=3, Hkv=1, D=24, seqs=((30, 12), (2, 2), (45, 45)), causal=True,
         align="top_left"),
    Case("varlen_window_br", Hq=2, D=16, seqs=((19, 19), (3, 40), (26, 26)), window=(4, 2), align="bottom_right"),
    Case("varlen_one_long_dv", Hq=2, D=64, Dv=40, seqs=((3, 3), (70, 70), (1, 1), (4, 4)), causal=True,
         align="bottom_right"),
]


def score_mod_cases() -> list[Case]:
    """Soft cap, ALiBi slopes and sinks, alone and together, with masks, lengths (empty rows: lse = the sink),
    GQA, both alignments, windows (gpt-oss alternates windowed layers) and packed sequences."""
    return [
    Case("softcap_causal", B=2, Hq=2, Nq=33, D=32, causal=True, softcap=2.5),
    Case("softcap_bias_nq<nk", B=1, Hq=2, Nq=19, Nk=41, D=16, mask="bias_b1qk", softcap=1.5),
    Case("alibi_h_gqa_causal_br_kv_len", B=2, Hq=4, Hkv=2, Nq=17, Nk=40, D=16, causal=True, align="bottom_right",
         kv_len=(40, 23), alibi="h"),
    Case("alibi_bh_tl_nq>nk_q_len", B=2, Hq=2, Nq=35, Nk=21, D=24, causal=True, align="top_left", q_len=(35, 12),
         alibi="bh"),
    Case("sinks_window_q_len_kv0", B=3, Hq=2, Nq=27, D=16, window=(5, 0), q_len=(27, 9, 20), kv_len=(27, 27, 0),
         sinks=True),
    Case("sinks_mqa_bool", B=2, Hq=3, Hkv=1, Nq=22, D=16, mask="bool_full", sinks=True),
    Case("all_mods_gqa_window_br", B=2, Hq=4, Hkv=2, Nq=25, Nk=31, D=32, window=(6, 0), align="bottom_right",
         softcap=3.0, alibi="h", sinks=True),
    Case("varlen_all_mods", Hq=4, Hkv=2, D=16, seqs=((9, 9), (0, 4), (20, 20), (5, 0)), causal=True,
         align="bottom_right", softcap=2.0, alibi="bh", sinks=True),
    Case("dec_nq4_all_mods_kv_len", B=3, Hq=8, Hkv=2, Nq=4, Nk=70, D=32, causal=True, align="bottom_right",
         kv_len=(70, 0, 33), softcap=4.0, alibi="bh", sinks=True),
    Case("dec_nq1_all_mods_window", B=2, Hq=4, Hkv=1, Nq=1, Nk=90, D=16, window=(25, 0), align="bottom_right",
         softcap=3.0, alibi="h", sinks=True),
]


def gpu_cases() -> list[Case]:
    """The default matrix at 4x the lengths, plus every D of the issue with both alignments and Nq <> Nk."""
    cases = default_cases(scale=4)
    for D in (16, 40, 64, 100, 128, 256):
        cases += [
            Case(f"d{D}_causal_br_nq<nk", B=2, Hq=4, Hkv=2, Nq=70, Nk=201, D=D, causal=True,
                 align="bottom_right", kv_len=(201, 90)),
            Case(f"d{D}_causal_tl_nq>nk", B=1, Hq=3, Hkv=1, Nq=150, Nk=67, D=D, causal=True, align="top_left",
                 layout="bnhd"),
            Case(f"d{D}_window_br_nq>nk_bias", B=2, Hq=2, Nq=131, Nk=77, D=D, window=(20, 5),
                 align="bottom_right", mask="bias_b1qk", view="transposed"),
            Case(f"d{D}_dense_bool_kv0", B=3, Hq=2, Nq=65, Nk=129, D=D, mask="bool_1h1k", kv_len=(0, 129, 64),
                 q_len=(65, 1, 30), view="strided_d"),
        ]
    return cases

def long_cases() -> list[Case]:
    """Long sequences (GPU): 16k causal, 16k keys with lengths, an 8k window in float32."""
    return [
    Case("long_causal_16k", B=1, Hq=2, Nq=16384, D=64, causal=True, dtypes=(torch.bfloat16,)),
    Case("long_kv_len_causal_br_16k", B=2, Hq=2, Hkv=1, Nq=1000, Nk=16384, D=128, causal=True,
         align="bottom_right", kv_len=(16384, 9001), dtypes=(torch.float16,)),
    Case("long_window_8k_f32", B=1, Hq=2, Nq=8192, D=64, window=(300, 40), dtypes=(torch.float32,)),
]


def n8192_cases() -> list[Case]:
    """N = 8192 (GPU): causal in the half types, GQA with kv_len in float32."""
    return [
    Case("n8192_causal", B=1, Hq=2, Nq=8192, D=64, causal=True, dtypes=(torch.float16, torch.bfloat16)),
    Case("n8192_gqa_kvlen", B=2, Hq=2, Hkv=1, Nq=64, Nk=8192, D=128, kv_len=(8192, 5000),
         dtypes=(torch.float32,)),
]


def decode_cases() -> list[Case]:
    """A few query rows against a longer cache (what the split-KV decode path takes): GQA packing, ragged
    kv_len including 0, speculative rows (causal bottom-right, Nq > 1), windows, masks, views, odd D."""
    return [
    Case("dec_nq1_gqa4", B=2, Hq=8, Hkv=2, Nq=1, Nk=77, D=32, kv_len=(77, 0)),
    Case("dec_nq5_causal_br", B=2, Hq=4, Hkv=1, Nq=5, Nk=90, D=24, causal=True, align="bottom_right",
         kv_len=(90, 3)),
    Case("dec_nq16_window_br_bias", B=1, Hq=4, Hkv=2, Nq=16, Nk=70, D=64, window=(20, 0), align="bottom_right",
         mask="bias_b1qk"),
    Case("dec_nq2_bool_bnhd", B=2, Hq=3, Hkv=3, Nq=2, Nk=41, D=16, mask="bool_full", layout="bnhd",
         view="transposed", q_len=(2, 1)),
]


@dataclass(frozen=True)
class CaseList:
    """A named case list; ``cpu``: small enough for every backend on a CPU (Triton's interpreter too)."""

    name: str
    cases: Callable[[], list[Case]]
    cpu: bool


#: Every case list, by name: what tests/test_contract.py runs every registered backend over (the lists with
#: cpu=False only under ``-m gpu``, on CUDA tensors).
CASE_LISTS: dict[str, CaseList] = {c.name: c for c in (
    CaseList("default", default_cases, cpu=True),
    CaseList("extra", extra_cases, cpu=True),
    CaseList("chunk", chunk_cases, cpu=True),
    CaseList("decode", decode_cases, cpu=True),
    CaseList("head_dim", head_dim_cases, cpu=True),
    CaseList("varlen", varlen_cases, cpu=True),
    CaseList("score_mods", score_mod_cases, cpu=True),
    CaseList("score_mods_gpu", lambda: [c.scaled(10) for c in score_mod_cases()], cpu=False),
    CaseList("varlen_gpu", lambda: [c.scaled(12) for c in varlen_cases()], cpu=False),
    CaseList("gpu", gpu_cases, cpu=False),
    CaseList("long", long_cases, cpu=False),
    CaseList("n8192", n8192_cases, cpu=False),
)}
