"""What the notebooks show about the CUDA kernels: excerpts of their sources and maps of which thread owns
which element (the thread mappings documented at the top of each ``kernels/attn_*.cu``).

Nothing here needs a GPU or CuPy: the sources are read as text and the maps are index arithmetic that
mirrors the kernels' own (``threadIdx`` to rows, keys and head dims).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnlab.paths import data_file

#: The CUDA-core families (float32 math), which the per-score models and thread maps here cover.
FAMILIES = ("naive", "tiled", "rowmax")
#: Every family whose source can be read: the CUDA-core ones and the tensor-core kernel.
SOURCES = (*FAMILIES, "mma")


def kernel_path(family: str) -> Path:
    """The ``.cu`` file of a kernel family (``kernels/`` of a checkout, or the installed package)."""
    if family not in SOURCES:
        raise ValueError(f"unknown kernel family {family!r}; one of {SOURCES}")
    try:
        from attnlab.backends.cuda.sources import kernels_dir

        base = Path(str(kernels_dir()))
    except ImportError:
        base = Path(__file__).resolve().parents[2] / "kernels"
    return base / f"attn_{family}.cu"


def source(family: str) -> str:
    """The full CUDA C source of a kernel family."""
    return kernel_path(family).read_text()


def header(family: str) -> str:
    """The comment block that opens the kernel file (what it does, its tiling and thread mapping)."""
    lines = []
    for line in source(family).splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[3:] if line.startswith("// ") else line[2:])
    return "\n".join(lines).strip()


def excerpt(family: str, start: str, end: str | None = None, *, max_lines: int = 40) -> str:
    """Lines of a kernel family's source from the first containing ``start`` through the first later one
    containing ``end`` (or ``max_lines`` lines), dedented. A ``start`` or ``end`` that is gone from the source is
    a ValueError: a notebook that quotes code must fail when the code it quotes has changed."""
    return excerpt_text(source(family), start, end, max_lines=max_lines, name=f"attn_{family}.cu")


def excerpt_text(text: str, start: str, end: str | None = None, *, max_lines: int = 40, name: str = "the text") -> str:
    """:func:`excerpt` on any source text (e.g. ``inspect.getsource`` of a Triton kernel)."""
    lines = text.splitlines()
    i0 = next((i for i, line in enumerate(lines) if start in line), None)
    if i0 is None:
        raise ValueError(f"{start!r} not found in {name}: the source has changed; update the excerpt's anchor")
    if end is not None and not any(end in line for line in lines[i0 + 1:]):
        raise ValueError(f"{end!r} not found after {start!r} in {name}: the source has changed")
    i1 = min(len(lines), i0 + max_lines)
    if end is not None:
        i1 = next((i + 1 for i in range(i0 + 1, len(lines)) if end in lines[i]), i1)
        i1 = min(i1, i0 + max_lines)
    chunk = lines[i0:i1]
    # dedent by the code's indentation; preprocessor lines (#pragma) sit at column 0 and are left alone
    code = [x for x in chunk if x.strip() and not x.lstrip().startswith("#pragma")]
    cut = min((len(x) - len(x.lstrip()) for x in code), default=0)
    return "\n".join(x.lstrip() if x.lstrip().startswith("#pragma") else x[cut:] for x in chunk)


# ---- thread ownership maps ---------------------------------------------------------------------------
def naive_map(D: int = 64, n_keys: int = 8, warps: int = 4) -> np.ndarray:
    """Naive kernel, one block per query row: ``[n_keys, D]`` thread ids. Warp ``j % 4`` takes key j,
    lane ``d % 32`` owns head dim d (the 32 lanes' partial products are summed by shuffles)."""
    j = np.arange(n_keys).reshape(-1, 1)
    d = np.arange(D).reshape(1, -1)
    return (j % warps) * 32 + d % 32


def tiled_map(dmax: int = 64, rows: int = 16, group: int = 8) -> np.ndarray:
    """Tiled kernel, one block per 16 query rows: ``[rows, dmax]`` thread ids. 8 threads per row; thread
    g of a row owns dims ``d = g + 8c`` of q_i, of acc, and of every k_j and v_j it reads."""
    r = np.arange(rows).reshape(-1, 1)
    d = np.arange(dmax).reshape(1, -1)
    return r * group + d % group


def rowmax_score_map(dmax: int = 64, bm: int = 64, tm: int = 4) -> np.ndarray:
    """Rowmax kernel, S = Q K^T: ``[bm, bn]`` thread ids; thread (ty, tx) of the 16 x 16 grid computes
    the 4 x TN block of rows ``4 ty ..`` and keys ``tx, tx + 16, ...`` (keys strided by 16, so the 16
    threads of a row read 16 consecutive K rows; BN = 64 for D <= 64, else 32)."""
    bn = 64 if dmax <= 64 else 32
    r = np.arange(bm).reshape(-1, 1)
    c = np.arange(bn).reshape(1, -1)
    return (r // tm) * 16 + c % 16


def rowmax_out_map(dmax: int = 64, bm: int = 64, tm: int = 4) -> np.ndarray:
    """Rowmax kernel, O += P V: ``[bm, dmax]`` thread ids; thread (ty, tx) owns rows ``4 ty ..`` and dims
    ``64 kk + 4 tx + e`` (e < 4), so each 16-byte load of V feeds 16 FMAs."""
    r = np.arange(bm).reshape(-1, 1)
    d = np.arange(dmax).reshape(1, -1)
    return (r // tm) * 16 + (d % 64) // 4


def reads_per_query(family: str, N: int, D: int) -> dict[str, float]:
    """Shared-to-global traffic model: how many times each K and V element is read from global memory per
    query row (naive: 3 passes over K and one over V per row; tiled: once per 16-row tile; rowmax: once per
    64-row tile)."""
    per_tile = {"naive": 1, "tiled": 16, "rowmax": 64}[family]
    k_passes = 3 if family == "naive" else 1
    return {"K reads per row": k_passes / per_tile, "V reads per row": 1 / per_tile,
            "K+V bytes per row (fp16)": (k_passes + 1) * N * D * 2 / per_tile}


def fp32_layouts(path: Path | str | None = None) -> dict:
    """Figures of the float32 Triton layout experiments, recorded in ``data/experiments/<gpu>/fp32-layouts.json``
    (converted once from the ncu log its ``source_log`` names).

    ``bank_conflict_frac``: shared-load bank conflicts over shared-load wavefronts in the first ncu section
    of the query-major variant (var0), None when the log had no such section; ``query_major_ratio``: per case
    ("B8 H16 N2048"), attnlab's (then query-major) kernel's speed relative to sdpa-efficient in the log's first
    run; ``source_log``; ``path``. A missing file raises FileNotFoundError (with the default path: how to point
    attnlab at its data).
    """
    import json

    from attnlab.lessons.memory import DEFAULT_GPU_DIR

    p = Path(path) if path is not None else data_file("experiments", DEFAULT_GPU_DIR.name, "fp32-layouts.json")
    rec = json.loads(p.read_text())  # a missing file is an error, not a paragraph the notebook silently leaves out
    return {"bank_conflict_frac": rec["bank_conflict_frac"], "query_major_ratio": rec["query_major_ratio"],
            "source_log": rec["source_log"], "path": p}


# ---- launch limits and the nvcc route ----------------------------------------------------------------
#: Per-multiprocessor limits of sm_90 (Hopper) that bound how many blocks are resident at once.
SM90_LIMITS = {"threads": 2048, "blocks": 32, "registers": 65536, "shared_bytes": 228 * 1024,
               "reserved_per_block": 1024}


def blocks_per_sm(threads: int, registers: int, shared_bytes: int, limits: dict | None = None) -> dict[str, int]:
    """How many blocks of a kernel fit on one multiprocessor, per limit (threads, registers, shared memory,
    the block cap) and overall (``"resident"``): the arithmetic of the CUDA occupancy calculator, which
    ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` does on a GPU (registers are allocated per warp in
    units of 256)."""
    lim = dict(SM90_LIMITS, **(limits or {}))
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // 256) * 256
    per = {"threads": lim["threads"] // threads, "blocks": lim["blocks"],
           "registers": lim["registers"] // (regs_per_warp * warps) if registers else lim["blocks"],
           "shared memory": lim["shared_bytes"] // (shared_bytes + lim["reserved_per_block"])}
    per["resident"] = min(per.values())
    return per


def nvcc_commands(family: str, arch: str = "sm_90", out_dir: str = "build") -> list[list[str]]:
    """The blog's route without CuPy: compile one ``kernels/attn_<family>.cu`` alone with nvcc into a cubin
    (the NVRTC options attnlab uses; paths relative to the repository root), then list its kernel symbols,
    which ``ctypes`` finds by name through the driver API (``cuModuleLoad``, ``cuModuleGetFunction``)."""
    from attnlab.backends.cuda.sources import NVRTC_OPTIONS

    src = f"kernels/attn_{family}.cu"  # run from the repository root
    kernel_path(family)  # the family exists
    cubin = f"{out_dir}/attn_{family}_{arch}.cubin"
    return [["nvcc", f"-arch={arch}", *NVRTC_OPTIONS, "-cubin", src, "-o", cubin],
            ["cuobjdump", "-symbols", cubin]]
