"""Shared test set-up: GPU tests are marked ``gpu`` and skip cleanly on machines without one."""

import pytest
import torch

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run pytest -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
