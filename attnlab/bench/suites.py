"""The benchmark cases and suites. A suite is data: one :class:`Suite` entry in :data:`SUITES` (its
name, the function that lists its cases, whether ``--suite all`` runs it and in which order, and its timing
overrides) adds a suite to the command line, to ``all`` and to the notebooks that iterate over suites."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.bench.schema import DTYPES
from attnlab.cases import ShapeDefaults, mask_keywords, score_mod_keywords
from attnlab.masks import MaskSpec

# ---------------------------------------------------------------------------------------------------------
# Cases and suites
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchCase(ShapeDefaults):
    """One benchmark configuration: shapes, dtype and mask keywords (layout bhnd, contiguous inputs)."""

    suite: str
    name: str
    B: int
    Hq: int
    Nq: int
    D: int
    dtype: str = "bfloat16"
    Hkv: int | None = None
    Nk: int | None = None
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    align: str | None = None
    kv_len: tuple[int, ...] | None = None
    q_len: tuple[int, ...] | None = None
    bias: str | None = None  #: an explicit bias: ``"alibi"`` (:func:`alibi_bias`, [1, Hq, Nq, Nk], the case dtype)
    backward: bool = False  #: timed as fwd, fwd+bwd and bwd (:mod:`attnlab.bench.grad`): three rows
    softcap: float | None = None  #: the ``softcap`` keyword
    alibi: str | None = None  #: ``"h"``: ``alibi_slopes`` [Hq] (seeded in [0.1, 1), float32)
    sinks: bool = False  #: ``sinks`` [Hq] (seeded N(0, 2^2), the case dtype)
    #: the last ``append`` keys of the cache are written by the call itself (``k_new``/``v_new``, ``kv_len`` =
    #: Nk - append), the values they already hold: the attention is the plain one over all Nk keys
    append: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def keywords(self, device: torch.device | str) -> dict[str, Any]:
        """Keywords for :func:`attnlab.attention` / :func:`attnlab.reference`: the mask's (lengths, bias on
        ``device``) and the score modifiers' (seeded: the same on every call)."""
        gen = torch.Generator().manual_seed(11)
        return {**self.mask_keywords(device), **score_mod_keywords(self, self.B, self.torch_dtype, device, gen)}

    def mask_keywords(self, device: torch.device | str) -> dict[str, Any]:
        """The mask's keywords alone (what :class:`MaskSpec` takes)."""
        kw = mask_keywords(self, device)
        if self.bias == "alibi":
            kw["mask"] = alibi_bias(self.Hq, self.Nq, self.nk, self.dtype, str(torch.device(device)))
        elif self.bias is not None:
            raise ValueError(f"unknown bias {self.bias!r}; the benchmark knows 'alibi'")
        return kw

    @property
    def has_mods(self) -> bool:
        return self.softcap is not None or self.alibi is not None or self.sinks

    def spec(self, device: torch.device | str = "cpu") -> MaskSpec:
        """The validated :class:`MaskSpec` of this case."""
        return MaskSpec.build(self.B, self.Hq, self.Nq, self.nk, device=device, **self.mask_keywords(device))

    def describe(self) -> dict[str, Any]:
        """The case's columns of a CSV row."""
        win = "" if self.window is None else ":".join("" if w is None else str(w) for w in self.window)
        lengths = []
        if self.kv_len is not None:
            lengths.append("kv_len=" + ";".join(map(str, self.kv_len)))
        if self.q_len is not None:
            lengths.append("q_len=" + ";".join(map(str, self.q_len)))
        spec = self.spec()
        return {
            "suite": self.suite, "case": self.name, "B": self.B, "Hq": self.Hq, "Hkv": self.hkv,
            "Nq": self.Nq, "Nk": self.nk, "D": self.D, "dtype": self.dtype, "causal": self.causal,
            "align": spec.align, "window": win, "mask": spec.kind, "lengths": " ".join(lengths),
        }


#: The rows of a backward case: (``mode`` column, case-name suffix, FLOPs as a multiple of the forward's).
BACKWARD_MODES = (("fwd", "fwd", 1.0), ("fwd+bwd", "fwdbwd", 3.5), ("bwd", "bwd", 2.5))


