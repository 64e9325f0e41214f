"""The keywords of one attention call that shape its problem (the mask band, the scale, the layout), as one value.

:func:`attnlab.attention` makes one :class:`Options` on the way to its custom op; the op, its backward and
:func:`~attnlab.problem.make_problem` all take it. The op's flat argument list (a custom op takes only
tensors and scalars) is generated from :data:`Options.FLAT` at the op boundary, so a keyword added here reaches
the op, its fake implementation and its autograd formula without another list to edit.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnlab.masks import plain_int


@dataclass(frozen=True)
class Options:
    """The band (``causal``, ``window`` as (left, right), ``align``), ``scale``, ``layout`` and ``softcap`` of a
    call."""

    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    align: str | None = None
    scale: float | None = None
    layout: str = "bhnd"
    softcap: float | None = None

    #: The op's flat parameters for these options, with the types its schema takes (``window`` is split in
    #: three: a custom op has no optional pair).
    FLAT: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("causal", bool), ("has_window", bool), ("left", int | None), ("right", int | None),
        ("align", str | None), ("scale", float | None), ("layout", str), ("softcap", float | None),
    )

    @classmethod
    def of(cls, causal: bool = False, window: Any = None, align: str | None = None, scale: float | None = None,
           layout: str = "bhnd", softcap: float | None = None) -> Options:
        """The options of the public keywords; a window that is not a pair is a TypeError here (its values
        are validated with the rest of the problem)."""
        if window is not None:
            if not isinstance(window, (tuple, list)) or len(window) != 2:
                raise TypeError(f"window must be a pair (left, right) of ints or None; got {window!r}")
            window = (window[0], window[1])
        return cls(causal, window, align, scale, layout, softcap)

    def keywords(self) -> dict[str, Any]:
        """As :func:`~attnlab.problem.make_problem`'s keywords."""
        return {"causal": self.causal, "window": self.window, "align": self.align, "scale": self.scale,
                "layout": self.layout, "softcap": self.softcap}

    def flat(self) -> tuple:
        """The values of :data:`FLAT`, in order."""
        left, right = self.window if self.window is not None else (None, None)
        return (self.causal, self.window is not None, left, right, self.align, self.scale, self.layout, self.softcap)

    @classmethod
    def from_flat(cls, causal: bool, has_window: bool, left: int | None, right: int | None, align: str | None,
                  scale: float | None, layout: str, softcap: float | None) -> Options:
        """The inverse of :meth:`flat`."""
        return cls(causal, (left, right) if has_window else None, align, scale, layout, softcap)


def lengths_arg(value: Any) -> Any:
    """kv_len / q_len as the op takes them: None or a tensor (ints and sequences become a CPU tensor)."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        raise TypeError("lengths must be an int, a sequence of ints or an integer tensor of shape [B]; got a bool")
    value = plain_int(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, Sequence):
        value = [plain_int(x) for x in value]
    if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return torch.tensor(value, dtype=torch.int64)
    raise TypeError(
        f"lengths must be an int, a sequence of ints or an integer tensor of shape [B]; got {value!r}"
    )


def define_op(qualname: str, before: list[tuple[str, Any]], after: list[tuple[str, Any]], returns: Any, body, fake):
    """The custom op ``qualname`` whose parameters are ``before``, :data:`Options.FLAT` and ``after``, running
    ``body`` and, when traced, ``fake`` (both called as ``(*before values, Options, *after values)``): (the op,
    its implementation as a plain function)."""
    name = qualname.split("::")[-1]
    impl = _op_function(name, before, after, returns, body)
    op = torch.library.custom_op(qualname, mutates_args=())(impl)
    op.register_fake(_op_function(name + "_fake", before, after, returns, fake))
    return op, impl


def _op_function(name: str, before: list[tuple[str, Any]], after: list[tuple[str, Any]], returns: Any, body):
    """A function ``name(*before, *Options.FLAT, *after)`` whose signature (what ``torch.library.custom_op``
    reads the op's schema from) lists every parameter with its type, and whose body is
    ``body(*before values, Options, *after values)``."""
    n_before, n_flat = len(before), len(Options.FLAT)

    def fn(*args):
        opts = Options.from_flat(*args[n_before:n_before + n_flat])
        return body(*args[:n_before], opts, *args[n_before + n_flat:])

    params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=t)
              for p, t in (*before, *Options.FLAT, *after)]
    fn.__signature__ = inspect.Signature(params, return_annotation=returns)
    fn.__name__ = fn.__qualname__ = name
    return fn


def eager_function(name: str, impl, setup_context, backward, backward_impl) -> type:
    """A ``torch.autograd.Function`` running an op's implementation ``impl`` and autograd formula (``backward``
    called with ``backward_impl``) without the dispatcher: the same saved tensors and backward as the op, minus
    torch's first-use cost of a custom op's dispatch (it imports torch._dynamo: seconds in the first training
    step of a process). No double backward, as the op (its backward has no formula)."""

    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    @torch.autograd.function.once_differentiable
    def run_backward(ctx, *grads):
        return backward(ctx, *grads, backward_impl)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(run_backward)})


def plain_eager(*tensors: torch.Tensor) -> bool:
    """Whether a call that needs a gradient may skip the dispatcher (:func:`eager_function`): plain tensors with
    storage and no dispatch mode active. Fake and meta tensors, and tracers such as make_fx or FlopCounterMode,
    go through the op (its fake implementation)."""
    if any(type(t) is not torch.Tensor or t.is_meta for t in tensors):
        return False
    stack = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return stack is None or stack() == 0
