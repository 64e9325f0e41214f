"""Whether Triton kernels that load their launchers on several threads at once each get their own.

Each round compiles kernels with different argument counts (``launch_cost._kernel_with``) into an empty Triton
cache on this thread, then lets one thread per kernel make its handles (launcher built and loaded, module loaded)
at the same moment, and launches every kernel once: a kernel handed another's launcher fails with a TypeError
(argument count) or writes a wrong value. ``serialized`` runs the same with attnlab's lock
(:func:`attnlab.backends.triton.background.serialize_kernel_loads`); without it, the original method is called.
Usage on a GPU: ``python tools/launcher_race.py ROUNDS OUT.json``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

import torch
import triton
from launch_cost import _kernel_with

from attnlab.backends.triton import background, runtime

COUNTS = (1, 3, 6, 10, 15, 21, 28, 36)  # argument counts: every launcher's parse differs


def one_round(serialized: bool, counts: tuple[int, ...] = COUNTS) -> dict:
    """Compile, load on len(counts) threads at once, launch; the number of kernels that failed or were wrong."""
    before = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    try:
        return _compile_load_launch(serialized, counts)
    finally:
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR")
        else:
            os.environ["TRITON_CACHE_DIR"] = before


def _compile_load_launch(serialized: bool, counts: tuple[int, ...]) -> dict:
    background.serialize_kernel_loads()
    wrapped = triton.compiler.compiler.CompiledKernel._init_handles
    load = wrapped if serialized else wrapped.__wrapped__
    x = torch.zeros(len(counts), dtype=torch.int64, device="cuda")
    compiled = [_kernel_with(n).warmup(x[i:], *range(n), C=i, grid=(1,)) for i, n in enumerate(counts)]
    gate = threading.Barrier(len(compiled))
    errors: list[str] = []

    def make_handles(kernel) -> None:
        gate.wait()
        try:
            load(kernel)
        except Exception as err:  # recorded: the launch below shows what it meant
            errors.append(f"load: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=make_handles, args=(k,)) for k in compiled]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stream = torch.cuda.current_stream().cuda_stream
    for i, (kernel, n) in enumerate(zip(compiled, counts)):
        try:
            runtime.run_compiled(kernel, (1, 1, 1), stream, (x[i:], *range(n), i))
        except TypeError as err:
            errors.append(f"launch {n} args: {err}")
    torch.cuda.synchronize()
    want = torch.tensor([sum(range(n)) + i for i, n in enumerate(counts)], device="cuda")
    wrong = int((x != want).sum())
    return {"serialized": serialized, "kernels": len(counts), "wrong_values": wrong, "errors": errors}


def main() -> None:
    rounds, out = int(sys.argv[1]), sys.argv[2]
    rows = []
    t0 = time.perf_counter()
    for r in range(rounds):
        for serialized in (False, True):
            row = one_round(serialized)
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {arm: {"rounds": sum(1 for r in rows if r["serialized"] == (arm == "serialized")),
                     "rounds_with_a_failure": sum(1 for r in rows if r["serialized"] == (arm == "serialized")
                                                  and (r["errors"] or r["wrong_values"]))}
               for arm in ("unserialized", "serialized")}
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": sys.version.split()[0], "commit": os.environ.get("ATTNLAB_COMMIT", "unknown"),
           "seconds": round(time.perf_counter() - t0, 1)}
    with open(out, "w") as f:
        json.dump({"environment": env, "summary": summary, "rounds": rows}, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
