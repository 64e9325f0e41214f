"""Tuned configs on disk, so that a new process uses what this machine tuned before.

When asked (:func:`attnlab.tune`, or ``ATTNLAB_AUTOTUNE=1``), the Triton forward and backward time their
candidates for a tune key, seconds per key; this module keeps the winners across processes, and
:func:`attnlab.backends.triton.configs.config_for` / :func:`attnlab.backends.triton.backward.configs_for` read
them before the shipped table.

Where: one JSON file per GPU model and Triton version, ``autotune-<gpu>-triton<version>.json`` in
``$ATTNLAB_CACHE_DIR``, or ``~/.cache/attnlab`` when that is not set (``ATTNLAB_AUTOTUNE_CACHE=0``: no file
is read or written). What: entries keyed by the kernel (``"fwd"``, ``"bwd"``), a hash of its source (the
text of every ``@triton.jit`` function of the modules it is built from: an edited kernel is tuned anew) and
the tune key without the device index (the GPU is in the file name). A value is a config's fields; the
caller accepts it only if it is still among its candidates.

Safe when processes write at once: a writer takes an advisory lock (``fcntl.flock`` on ``<file>.lock``,
where the platform has it), reads what is on disk, adds its entries, writes a temporary file in the same
directory and ``os.replace``-s it over the file, so a reader sees the old file or the new one, never half
of one, and no writer's entries are lost. A file that cannot be read or parsed counts as empty (and is
rewritten by the next store); a directory that cannot be written only loses the tuned configs for later
processes (they fall back to the shipped table).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: The file's layout version: a file of another version counts as empty.
FORMAT = 1

#: The modules whose @triton.jit functions make up each kernel (their source text is hashed).
KERNEL_MODULES = {
    "fwd": ("attnlab.backends.triton.forward_kernel", "attnlab.backends.triton.tiles"),
    "bwd": ("attnlab.backends.triton.backward_kernels", "attnlab.backends.triton.forward_kernel",
            "attnlab.backends.triton.tiles"),
    # the backward in its one-pass mode (dQ added up inside the dK/dV pass): configs of its own
    "bwd1": ("attnlab.backends.triton.backward_kernels", "attnlab.backends.triton.forward_kernel",
             "attnlab.backends.triton.tiles"),
}


def enabled() -> bool:
    """Whether tuned configs are read from and written to disk (``ATTNLAB_AUTOTUNE_CACHE=0``: not)."""
    return os.environ.get("ATTNLAB_AUTOTUNE_CACHE", "1") != "0"


def cache_dir() -> Path:
    """``$ATTNLAB_CACHE_DIR``, else ``~/.cache/attnlab``."""
    given = os.environ.get("ATTNLAB_CACHE_DIR")
    return Path(given).expanduser() if given else Path.home() / ".cache" / "attnlab"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "unknown"


def cache_file(gpu: str, triton_version: str) -> Path:
    """The file of one GPU model and Triton version."""
    return cache_dir() / f"autotune-{_slug(gpu)}-triton{_slug(triton_version)}.json"


def source_hash(sources: Iterable[str]) -> str:
    """A short hash of source texts (in the order given)."""
    h = hashlib.sha256()
    for text in sources:
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:20]


def _jit_sources(module_name: str) -> list[str]:
    """The source text of every @triton.jit function defined in ``module_name``, by name."""
    from triton.runtime.jit import JITFunction

    fns = {name: f for name, f in vars(importlib.import_module(module_name)).items()
           if isinstance(f, JITFunction) and f.fn.__module__ == module_name}
    return [f"{module_name}.{name}\n{fns[name].src}" for name in sorted(fns)]


def kernel_source_hash(kernel: str) -> str:
    """The hash of the @triton.jit source of ``kernel`` (a key of :data:`KERNEL_MODULES`)."""
    return source_hash(text for module in KERNEL_MODULES[kernel] for text in _jit_sources(module))


def _environment(device_index: int | None) -> tuple[str, str]:
    """(GPU name, Triton version) of the device a tuned config was measured on."""
    import torch
    import triton

    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_name(index), triton.__version__


def _plain(x: Any) -> Any:
    """A tune key element as JSON: numbers, strings, bools and None as they are; anything else (a torch
    dtype) by its str."""
    return x if x is None or isinstance(x, (bool, int, float, str)) else str(x)


def entry_key(kernel: str, source: str, key: tuple) -> str:
    """The JSON key of one entry: the kernel, its source hash and the tune key (without the device)."""
    return json.dumps([kernel, source, [_plain(x) for x in key]], separators=(",", ":"))


def read_entries(path: Path) -> dict[str, Any]:
    """The entries of the file at ``path``; {} when it is missing, unreadable, corrupt or of another format."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock`` (none where fcntl is missing: os.replace still keeps
    the file whole, but two writers may then drop each other's new entries)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(str(path) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_entries(path: Path, new: dict[str, Any], header: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add ``new`` to the entries on disk (under the lock, read-merge-replace) and return them all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        entries = read_entries(path)
        entries.update(new)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT, **(header or {}), "entries": entries}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return entries


#: What this process has read of each file (a miss re-reads it: another process may have tuned since).
_loaded: dict[Path, dict[str, Any]] = {}
_warned: set[Path] = set()


def load(kernel: str, device_index: int | None, key: tuple) -> Any | None:
    """The stored value of ``key`` for ``kernel`` on this device's GPU model and Triton, or None."""
    if not enabled():
        return None
    path = cache_file(*_environment(device_index))
    name = entry_key(kernel, kernel_source_hash(kernel), key)
    entries = _loaded.get(path)
    if entries is None or name not in entries:
        entries = _loaded[path] = read_entries(path)
    return entries.get(name)


def store(kernel: str, device_index: int | None, key: tuple, value: Any) -> None:
    """Write ``value`` (JSON data) for ``key``; a failure to write warns once per file and is otherwise ignored."""
    if not enabled():
        return
    gpu, version = _environment(device_index)
    path = cache_file(gpu, version)
    name = entry_key(kernel, kernel_source_hash(kernel), key)
    try:
        _loaded[path] = write_entries(path, {name: value}, {"gpu": gpu, "triton": version})
    except OSError as err:
        _loaded.setdefault(path, {})[name] = value
        if path not in _warned:
            _warned.add(path)
            warnings.warn(f"attnlab: could not write the autotune cache {path}: {err}", stacklevel=2)