def row_keys(case: BenchCase) -> list[tuple[str, str]]:
    """(case column, mode column) of each row a case gives per competitor: one for a forward case, one per
    :data:`BACKWARD_MODES` entry for a backward case (``<name>_fwd``, ``<name>_fwdbwd``, ``<name>_bwd``), so
    that case names stay unique within a suite."""
    if not case.backward:
        return [(case.name, "fwd")]
    return [(f"{case.name}_{tag}", mode) for mode, tag, _ in BACKWARD_MODES]


@functools.lru_cache(maxsize=2)
def alibi_bias(H: int, Nq: int, Nk: int, dtype: str, device: str) -> torch.Tensor:
    """ALiBi's bias [1, H, Nq, Nk]: head h's slope 2^(-8(h+1)/H) times -(i - j) (top-left distance), in
    ``dtype``; cached (a case asks for it for every row it describes)."""
    slopes = torch.pow(2.0, -8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H).view(1, H, 1, 1)
    i = torch.arange(Nq, dtype=torch.float64).view(1, 1, Nq, 1)
    j = torch.arange(Nk, dtype=torch.float64).view(1, 1, 1, Nk)
    return (slopes * (j - i)).to(device=device, dtype=DTYPES[dtype])


def _seeded_lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """n lengths drawn uniformly from [lo, hi] with a fixed seed (the same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=g))


def dense_suite(device: str = "cuda") -> list[BenchCase]:
    """bf16 and fp16; D 64 and 128; (B, N) = (8, 1024), (4, 4096), (1, 16384), H 16; causal and not; and one
    sliding window of 1024 keys at N 16384."""
    cases = []
    for dt in ("bfloat16", "float16"):
        for D in (64, 128):
            for B, N in ((8, 1024), (4, 4096), (1, 16384)):
                for causal in (False, True):
                    tag = "bf16" if dt == "bfloat16" else "fp16"
                    name = f"{tag}_b{B}_h16_n{N}_d{D}_{'causal' if causal else 'full'}"
                    cases.append(BenchCase("dense", name, B=B, Hq=16, Nq=N, D=D, dtype=dt, causal=causal))
    # a sliding window (Mistral-like) on a long sequence: compiled Flex's block mask is the rival here
    cases.append(BenchCase("dense", "bf16_b1_h16_n16384_d128_window1024", B=1, Hq=16, Nq=16384, D=128,
                           dtype="bfloat16", window=(1024, 0)))
    return cases


def padding_suite(device: str = "cuda") -> list[BenchCase]:
    """B8 H16 N4096 D128 bf16, kv_len seeded-uniform in [N/4, N], with and without (top-left) causal; and
    ragged sequences, ``q_len = kv_len`` (other seeded lengths in [N/4, N]), causal and not."""
    N = 4096
    kv = _seeded_lengths(8, N // 4, N, seed=6)
    ragged = _seeded_lengths(8, N // 4, N, seed=8)
    return [
        *(BenchCase("padding", f"bf16_b8_h16_n{N}_d128_kvlen{'_causal' if c else ''}", B=8, Hq=16, Nq=N, D=128,
                    kv_len=kv, causal=c)
          for c in (False, True)),
        # a packed batch of ragged sequences: q_len = kv_len, causal (a decoder) and not (an encoder)
        *(BenchCase("padding", f"bf16_b8_h16_n{N}_d128_ragged{'_causal' if c else ''}", B=8, Hq=16, Nq=N, D=128,
                    kv_len=ragged, q_len=ragged, causal=c)
          for c in (True, False)),
    ]


def prefill_suite(device: str = "cuda") -> list[BenchCase]:
    """Chunked prefill: Nq 512 queries on Nk 8192 keys, bottom-right causal, B4 H16, D 64 and 128, bf16."""
    return [
        BenchCase("prefill", f"bf16_b4_h16_nq512_nk8192_d{D}_causal_br", B=4, Hq=16, Nq=512, Nk=8192, D=D,
                  causal=True, align="bottom_right")
        for D in (64, 128)
    ]


def decode_suite(device: str = "cuda") -> list[BenchCase]:
    """Decode, Nq 1, D128 bf16: B 1, 8 and 16; Hq/Hkv 32/8 (GQA) and 32/32; Nk 4k to 128k; with and without
    ragged kv_len (seeded in [Nk/4, Nk]). Cheapest first. Tiny on a CPU."""
    if str(device).startswith("cpu"):
        return [BenchCase("decode", "bf16_b2_hq4_hkv2_nk128_d32_kvlen", B=2, Hq=4, Hkv=2, Nq=1, Nk=128, D=32,
                          kv_len=_seeded_lengths(2, 32, 128, seed=7))]
    grid = [(16, 8, 4096, False), (8, 8, 8192, False), (8, 32, 8192, False), (1, 8, 32768, False),
            (8, 8, 32768, False), (8, 8, 32768, True), (16, 32, 16384, True), (1, 8, 131072, False),
            (1, 32, 131072, False)]
    cases = []
    for i, (B, Hkv, Nk, ragged) in enumerate(grid):
        kv = _seeded_lengths(B, Nk // 4, Nk, seed=7 + i) if ragged else None
        cases.append(BenchCase("decode", f"bf16_b{B}_hq32_hkv{Hkv}_nk{Nk}_d128" + ("_kvlen" if ragged else ""),
                               B=B, Hq=32, Hkv=Hkv, Nq=1, Nk=Nk, D=128, kv_len=kv))
    return cases


def fp32_suite(device: str = "cuda") -> list[BenchCase]:
    """IEEE float32 (TF32 off): the seed case B1 H8 N1024 D64 causal, and B8 H16 N2048 D64 causal."""
    return [
        BenchCase("fp32", "fp32_b1_h8_n1024_d64_causal", B=1, Hq=8, Nq=1024, D=64, dtype="float32", causal=True),
        BenchCase("fp32", "fp32_b8_h16_n2048_d64_causal", B=8, Hq=16, Nq=2048, D=64, dtype="float32", causal=True),
    ]


def memory_suite(device: str = "cuda") -> list[BenchCase]:
    """Peak extra memory against N (1024 .. 32768), B2 H16 D128 bf16, no mask; few timed calls.

    The textbook holds about three bf16 score copies at its peak: 3 x 16 GiB at N 16384 fits a 141 GB GPU,
    3 x 64 GiB at N 32768 does not, so it runs out within the range (B1 would not); once a backend has run
    out, the larger cases record it as skipped.
    """
    return [
        BenchCase("memory", f"bf16_b2_h16_n{N}_d128", B=2, Hq=16, Nq=N, D=128)
        for N in (1024, 2048, 4096, 8192, 16384, 32768)
    ]


def quick_suite(device: str = "cuda") -> list[BenchCase]:
    """A smoke run: a few small cases of every kind (smaller still on a CPU)."""
    if str(device).startswith("cpu"):
        n, d = 64, 32
        return [
            BenchCase("quick", "fp32_b1_h2_n64_d32_causal", B=1, Hq=2, Nq=n, D=d, dtype="float32", causal=True),
            BenchCase("quick", "bf16_b2_h2_n64_d32_kvlen", B=2, Hq=2, Nq=n, D=d, kv_len=(20, 64)),
            BenchCase("quick", "bf16_b1_hq4_hkv2_nq16_nk64_causal_br", B=1, Hq=4, Hkv=2, Nq=16, Nk=n, D=d,
                      causal=True, align="bottom_right"),
        ]
    return [
        BenchCase("quick", "bf16_b2_h4_n512_d64_full", B=2, Hq=4, Nq=512, D=64),
        BenchCase("quick", "fp16_b2_h4_n512_d128_causal", B=2, Hq=4, Nq=512, D=128, dtype="float16", causal=True),
        BenchCase("quick", "bf16_b2_h4_n512_d64_kvlen_causal", B=2, Hq=4, Nq=512, D=64, kv_len=(200, 512),
                  causal=True),
        BenchCase("quick", "bf16_b2_h4_nq64_nk1024_d64_causal_br", B=2, Hq=4, Nq=64, Nk=1024, D=64, causal=True,
                  align="bottom_right"),
        BenchCase("quick", "bf16_b2_hq8_hkv2_nq1_nk2048_d128", B=2, Hq=8, Hkv=2, Nq=1, Nk=2048, D=128),
        BenchCase("quick", "fp32_b1_h2_n256_d64_causal", B=1, Hq=2, Nq=256, D=64, dtype="float32", causal=True),
    ]


def latency_suite(device: str = "cuda") -> list[BenchCase]:
    """Small problems where host time matters: B 1-4, N 64-512, D 64/128, bf16; no mask, causal, kv_len
    (a GPU tensor, seeded in [N/4, N]) with and without causal. Tinier still on a CPU."""
    if str(device).startswith("cpu"):
        grid = [(1, 2, 32, 32, "causal"), (2, 2, 48, 32, "kvlen")]
    else:
        grid = [(1, 8, 128, 64, "causal"), (1, 16, 64, 64, "full"), (2, 16, 256, 128, "full"),
                (1, 16, 512, 128, "causal"), (4, 16, 512, 64, "causal"), (4, 16, 512, 128, "full"),
                (2, 16, 256, 64, "kvlen"), (4, 8, 512, 128, "kvlen_causal")]
    cases = []
    for i, (B, H, N, D, m) in enumerate(grid):
        kv = _seeded_lengths(B, N // 4, N, seed=20 + i) if "kvlen" in m else None
        cases.append(BenchCase("latency", f"bf16_b{B}_h{H}_n{N}_d{D}_{m}", B=B, Hq=H, Nq=N, D=D, kv_len=kv,
                               causal="causal" in m))
    return cases


def bias_suite(device: str = "cuda") -> list[BenchCase]:
    """An ALiBi-style bias [1, H, N, N] in bf16 with causal: B4 H16 N2048 D128 (B1 H2 N64 D32 on a CPU)."""
    B, H, N, D = (1, 2, 64, 32) if str(device).startswith("cpu") else (4, 16, 2048, 128)
    return [BenchCase("bias", f"bf16_b{B}_h{H}_n{N}_d{D}_causal_alibi", B=B, Hq=H, Nq=N, D=D, causal=True,
                      bias="alibi")]


def backward_suite(device: str = "cuda") -> list[BenchCase]:
    """Training: fwd, fwd+bwd and bwd through the public call, bf16 D128: B8 H16 N4096 with the padding
    suite's kv_len first (flex is its rival), then B4 H16 N4096 dense and causal, its GQA twin (B2 Hq32 Hkv8:
    the same query heads and work, a quarter of the K/V) causal, and B1 H16 N16384 dense and causal (cheapest
    first, so a deadline cuts the costliest). Tiny shapes on a CPU."""
    if str(device).startswith("cpu"):
        shapes, pad, gqa = [(1, 2, 32, 16)], (2, 1, 40, 16), (1, 4, 2, 32, 16)
    else:
        shapes, pad, gqa = [(4, 16, 4096, 128), (1, 16, 16384, 128)], (8, 16, 4096, 128), (2, 32, 8, 4096, 128)
    B, H, N, D = pad
    kv = _seeded_lengths(B, N // 4, N, seed=6)  # the padding suite's lengths at B8 N4096
    cases = [BenchCase("backward", f"bf16_b{B}_h{H}_n{N}_d{D}_kvlen", B=B, Hq=H, Nq=N, D=D, kv_len=kv,
                       backward=True)]
    mha = [BenchCase("backward", f"bf16_b{B}_h{H}_n{N}_d{D}_{'causal' if c else 'full'}", B=B, Hq=H, Nq=N, D=D,
                     causal=c, backward=True)
           for B, H, N, D in shapes for c in (False, True)]
    B, Hq, Hkv, N, D = gqa
    twin = BenchCase("backward", f"bf16_b{B}_hq{Hq}_hkv{Hkv}_n{N}_d{D}_causal", B=B, Hq=Hq, Hkv=Hkv, Nq=N, D=D,
                     causal=True, backward=True)
    return cases + mha[:2] + [twin] + mha[2:]


def tuning_suite(device: str = "cuda") -> list[BenchCase]:
    """The shipped table against ``attnlab.tune()``: the dense suite, shapes outside the table (N 777 and 3001,
    D 96) and the backward suite's cases (named ``<case>_train``: the dense suite has cases of the same shape)."""
    if str(device).startswith("cpu"):
        return [BenchCase("tuning", "bf16_b1_h2_n40_d16_causal", B=1, Hq=2, Nq=40, D=16, causal=True)]
    extra = [BenchCase("tuning", f"bf16_b4_h16_n{n}_d{d}_{'causal' if c else 'full'}", B=4, Hq=16, Nq=n, D=d,
                       causal=c) for n, d in ((777, 64), (3001, 128), (2048, 96), (3001, 96)) for c in (False, True)]
    moved = [dataclasses.replace(c, suite="tuning") for c in dense_suite(device)]
    moved += [dataclasses.replace(c, suite="tuning", name=c.name + "_train") for c in backward_suite(device)]
    return moved + extra


