"""Backends: what one is (a name, where it can run, a forward that fills a preallocated output), and the
registry of every way attnlab can compute attention, by name.

Each backend implements the same contract (docs/contract.md) and lives in this package: ``reference``,
``textbook`` (``torch``), ``sdpa``, ``triton/`` and ``cuda/``. Modules that need optional packages (triton,
cupy) import them lazily, so ``import attnlab`` stays cheap and works without them; the registry imports
each backend's module on first use and lists the ones that are present.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import NamedTuple

import torch

from attnlab.problem import Problem


class Availability(NamedTuple):
    """Whether a backend can run on this machine, and why not when it cannot."""

    available: bool
    reason: str = ""

    def __repr__(self) -> str:
        return "available" if self.available else f"unavailable: {self.reason}"


class Backend:
    """Base class. Subclasses set ``name`` and ``description`` and implement :meth:`forward`."""

    name: str = ""
    description: str = ""
    #: What the backend takes, in a few words (shown by ``attnlab.backends()``); ``unsupported`` says why not.
    takes: str = "every problem of the contract"
    #: Whether outputs carry autograd history back to q, k and v. Backends built from PyTorch ops do; a
    #: kernel without a backward does not, and is then refused for inputs that require grad (never a
    #: silently detached output).
    differentiable: bool = True
    #: Whether the backward runs attnlab's Triton backward kernels from the saved out and lse (the kernel
    #: backends) rather than the chunked PyTorch backward (the backends built from PyTorch ops).
    kernel_backward: bool = False
    #: Whether :meth:`forward_paged` reads a paged KV cache in place; other backends get dense k and v gathered.
    reads_paged: bool = False
    #: Whether :meth:`forward_append` writes a KV append's new keys into the caches inside its own launch;
    #: other backends get the append written by its own kernel first (:mod:`attnlab.kv_append`).
    fuses_append: bool = False
    #: Whether the backend takes FP8 (float8_e4m3fn) inputs with their descales (``Problem.descale``); the others
    #: are refused them by :func:`resolve`, whatever their ``unsupported`` says.
    takes_fp8: bool = False

    def availability(self) -> Availability:
        """Can this backend run on this machine at all (packages, GPU)?"""
        return Availability(True)

    def unsupported(self, prob: Problem) -> str | None:
        """Why this backend cannot run ``prob`` (device, dtype...), or None when it can."""
        return None

    def forward(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Compute attention into ``out`` ([B, Hq, Nq, D] view, ``prob.out_dtype``) and ``lse`` ([B, Hq, Nq] float32).

        ``lse`` is None when the caller did not ask for it. Every element must be written.
        """
        raise NotImplementedError

    def fast_call(self, prob: Problem, out: torch.Tensor, lse: torch.Tensor | None, paged=None, append=None):
        """After :meth:`forward` (or :meth:`forward_paged`, with ``paged``; :meth:`forward_append`, with
        ``append``) ran ``prob`` into ``out`` and ``lse``: a function that runs another call of ``prob``'s
        signature without validating or planning again (:data:`attnlab.fast_calls.FastCall`), or None (the
        default: every call takes the whole way)."""
        return None

    def forward_paged(self, prob: Problem, paged, out: torch.Tensor, lse: torch.Tensor | None) -> None:
        """:meth:`forward` with k and v read from a paged cache (:class:`attnlab.paged.PagedKV`); ``prob``'s
        own k and v are stand-ins then. Only for backends with ``reads_paged``."""
        raise NotImplementedError

    def forward_append(self, prob: Problem, paged, out: torch.Tensor, lse: torch.Tensor | None, append) -> None:
        """:meth:`forward` (``paged`` None) or :meth:`forward_paged` of a call with a KV append
        (:class:`attnlab.kv_append.Append`, not yet written; ``prob``'s kv_len holds the lengths after it), writing
        the new keys into the caches in the same launch. Only for backends with ``fuses_append``."""
        raise NotImplementedError


def cuda_device_reason(prob: Problem) -> str | None:
    """The reason a CUDA-only backend cannot run ``prob``, or None."""
    if prob.device.type != "cuda":
        return f"needs CUDA tensors; got tensors on {prob.device}"
    return None


def no_cuda_reason() -> str | None:
    """Why CUDA kernels cannot run here (a CPU-only torch, or no visible GPU), or None."""
    if torch.version.cuda is None:
        return f"needs a CUDA GPU and a CUDA build of torch; this torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)"
    return None


# (module, class) of every backend, in the order tables list them. A new backend: its module under
# attnlab/backends/ and one line here; tests/test_contract.py then runs it over every case list.
_BACKENDS = [
    ("attnlab.backends.float64", "ReferenceBackend"),
    ("attnlab.backends.textbook", "TextbookBackend"),
    ("attnlab.backends.sdpa", "SdpaBackend"),
    ("attnlab.backends.triton.backend", "TritonBackend"),
    ("attnlab.backends.triton.backend", "TritonDecodeBackend"),
    ("attnlab.backends.cuda.backend", "CudaNaiveBackend"),
    ("attnlab.backends.cuda.backend", "CudaTiledBackend"),
    ("attnlab.backends.cuda.backend", "CudaRowmaxBackend"),
    ("attnlab.backends.cuda.backend", "CudaMmaBackend"),
]

