"""Set-up: one source of dependencies, a wheel that ships the CUDA sources, and `make lab` that serves."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = {_name(r) for r in project["dependencies"]}
    conda, pip, extras_line = set(), set(), None
    section = None
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if line.strip() == "dependencies:":
            section = "deps"
            continue
        if section and line.strip() == "- pip:":
            section = "pip"
            continue
        item = line.strip()[2:].strip() if line.strip().startswith("- ") else None
        if item is None or section is None:
            continue
        if section == "pip":
            if item.startswith("-e "):
                extras_line = item
            else:
                pip.add(_name(item))
        else:
            conda.add(_name(item.split("=")[0] if "=" in item and ">" not in item else item))
    got = (conda | pip) - {"python", "pip"}
    assert got == want, f"environment.yml has {sorted(got)}, pyproject.toml has {sorted(want)}"
    # the pip section installs the package itself with the dev extras (and so the same extras' dependencies)
    assert extras_line is not None and re.fullmatch(r"-e \.\[dev\]", extras_line), extras_line
    assert "dev" in project["optional-dependencies"]


def test_extras_cover_cuda_and_notebooks():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {_name(r) for r in extras["cuda12"]} == {"cupy-cuda12x"}
    assert {_name(r) for r in extras["cuda13"]} == {"cupy-cuda13x"}
    assert {"jupyterlab", "nbval"} <= {_name(r) for r in extras["notebooks"]}


def test_wheel_ships_the_cuda_sources(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    wheel = next(tmp_path.glob("attnlab-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh")]
    for s in sources:
        assert f"attnlab/kernels/{s}" in names, f"{s} missing from the wheel"
    assert "attnlab/kernels/__init__.py" in names and "attnlab/__init__.py" in names
    for init in (ROOT / "attnlab").rglob("__init__.py"):  # every subpackage (backends/, bench/, lessons/ ...)
        rel = init.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} missing from the wheel ([tool.setuptools] packages)"


def test_no_module_over_600_lines():
    """One idea per module (docs/design.md): no module of attnlab/ is over 600 lines."""
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "attnlab").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_starts_jupyterlab():
    """`make lab` serves JupyterLab on notebooks/: start it on a free port, ask its API, stop it."""
    if not (ROOT / ".venv" / "bin" / "jupyter").exists() or shutil.which("make") is None:
        pytest.skip("needs the project's .venv (created by make test) and make")
    port, token = _free_port(), "attnlab-test"
    args = f"--no-browser --port={port} --IdentityProvider.token={token} --ServerApp.ip=127.0.0.1"
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, env={**os.environ, "JUPYTER_PLATFORM_DIRS": "1"},
    )
    try:
        deadline, last = time.time() + 120, None
        while time.time() < deadline:
            try:
                url = f"http://127.0.0.1:{port}/api/contents?token={token}"
                with urllib.request.urlopen(url, timeout=5) as r:
                    listing = json.load(r)
                break
            except OSError as e:
                last = e
                if proc.poll() is not None:
                    pytest.fail(f"make lab exited early: {proc.stdout.read().decode()[-2000:]}")
                time.sleep(1)
        else:
            pytest.fail(f"JupyterLab did not answer within 120 s: {last}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10) as r:
            assert r.status == 200
        assert listing["type"] == "directory"
        assert {c["name"] for c in listing["content"]} == {p.name for p in (ROOT / "notebooks").iterdir()
                                                           if not p.name.startswith(".")}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_a_checkout_never_shadows_an_installed_kernels_package(tmp_path):
    """Run from the checkout's root, ``import kernels`` gives the installed package of that name (transformers
    imports Hugging Face's), and this folder only when none is installed."""
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    code = "import kernels; print(kernels.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(tmp_path)}, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(fake / "__init__.py")
    alone = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                           timeout=60)
    import importlib.machinery

    installed = importlib.machinery.PathFinder.find_spec(  # Hugging Face's, where the dev extras pulled it in
        "kernels", [p for p in sys.path if p and Path(p).resolve() != ROOT])
    want = installed.origin if installed is not None and installed.origin else str(ROOT / "kernels" / "__init__.py")
    assert alone.stdout.strip() == want, alone.stderr
