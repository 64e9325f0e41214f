"""The contract, for every backend: each registered backend over every case list of ``attnlab.cases``.

A new backend is tested here by registering it (``attnlab/backends/__init__.py``); a new case list by adding
it to ``attnlab.cases.CASE_LISTS``. On CPU the lists marked ``cpu`` run on every backend available here
(Triton through its interpreter); with ``-m gpu`` every list runs on CUDA tensors. A backend that cannot run
here is skipped with its reason. Each case is judged by ``attnlab.check.verify`` (both criteria, lse, the
empty-row rule) against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import backends
from attnlab.cases import CASE_LISTS, make_inputs
from attnlab.check import problem_of, summarize, verify


def _params(gpu: bool) -> list:
    out = []
    for name in backends.registry():
        for cl in CASE_LISTS.values():
            if not gpu and not cl.cpu:
                continue
            out += [pytest.param(name, case, id=f"{name}-{cl.name}-{case.name}") for case in cl.cases()]
    return out


def _run(name: str, case, device: str) -> None:
    backend = backends.registry()[name]
    avail = backend.availability()
    if not avail.available:
        pytest.skip(f"{name}: {avail.reason}")
    q, k, v, kw = make_inputs(case, dtype=case.dtypes[0], device=device, seed=0)
    why = backend.unsupported(problem_of(q, k, v, kw))
    if why is not None:  # outside the backend's declared scope (e.g. the decode path and a prefill)
        pytest.skip(f"{name}: {why}")
    df = verify(backends=[name], cases=[case], device=device)
    assert len(df) > 0
    assert df["passed"].astype(bool).all(), "\n" + summarize(df)


def test_every_backend_and_case_list_is_covered():
    names = list(backends.registry())
    assert {"reference", "torch", "sdpa", "triton"} <= set(names)
    assert {"default", "extra", "gpu", "long"} <= set(CASE_LISTS)
    for cl in CASE_LISTS.values():
        cases = cl.cases()
        assert cases and len({c.name for c in cases}) == len(cases), cl.name


@pytest.mark.parametrize("name, case", _params(gpu=False))
def test_contract_cpu(name, case):
    _run(name, case, "cpu")


@pytest.fixture
def untuned():
    """Correctness, not tuning: GPU launches use each Triton config space's first entry (test_triton.py's
    test_every_candidate_gpu covers the others)."""
    from attnlab.backends.triton import configs

    old, configs.AUTOTUNE = configs.AUTOTUNE, False
    try:
        yield
    finally:
        configs.AUTOTUNE = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("name, case", _params(gpu=True))
def test_contract_gpu(name, case, untuned):
    _run(name, case, "cuda")
