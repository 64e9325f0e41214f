"""The import-time guard against torch's first-call VML dispatch race (pytorch/pytorch#188792)."""

from __future__ import annotations

import subprocess
import sys

import attnlab  # noqa: F401  (the import is what settles the dispatch)
from attnlab import cpu_math


def test_importing_attnlab_settles_vml_dispatch_once():
    assert cpu_math.settle_vml_dispatch.cache_info().currsize == 1
    cpu_math.settle_vml_dispatch()
    assert cpu_math.settle_vml_dispatch.cache_info().misses == 1


def test_the_guard_runs_before_any_attnlab_code_in_a_fresh_process():
    code = ("import attnlab.cpu_math as m, attnlab; "
            "assert m.settle_vml_dispatch.cache_info().currsize == 1; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
