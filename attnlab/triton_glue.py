"""How Triton's C glue is built in a new process (triton 3.5 and 3.6 on CUDA).

Before its first launch in a process whose cache is empty, Triton builds two kinds of C module with the
system's C compiler, both at -O3: its driver's utilities (``cuda_utils``: loading a kernel's binary, reading
device properties, filling TMA descriptors) once, and a launcher per kernel signature. The utilities run when
a kernel is loaded, not on every launch, so :func:`install` has them built at -O1, which compiles in less than
half the time; launchers, which run on every launch, are built as Triton builds them. Triton 3.7 and later
put the launch itself into the utilities' module, so there nothing is changed.

:func:`install` sets ``triton.knobs.build.impl`` only where nobody set one (ATTNLAB_GLUE_BUILD=0: never).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig

#: The optimization level of each module Triton builds; modules not named here keep Triton's.
LEVELS = {"cuda_utils": "-O1"}
TRITON_LEVEL = "-O3"


def command(name: str, src: str, srcdir: str, library_dirs: list[str], include_dirs: list[str],
            libraries: list[str], cc: str) -> tuple[list[str], str]:
    """The compiler command that builds module ``name`` from ``src`` as triton 3.5/3.6 builds it, at the
    level :data:`LEVELS` gives it; and the path of the shared object it writes."""
    so = os.path.join(srcdir, f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}")
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; its headers live where posix_prefix says
        scheme = "posix_prefix"
    includes = [*include_dirs, srcdir, sysconfig.get_paths(scheme=scheme)["include"]]
    cmd = [cc, src, LEVELS.get(name, TRITON_LEVEL), "-shared", "-fPIC", "-Wno-psabi", "-o", so]
    cmd += [_library_flag(lib) for lib in libraries]
    cmd += [f"-L{d}" for d in library_dirs]
    cmd += [f"-I{d}" for d in includes if d is not None]
    return cmd, so


def _library_flag(lib: str) -> str:
    return f"-l:{lib}" if re.search(r"\.so(\.\d+)*$", lib) or lib.endswith(".a") else f"-l{lib}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def build(name: str, src: str, srcdir: str, library_dirs: list[str], include_dirs: list[str],
          libraries: list[str]) -> str:
    """``triton.knobs.build.impl``: build module ``name`` (see :func:`command`) and return its path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("attnlab: no C compiler for Triton's launcher: set CC, or install gcc or clang")
    cmd, so = command(name, src, srcdir, library_dirs, include_dirs, libraries, cc)
    subprocess.check_call(cmd, stdout=subprocess.DEVNULL)
    return so


def applies(version: str, backend_dirs) -> bool:
    """Whether :func:`build` builds what triton ``version`` would (3.5 and 3.6, with no extra CUDA header
    folders set through TRITON_CUDACRT_PATH/TRITON_CUDART_PATH)."""
    return version.split(".")[:2] in (["3", "5"], ["3", "6"]) and not backend_dirs


def install() -> bool:
    """Set :func:`build` as Triton's C build where it applies and no build was set; whether it was set."""
    if os.environ.get("ATTNLAB_GLUE_BUILD", "1") == "0":
        return False
    import triton

    knobs = getattr(triton, "knobs", None)
    build_knobs = getattr(knobs, "build", None)
    if build_knobs is None or getattr(build_knobs, "impl", "absent") is not None:
        return False
    if not applies(triton.__version__, getattr(build_knobs, "backend_dirs", ())):
        return False
    build_knobs.impl = build
    return True
