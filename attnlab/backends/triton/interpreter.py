"""Running the kernel on CPU tensors through Triton's interpreter, without ``TRITON_INTERPRET``.

The interpreter swaps ``triton.language``'s functions for its own while it runs; :func:`interpreter` routes
the library's @triton.jit helpers (``tl.max``, ``tl.sum``) to interpreted twins and restores
``triton.language`` afterwards, so interpreted and compiled launches mix in one process. Any @triton.jit
kernel can be run this way (``with interpreter(kernel) as run: run[grid](...)``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from attnlab.backends.triton.forward_kernel import tl

_interpreted: dict = {}
_interpreter_lock = threading.Lock()
_MISSING = object()


def interpreted_fn(fn):
    """``fn`` (a @triton.jit function) wrapped in Triton's interpreter, built once per function."""
    from triton.runtime.interpreter import InterpretedFunction

    raw = fn.fn  # keyed by the Python function: hashing a JITFunction would compute its cache key
    wrapped = _interpreted.get(raw)
    if wrapped is None:
        wrapped = _interpreted[raw] = InterpretedFunction(raw)
    return wrapped


@contextlib.contextmanager
def interpreter(kernel) -> Iterator:
    """Yield ``kernel`` (a @triton.jit function) wrapped in Triton's interpreter, for CPU tensors, without
    TRITON_INTERPRET.

    ``TRITON_INTERPRET=1`` makes ``triton.jit`` build interpreted functions at import, for the whole
    process. Instead, the kernel's own Python function is wrapped here. The library functions it calls
    (``tl.max``, ``tl.sum``...) are themselves ``@triton.jit`` functions, which refuse to be called
    outside a compiled kernel; while the interpreter runs, such calls are routed to interpreted
    wrappers of the same functions (what TRITON_INTERPRET=1 would have built), and restored after.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    def call_interpreted(self, *args, **kwargs):
        return interpreted_fn(self)(*args, **kwargs)

    # The kernel's loop bounds are scalar tensors, which the interpreter turns into Python ints through
    # ``tensor.__index__``. Before triton 3.7 that is ``int(data)`` on a one-element 1-D array, which
    # NumPy >= 2.5 refuses (seen with triton 3.6 + NumPy 2.5.2); ``.item()`` works with every version.
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_scalar_index(tensor, *rest, **kwargs):
        patch_tensor(tensor, *rest, **kwargs)
        scope = rest[0] if rest else kwargs.get("scope")
        index = lambda self: int(self.handle.data.item())
        if scope is not None:
            scope.set_attr(tensor, "__index__", index)  # restored with the interpreter's own patches
        else:
            tensor.__index__ = index

    with _interpreter_lock:
        _import_gluon_language()
        # The interpreter swaps triton.language's functions for its own while it runs. Not all of that is
        # undone afterwards (patches made by nested library calls, and, before triton 3.7, none at all),
        # which breaks the next *compiled* launch in this process. Snapshot and restore it all here.
        snapshot = _language_snapshot()
        saved = JITFunction.__call__
        JITFunction.__call__ = call_interpreted
        interpreter._patch_lang_tensor = patch_tensor_scalar_index
        try:
            yield interpreted_fn(kernel)
        finally:
            interpreter._patch_lang_tensor = patch_tensor
            JITFunction.__call__ = saved
            _language_restore(snapshot)


def _import_gluon_language() -> None:
    """Import Gluon's language (where triton has it) before an interpreted run. It wraps triton.language's
    functions once, when first imported; the JIT imports it during a launch, and imported while the interpreter
    has those functions swapped, it would keep the interpreter's stand-ins, and every later Gluon compile in the
    process (the Hopper forward's) would fail."""
    try:
        import triton.experimental.gluon.language  # noqa: F401
    except Exception:  # a triton without Gluon: nothing to protect
        pass


def _language_snapshot() -> list[tuple[object, dict]]:
    """The attribute dicts of every triton.language module and of the classes triton.language.core defines."""
    import sys

    mods = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None]
    classes = [c for c in vars(tl.core).values() if isinstance(c, type) and c.__module__.startswith("triton.language")]
    return [(obj, dict(vars(obj))) for obj in mods + classes]


def _language_restore(snapshot: list[tuple[object, dict]]) -> None:
    """Put back every attribute changed since :func:`_language_snapshot`, and remove those added to classes.

    Names added to a module stay: they are the interpreter's helpers, which it injects into the globals of
    the library functions it rewrites (and caches), and compiled code never looks them up.
    """
    for obj, saved in snapshot:
        current = vars(obj)
        if isinstance(obj, type):
            for key in [k for k in current if k not in saved]:
                delattr(obj, key)
        for key, value in saved.items():
            if current.get(key, _MISSING) is not value:
                setattr(obj, key, value)