def scoremod_suite(device: str = "cuda") -> list[BenchCase]:
    """Score modifiers in training (fwd, fwd+bwd, bwd), bf16: softcap 50 and ALiBi on B4 H16 N4096 D128, causal
    and not (compiled flex with the same score_mod is the rival; sdpa-cudnn too for ALiBi, given the bias
    materialized); sinks on the same shapes and on a gpt-oss-like layer (GQA 64/8, D64, a 128-key window), each
    beside the same call without them. Tiny shapes on a CPU."""
    cpu = str(device).startswith("cpu")
    B, H, N, D = (1, 2, 32, 16) if cpu else (4, 16, 4096, 128)
    cases = []
    for c in (False, True):
        mask = "causal" if c else "full"
        for tag, mods in (("softcap50", {"softcap": 50.0}), ("alibi", {"alibi": "h"}), ("sinks", {"sinks": True}),
                          ("plain", {})):
            cases.append(BenchCase("scoremod", f"bf16_b{B}_h{H}_n{N}_d{D}_{mask}_{tag}", B=B, Hq=H, Nq=N, D=D,
                                   causal=c, backward=True, **mods))
    B, Hq, Hkv, N, D, W = (1, 4, 2, 40, 16, 8) if cpu else (2, 64, 8, 4096, 64, 128)
    for tag, sinks in (("sinks", True), ("plain", False)):
        cases.append(BenchCase("scoremod", f"bf16_b{B}_hq{Hq}_hkv{Hkv}_n{N}_d{D}_window{W}_{tag}", B=B, Hq=Hq,
                               Hkv=Hkv, Nq=N, D=D, window=(W - 1, 0), sinks=sinks, backward=True))
    return cases


