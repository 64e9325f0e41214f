"""How Triton's C glue is built in a new process (attnlab.triton_glue): the driver's load-time utilities at
-O1, every launcher as Triton builds it, and only on the Triton versions whose build this copies."""

from __future__ import annotations

import shutil
import types

import pytest

from attnlab import triton_glue


def _cmd(name: str) -> list[str]:
    cmd, so = triton_glue.command(name, "/src/m.c", "/tmp/b", ["/lib/cuda"], ["/inc"], ["cuda", "libx.so.1"], "gcc")
    assert so.startswith("/tmp/b/" + name)
    return cmd


def test_the_driver_utilities_are_built_at_O1_and_launchers_as_triton_builds_them():
    utils, launcher = _cmd("cuda_utils"), _cmd("__triton_launcher")
    assert "-O1" in utils and "-O3" not in utils
    assert "-O3" in launcher and "-O1" not in launcher
    for cmd in (utils, launcher):
        assert cmd[:2] == ["gcc", "/src/m.c"]
        assert {"-shared", "-fPIC", "-lcuda", "-l:libx.so.1", "-L/lib/cuda", "-I/inc", "-I/tmp/b"} <= set(cmd)


def test_it_applies_to_triton_3_5_and_3_6_only():
    assert triton_glue.applies("3.6.0", set()) and triton_glue.applies("3.5.1", ())
    assert not triton_glue.applies("3.6.0", {"/opt/cudacrt"})  # extra header folders: Triton's own build
    for version in ("3.4.0", "3.7.0", "3.9.0", "4.0.0"):
        assert not triton_glue.applies(version, set())


@pytest.fixture
def fake_triton(monkeypatch):
    build = types.SimpleNamespace(impl=None, backend_dirs=set())
    fake = types.SimpleNamespace(__version__="3.6.0", knobs=types.SimpleNamespace(build=build))
    monkeypatch.setitem(__import__("sys").modules, "triton", fake)
    monkeypatch.delenv("ATTNLAB_GLUE_BUILD", raising=False)
    return fake


def test_install_sets_the_build_once_and_never_replaces_a_users(fake_triton, monkeypatch):
    assert triton_glue.install() is True and fake_triton.knobs.build.impl is triton_glue.build
    mine = object()
    fake_triton.knobs.build.impl = mine
    assert triton_glue.install() is False and fake_triton.knobs.build.impl is mine


def test_install_leaves_other_versions_and_a_switched_off_process_alone(fake_triton, monkeypatch):
    fake_triton.__version__ = "3.9.0"
    assert triton_glue.install() is False and fake_triton.knobs.build.impl is None
    fake_triton.__version__ = "3.6.0"
    monkeypatch.setenv("ATTNLAB_GLUE_BUILD", "0")
    assert triton_glue.install() is False and fake_triton.knobs.build.impl is None


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("clang") is None, reason="no C compiler")
def test_the_build_writes_a_shared_object(tmp_path):
    src = tmp_path / "cuda_utils.c"
    src.write_text("int attnlab_answer(void) { return 42; }\n")
    so = triton_glue.build("cuda_utils", str(src), str(tmp_path), [], [], [])
    assert (tmp_path / so).is_file() and so.startswith(str(tmp_path))
