"""Run under torchrun: every rank runs the same tests in the same order."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import megatorch  # noqa: F401  (loads the operators)


@pytest.fixture(scope="session", autouse=True)
def process_group():
    if "RANK" not in os.environ:
        pytest.fail("tests/python/distributed must run under torchrun (ctest does this)")
    torch.set_num_threads(1)
    # A short timeout: if one rank fails a test, the others fail fast instead of hanging.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    yield
    dist.barrier()
    dist.destroy_process_group()