def scoremod_decode_suite(device: str = "cuda") -> list[BenchCase]:
    """Decode with score modifiers and KV append, bf16 D128, B8 Hq32 Hkv8 over 32k keys (dense and paged
    caches): Nq 1 plain, with sinks and with softcap 50; and the call that first writes its Nnew = Nq new keys
    (1, and 4 with bottom-right causal) beside the plain call over the same keys, without and with lengths
    (kv_len = Nk on the GPU, as the append call passes them). Tiny shapes on a CPU."""
    B, Hq, Hkv, Nk, D = (2, 4, 2, 64, 16) if str(device).startswith("cpu") else (8, 32, 8, 32768, 128)
    base = f"bf16_b{B}_hq{Hq}_hkv{Hkv}_nk{Nk}_d{D}"
    one = dict(B=B, Hq=Hq, Hkv=Hkv, Nk=Nk, D=D)
    cases = [BenchCase("scoremod-decode", f"{base}_nq1_{tag}", Nq=1, **one, **mods)
             for tag, mods in (("plain", {}), ("sinks", {"sinks": True}), ("softcap50", {"softcap": 50.0}))]
    for n in (1, 4):
        mask = {"causal": True, "align": "bottom_right"} if n > 1 else {}
        name = f"{base}_nq{n}" + ("_causal_br" if n > 1 else "")
        cases.append(BenchCase("scoremod-decode", f"{name}_append{n}", Nq=n, append=n, **one, **mask))
        if n > 1:
            cases.append(BenchCase("scoremod-decode", f"{name}_plain", Nq=n, **one, **mask))
        # the plain call with GPU lengths, as the append call has them (the host cannot see that they are equal)
        cases.append(BenchCase("scoremod-decode", f"{name}_plain_kvlen", Nq=n, kv_len=(Nk,) * B, **one, **mask))
    return cases


