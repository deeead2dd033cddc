"""pytest set-up: seeded tests, and GPU tests skipped with the library's own reason on machines without one."""

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    cuda_items = [it for it in items if "cuda" in it.keywords]
    if not cuda_items:
        return
    import megatrain  # imported here, not at collection of every module: nothing touches CUDA at import

    status = megatrain.cuda_status()
    if status != "ok":
        skip = pytest.mark.skip(reason=f"needs CUDA: {status}")
        for it in cuda_items:
            it.add_marker(skip)
