"""The benchmark cases and suites. A suite is data: one :class:`Suite` entry in :data:`SUITES` (its
name, the function that lists its cases, whether ``--suite all`` runs it and in which order, and its timing
overrides) adds a suite to the command line, to ``all`` and to the notebooks that iterate over suites."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.bench.schema import _DTYPES
from attnlab.cases import ShapeDefaults, mask_keywords
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

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def keywords(self, device: torch.device | str) -> dict[str, Any]:
        """Mask keywords for :func:`attnlab.attention` / :func:`attnlab.reference` (lengths on ``device``)."""
        return mask_keywords(self, device)

    def spec(self, device: torch.device | str = "cpu") -> MaskSpec:
        """The validated :class:`MaskSpec` of this case."""
        kw = self.keywords(device)
        return MaskSpec.build(self.B, self.Hq, self.Nq, self.nk, device=device, **kw)

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


def _seeded_lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """n lengths drawn uniformly from [lo, hi] with a fixed seed (the same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=g))


def dense_suite(device: str = "cuda") -> list[BenchCase]:
    """bf16 and fp16; D 64 and 128; (B, N) = (8, 1024), (4, 4096), (1, 16384), H 16; causal and not."""
    cases = []
    for dt in ("bfloat16", "float16"):
        for D in (64, 128):
            for B, N in ((8, 1024), (4, 4096), (1, 16384)):
                for causal in (False, True):
                    tag = "bf16" if dt == "bfloat16" else "fp16"
                    name = f"{tag}_b{B}_h16_n{N}_d{D}_{'causal' if causal else 'full'}"
                    cases.append(BenchCase("dense", name, B=B, Hq=16, Nq=N, D=D, dtype=dt, causal=causal))
    return cases


def padding_suite(device: str = "cuda") -> list[BenchCase]:
    """B8 H16 N4096 D128 bf16, kv_len seeded-uniform in [N/4, N]; with and without (top-left) causal."""
    N = 4096
    kv = _seeded_lengths(8, N // 4, N, seed=6)
    return [
        BenchCase("padding", f"bf16_b8_h16_n{N}_d128_kvlen{'_causal' if c else ''}", B=8, Hq=16, Nq=N, D=128,
                  kv_len=kv, causal=c)
        for c in (False, True)
    ]


def prefill_suite(device: str = "cuda") -> list[BenchCase]:
    """Chunked prefill: Nq 512 queries on Nk 8192 keys, bottom-right causal, B4 H16, D 64 and 128, bf16."""
    return [
        BenchCase("prefill", f"bf16_b4_h16_nq512_nk8192_d{D}_causal_br", B=4, Hq=16, Nq=512, Nk=8192, D=D,
                  causal=True, align="bottom_right")
        for D in (64, 128)
    ]


def decode_suite(device: str = "cuda") -> list[BenchCase]:
    """Decode: Nq 1, GQA Hq 32 / Hkv 8, D128 bf16, KV 8192 and 32768, B 1 and 8; one ragged-cache case."""
    cases = [
        BenchCase("decode", f"bf16_b{B}_hq32_hkv8_nk{Nk}_d128", B=B, Hq=32, Hkv=8, Nq=1, Nk=Nk, D=128)
        for B in (1, 8)
        for Nk in (8192, 32768)
    ]
    kv = _seeded_lengths(8, 32768 // 4, 32768, seed=7)
    cases.append(BenchCase("decode", "bf16_b8_hq32_hkv8_nk32768_d128_kvlen", B=8, Hq=32, Hkv=8, Nq=1, Nk=32768,
                           D=128, kv_len=kv))
    return cases


def fp32_suite(device: str = "cuda") -> list[BenchCase]:
    """IEEE float32 (TF32 off): the seed case B1 H8 N1024 D64 causal, and B8 H16 N2048 D64 causal."""
    return [
        BenchCase("fp32", "fp32_b1_h8_n1024_d64_causal", B=1, Hq=8, Nq=1024, D=64, dtype="float32", causal=True),
        BenchCase("fp32", "fp32_b8_h16_n2048_d64_causal", B=8, Hq=16, Nq=2048, D=64, dtype="float32", causal=True),
    ]


def memory_suite(device: str = "cuda") -> list[BenchCase]:
    """Peak extra memory against N (1024 .. 32768), B2 H16 D128 bf16, no mask; few timed calls.

    The textbook holds about three bf16 score copies at its peak: 3 x 16 GiB at N 16384 fits an H200,
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


@dataclass(frozen=True)
class Suite:
    """One benchmark suite, as data: one entry of :data:`SUITES` adds it to ``--suite``, to ``all`` (when
    ``all_rank`` is set: the order ``all`` runs it in) and to the notebooks that iterate over suites."""

    name: str
    cases: Callable[[str], list[BenchCase]]  #: device -> the suite's cases
    all_rank: int | None = None  #: position in ``--suite all`` (None: only when asked for by name)
    #: timing override: (most timed calls, timing budget per measurement in ms, fewest timed calls)
    timing: tuple[int, float, int] | None = None


#: Every suite, by name. The memory suite is about bytes: a few timed calls suffice.
SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("fp32", fp32_suite, all_rank=0),
    Suite("padding", padding_suite, all_rank=1),
    Suite("prefill", prefill_suite, all_rank=2),
    Suite("decode", decode_suite, all_rank=3),
    Suite("dense", dense_suite, all_rank=5),
    Suite("memory", memory_suite, all_rank=4, timing=(3, 50.0, 1)),
    Suite("quick", quick_suite),
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

