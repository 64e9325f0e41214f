"""Run attnlab's command line with kernels/ patched by a variant: an A/B probe of CUDA kernel sources.

usage: PYTHONPATH=. python .wip/mma-softmax/probe/variant_run.py NAME ARGS...
NAME 'base' runs the checkout's kernels; any other name copies kernels/ to a temporary folder, applies
``var/NAME.patch`` there (``git apply``; a unified diff of ``attn_mma.cu`` against the series' kernel), and points
attnlab at it. A ``var/NAME.bn`` ("dmax:bn" pairs) overrides ``variant.mma_bn``, the Python twin of
``MmaTiles::BN`` (the launch's shared-memory size). Each variant runs in its own process, so no compiled kernel of
another variant is cached in it.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attnlab.backends.cuda.sources as sources
import attnlab.backends.cuda.variant as variant
from attnlab.cli import main


def overlay(name: str) -> None:
    """Point attnlab's CUDA sources (and mma_bn) at variant ``name``."""
    here = Path(__file__).resolve().parent
    tmp = Path(tempfile.mkdtemp(prefix=f"kernels-{name}-")) / "kernels"
    shutil.copytree(Path(str(sources.kernels_dir())), tmp)
    subprocess.run(["git", "apply", str(here / "var" / f"{name}.patch")], cwd=tmp, check=True)
    original_dir = sources.kernels_dir
    for mod in list(sys.modules.values()):  # sources, and every module that imported kernels_dir by name
        if getattr(mod, "kernels_dir", None) is original_dir:
            mod.kernels_dir = lambda: tmp
    bn = here / "var" / f"{name}.bn"
    if bn.exists():
        table = dict(tuple(int(x) for x in pair.split(":")) for pair in bn.read_text().split())
        original = variant.mma_bn
        patched = lambda dmax: table.get(dmax, original(dmax))
        for mod in list(sys.modules.values()):  # every module that imported mma_bn by name
            if getattr(mod, "mma_bn", None) is original:
                mod.mma_bn = patched


if __name__ == "__main__":
    if sys.argv[1] != "base":
        overlay(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