#: What ``backend="auto"`` tries, by (device type, dtype class); the first that is available and supports
#: the problem wins (the measurements behind the GPU order: docs/decisions.md). On CPU, SDPA, except for inputs
#: that hold a NaN or an infinity (:func:`_hides_nonfinite`), which go to the float64 reference: SDPA's CPU kernel
#: can turn a NaN row into 0, and the contract says a NaN propagates.
AUTO_ORDER = {
    ("cuda", "half"): ("triton-decode", "triton", "cuda-mma", "cuda-rowmax", "sdpa"),
    ("cuda", "float32"): ("cuda-rowmax", "triton", "sdpa"),
    ("cpu", "half"): ("sdpa", "reference"),
    ("cpu", "float32"): ("sdpa", "reference"),
    ("cuda", "fp8"): ("triton",),
    ("cpu", "fp8"): ("torch",),
}


def _hides_nonfinite(name: str, prob: Problem) -> bool:
    """Whether ``auto`` must pass over backend ``name`` for ``prob``: SDPA on CPU tensors when q, k or v holds a
    NaN or an infinity, or the bias a NaN or +inf (checked on the host, where it costs one pass over the stored
    elements and no sync; GPU inputs are never read back)."""
    if name != "sdpa" or prob.device.type != "cpu":
        return False
    if not all(bool(torch.isfinite(_compact(t)).all()) for t in (prob.q, prob.k, prob.v)):
        return True
    bias = prob.spec.bias
    if bias is None:
        return False
    bias = _compact(bias)  # -inf masks a key (the contract's rule); NaN and +inf are the caller's
    return bool(torch.isnan(bias).any() or torch.isposinf(bias).any())


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast dimensions (stride 0, length > 1): each stored element once."""
    return t[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(t.stride(), t.shape))]


_registry: dict[str, Backend] | None = None


def registry() -> dict[str, Backend]:
    """name -> Backend instance, for every backend whose module is present."""
    global _registry
    if _registry is None:
        reg = {}
        for mod, cls in _BACKENDS:
            try:
                backend = getattr(importlib.import_module(mod), cls)()
            except (ImportError, AttributeError):
                continue  # a backend family not in this build
            reg[backend.name] = backend
        _registry = reg
    return _registry


def names() -> list[str]:
    return [*registry(), "auto"]


class BackendTable(dict):
    """``attnlab.backends()``: name -> Availability, printed as a table."""

    def __repr__(self) -> str:
        width = max(len(n) for n in self) if self else 0
        reg = registry()
        return "\n".join(f"{n:<{width}}  {a!r}" + (f"; takes {reg[n].takes}" if a.available and n in reg else "")
                         for n, a in self.items())

    def takes(self) -> dict[str, str]:
        """name -> what that backend takes (dtypes, head dims, query rows, devices)."""
        reg = registry()
        return {n: reg[n].takes for n in self if n in reg}


def status() -> BackendTable:
    """name -> Availability (with the reason when a backend cannot run here)."""
    return BackendTable((name, b.availability()) for name, b in registry().items())


def resolve(name: str, prob: Problem, needs_grad: bool = False) -> Backend:
    """The backend that will run ``prob``; raises ValueError naming the choices or the reason.

    ``needs_grad``: an input requires grad, so only a differentiable backend will do (``auto`` skips the
    others; naming one is an error).
    """
    reg = registry()
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, one of {names()}; got {name!r}")
    if name == "auto":
        kind = "fp8" if prob.descale is not None else "float32" if prob.dtype == torch.float32 else "half"
        for cand in AUTO_ORDER.get((prob.device.type, kind), ("sdpa",)):
            b = reg.get(cand)
            if b is None or (needs_grad and not b.differentiable) or _hides_nonfinite(cand, prob):
                continue
            if b.availability().available and why_not(b, prob) is None:
                return b
        if kind == "fp8" and prob.device.type == "cuda":  # not the emulation, silently: its scores fill memory
            tri = reg.get("triton")
            why = "triton is not in this build" if tri is None else (tri.availability().reason or tri.unsupported(prob))
            raise ValueError(f"no FP8 kernel runs this call on this GPU: {why}. backend='torch' emulates it in float32 "
                             "(materializing the scores)")
        return reg["torch"]
    if name not in reg:
        raise ValueError(f"unknown backend {name!r}; choose one of {names()}")
    b = reg[name]
    avail = b.availability()
    if not avail.available:
        raise ValueError(f"backend {name!r} is unavailable here: {avail.reason}")
    why = why_not(b, prob)
    if why is not None:
        raise ValueError(f"backend {name!r} cannot run this problem: {why}")
    if needs_grad and not b.differentiable:
        grad_ok = [n for n, x in reg.items() if x.differentiable]
        raise ValueError(
            f"backend {name!r} has no backward, and q, k or v requires grad: its output would silently carry "
            f"no gradient. Use a differentiable backend ({', '.join(grad_ok)}, or 'auto', which picks one), "
            "or call it under torch.no_grad() / on detached inputs"
        )
    return b


def why_not(b: Backend, prob: Problem) -> str | None:
    """Why backend ``b`` cannot run ``prob``: an FP8 problem on a backend without ``takes_fp8``, or its own reason."""
    if prob.descale is not None and not b.takes_fp8:
        fp8 = [n for n, x in registry().items() if x.takes_fp8]
        return f"it takes no float8_e4m3fn inputs (the FP8 forward runs on {', '.join(fp8)})"
    return b.unsupported(prob)


class _CallableModule(types.ModuleType):
    """This package is also the public function ``attnlab.backends()`` (docs/contract.md): calling the module
    returns :func:`status`, and ``attnlab.backends.registry()``, ``.resolve`` etc. stay plain attributes."""

    def __call__(self) -> BackendTable:
        return status()


sys.modules[__name__].__class__ = _CallableModule
