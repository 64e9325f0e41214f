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


def pytest_configure(config):
    """On a GPU, every call the Hopper forward takes runs it from its first call (``sync``), so that the contract
    tests check the kernel that later calls run; ATTNLAB_HOPPER set by hand wins."""
    import os

    if HAS_GPU and "ATTNLAB_HOPPER" not in os.environ:
        from attnlab.backends.triton import hopper_forward as hopper

        hopper.set_mode("sync")
