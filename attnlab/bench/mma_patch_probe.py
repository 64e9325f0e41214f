"""A/B of text patches to the tensor-core kernel (``kernels/attn_mma.cu``), each launched on the very parameters the
public call packs: the method behind the decisions log's entries on ``cuda-mma``.

A patch file is JSON, ``{"mode": [[old, new], ...], ...}``: each ``old`` must occur exactly once in the kernel's
text (with its headers inlined), and the mode's pairs apply in order. ``main`` is the kernel as it is. For every
case, each mode is compiled for the variant the public call picks, launched into the same output on the public
call's own launch (:meth:`attnlab.backends.cuda.launch.PreparedLaunch.launch_kernel`) and compared with ``main``
bit for bit, its largest difference recorded; then timed with CUDA events over back-to-back launches, in
:data:`ROUNDS` rounds interleaved with SDPA's flash kernel on the same input (every round after the first in the
order of :func:`attnlab.bench.timing.next_round`). A mode that changes the grid, or an output the kernel cannot
write itself (a staged one), is out of scope.

Usage on the GPU: ``python -m attnlab.bench.mma_patch_probe PATCHES.json OUT.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

#: (dtype, B, H, N, D, causal): the dense suite's bfloat16 rows, then two shapes between them.
CASES = [
    *(("bfloat16", B, 16, N, D, causal) for D in (128, 64) for B, N in ((8, 1024), (4, 4096), (1, 16384))
      for causal in (False, True)),
    ("bfloat16", 2, 16, 2048, 128, False), ("bfloat16", 16, 16, 512, 64, True),
]
ROUNDS = 7


def load_patches(path: str | Path) -> dict[str, list[tuple[str, str]]]:
    """The patch file's modes, checked: an object of mode name -> list of [old, new] string pairs, no mode named
    ``main``. Raises ValueError saying what is wrong."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the patch file {path}: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError("the patch file must hold a JSON object of mode name -> [[old, new], ...]")
    modes = {}
    for mode, pairs in raw.items():
        if mode == "main":
            raise ValueError("'main' is the unpatched kernel; name the patched modes otherwise")
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
            raise ValueError(f"mode {mode!r}: expected a list of [old, new] string pairs")
        modes[mode] = [(old, new) for old, new in pairs]
    return modes


def apply_patches(source: str, pairs: Sequence[tuple[str, str]], mode: str = "") -> str:
    """``source`` with each (old, new) applied in order; ValueError when an ``old`` does not occur exactly once
    (the kernel's text moved since the patch was written)."""
    for old, new in pairs:
        count = source.count(old)
        if count != 1:
            first = old.strip().splitlines()[0] if old.strip() else repr(old)
            raise ValueError(f"mode {mode!r}: the text to replace occurs {count} times, not once: {first[:80]!r}")
        source = source.replace(old, new)
    return source


def check_patches(modes: dict[str, list[tuple[str, str]]]) -> None:
    """Every mode applies to the kernel's current text (ValueError naming the first that does not)."""
    from attnlab.backends.cuda.sources import kernel_source

    source = kernel_source("mma")
    for mode, pairs in modes.items():
        apply_patches(source, pairs, mode)


def _case(dtype: str, B: int, H: int, N: int, D: int, causal: bool, modes: dict, cache: dict) -> dict:
    """One case: every mode checked against main, then the interleaved timing."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnlab
    from attnlab.backends.cuda import launch
    from attnlab.backends.cuda.sources import kernel_source
    from attnlab.bench.timing import mean_gpu_ms, round_orders
    from attnlab.problem import make_problem

    g = torch.Generator(device="cuda").manual_seed(N + D + causal)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=getattr(torch, dtype), generator=g) for _ in range(3))
    out = torch.empty_like(q)
    prep = launch.prepare("mma", make_problem(q, k, v, causal=causal), out, None)
    if prep.keep_alive[-1] is not None:  # launch_kernel does not copy from a staging buffer
        raise ValueError(f"D {D}: the output would be staged; the probe takes only outputs the kernel writes itself")
    kernels = {}
    for mode, pairs in {"main": [], **modes}.items():
        key = (prep.variant.name_expression, mode)
        if key not in cache:
            text = apply_patches(kernel_source("mma"), pairs, mode)
            cache[key] = launch.build_module(prep.variant, q.device.index, text)[0].kernel
        kernels[mode] = cache[key]
    row = {"dtype": dtype, "B": B, "H": H, "N": N, "D": D, "causal": causal, "variant": prep.variant.label,
           "equal": {}, "max_abs_diff": {}}
    ref = None
    for mode, fn in kernels.items():
        out.fill_(float("nan"))
        prep.launch_kernel(fn)
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
            row["equal"]["public_call"] = bool(torch.equal(attnlab.attention(q, k, v, causal=causal,
                                                                             backend="cuda-mma"), ref))
        row["equal"][mode] = bool(torch.equal(out, ref))
        row["max_abs_diff"][mode] = float((out.float() - ref.float()).abs().max())
    calls = {mode: (lambda fn=fn: prep.launch_kernel(fn)) for mode, fn in kernels.items()}
    calls["sdpa-flash"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    times: dict[str, list[float]] = {name: [] for name in calls}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for call in calls.values():
            mean_gpu_ms(call, 3)  # warm up
        n = max(5, min(100, int(20 / max(mean_gpu_ms(calls["sdpa-flash"], 5), 1e-3))))
        for order in round_orders(list(calls), ROUNDS):
            for name in order:
                times[name].append(mean_gpu_ms(calls[name], n))
    row["ms"] = {name: statistics.median(t) for name, t in times.items()}
    row["flash_over"] = {mode: row["ms"]["sdpa-flash"] / row["ms"][mode] for mode in kernels}
    return row


def run(modes: dict[str, list[tuple[str, str]]], out: str) -> dict:
    """Every case of :data:`CASES` under ``main`` and each mode; the record (environment, patches, rows) is
    written to ``out`` as JSON and returned."""
    from attnlab.bench.experiment import run_rows

    check_patches(modes)  # every patch applies before anything runs
    cache: dict = {}
    extra = {"method": __doc__.split("\n\n")[1].replace("\n", " "), "rounds": ROUNDS,
             "patches": {mode: [list(p) for p in pairs] for mode, pairs in modes.items()}}
    return run_rows(CASES, lambda *case: _case(*case, modes, cache), out, extra=extra)


def main(argv: Sequence[str] | None = None) -> int:
    from attnlab.cli import OneLineParser

    parser = OneLineParser(prog="python -m attnlab.bench.mma_patch_probe", description=__doc__.split("\n")[0])
    parser.add_argument("patches", help="the JSON file of modes: {mode: [[old, new], ...]}")
    parser.add_argument("out", help="the JSON file to write")
    args = parser.parse_args(argv)
    try:
        modes = load_patches(args.patches)
        check_patches(modes)
        if not Path(args.out).resolve().parent.is_dir():
            raise ValueError(f"no folder for the output file {args.out}")
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        print(f"{parser.prog}: error: needs a CUDA GPU of compute capability 8.0 or newer", file=sys.stderr)
        return 2
    run(modes, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