@dataclass(frozen=True)
class Suite:
    """One benchmark suite, as data: one entry of :data:`SUITES` adds it to ``--suite``, to ``all`` (when
    ``all_rank`` is set: the order ``all`` runs it in) and to the notebooks that iterate over suites."""

    name: str
    cases: Callable[[str], list[BenchCase]]  #: device -> the suite's cases
    all_rank: int | None = None  #: position in ``--suite all`` (None: only when asked for by name)
    #: timing override: (most timed calls, timing budget per measurement in ms, fewest timed calls)
    timing: tuple[int, float, int] | None = None
    #: the competitors when ``--backends`` is not given (None: every one, :func:`competitors`)
    backends: tuple[str, ...] | None = None
    #: seconds after the suite's start when it starts no new measurement, unless ``--deadline-s`` is given
    deadline_s: float | None = None
    #: also time the calls in CUDA-graph replay (the ``graph_ms`` column): short calls, where the host's
    #: launches can hide the kernel's time
    graph: bool = False


#: The rivals of the latency suite: the public call (triton, auto), its kernel path, and SDPA's fused kernels.
LATENCY_BACKENDS = ("triton", "auto", "triton-kernel", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
#: The rivals of the backward suite: attnlab's Triton backward through the public call, SDPA's, compiled flex.
BACKWARD_BACKENDS = ("triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")

#: The rivals of the decode suite: the split-KV path (by name, and auto with paged caches of 16 and 64 keys
#: per block), the fused kernel it replaces for few rows, and SDPA's fused kernels.
DECODE_BACKENDS = ("triton-decode", "auto-paged16", "auto-paged64", "triton", "sdpa-flash", "sdpa-cudnn",
                   "sdpa-efficient")

#: Every suite, by name. The memory suite is about bytes: a few timed calls suffice; the latency suite's
#: calls are short, so it takes more of them.
SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("fp32", fp32_suite, all_rank=0),
    Suite("padding", padding_suite, all_rank=1),
    Suite("prefill", prefill_suite, all_rank=2),
    Suite("decode", decode_suite, all_rank=3, backends=DECODE_BACKENDS, graph=True),
    Suite("dense", dense_suite, all_rank=5),
    Suite("memory", memory_suite, all_rank=4, timing=(3, 50.0, 1)),
    Suite("latency", latency_suite, all_rank=6, timing=(100, 20.0, 10), backends=LATENCY_BACKENDS,
          deadline_s=60.0),
    Suite("bias", bias_suite, all_rank=7, backends=("triton", "auto", "sdpa-cudnn", "sdpa-efficient"),
          deadline_s=40.0),
    Suite("backward", backward_suite, all_rank=8, timing=(10, 50.0, 3), backends=BACKWARD_BACKENDS,
          deadline_s=300.0),
    Suite("quick", quick_suite),
    Suite("tuning", tuning_suite, timing=(10, 50.0, 3), backends=("triton-table", "triton-tuned", "sdpa-cudnn")),
    Suite("scoremod", scoremod_suite, timing=(10, 50.0, 3), backends=("auto", "flex", "sdpa-cudnn")),
    Suite("scoremod-decode", scoremod_decode_suite, backends=("auto", "auto-paged16"), graph=True),
)}


def recorded_suites() -> tuple[str, ...]:
    """What ``--suite all`` runs, in its order (every suite with an ``all_rank``): the suites a full recorded
    run holds, which notebooks iterate over."""
    ranked = sorted((s for s in SUITES.values() if s.all_rank is not None), key=lambda s: s.all_rank)
    return tuple(s.name for s in ranked)


#: ``recorded_suites()`` of the suites defined here.
ALL_ORDER = recorded_suites()


def suite_cases(name: str, device: str = "cuda") -> list[BenchCase]:
    """The cases of suite ``name`` on ``device``."""
    return SUITES[name].cases(device)

