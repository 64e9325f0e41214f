"""attnlab.bench.llama_sdpa's plumbing on a tiny Llama on the CPU (where SDPA's flash backend, and so attnlab's
provider, are not in play: every variant is PyTorch's), when transformers is installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attnlab import sdpa_provider
from attnlab.bench import llama_sdpa


@pytest.mark.skipif(not sdpa_provider.available(), reason=f"torch {torch.__version__} has no flash registry "
                    "(torch.nn.attention.activate_flash_attention_impl, torch 2.11 on): the provider cannot activate")
def test_the_three_variants_run_and_compare(tmp_path):
    shape = llama_sdpa.Shape(B=1, N=24, layers=2, Hq=4, Hkv=2, D=16, intermediate=64, vocab=50)
    result = llama_sdpa.run(str(tmp_path / "llama.json"), shape, device="cpu", dtype=torch.float32)
    cmp = result["compare"]
    assert cmp["sdpa-flash"]["logits_max_abs_vs_eager"] < 1e-4  # float32: eager and SDPA's math agree closely
    assert cmp["attnlab"]["logits_max_abs_vs_sdpa_flash"] == 0.0  # on the CPU both are PyTorch's SDPA
    assert result["timing"]["attnlab_calls_per_step"]["forward"] == 0  # the provider serves CUDA tensors only
    checks = result["checks"]
    assert not checks["served_every_call"] and checks["refused_none"]
    assert (tmp_path / "llama.json").exists()
