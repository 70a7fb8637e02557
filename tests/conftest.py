"""Shared pytest set-up: tests/ on sys.path so helpers import in spawned ranks too."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from distributed import Worlds  # noqa: E402


@pytest.fixture(scope="session")
def worlds():
    """Long-lived gloo worlds: ``worlds.run(world_size, fn, *args)`` -> per-rank results."""
    pools = Worlds()
    yield pools
    pools.close()


@pytest.fixture(autouse=True)
def _no_process_group_left_in_the_test_process(request):
    """Tests run their ranks in other processes; a default process group left in this one
    (by a test that initialised in-process) would make later tests see a world they did not
    make. It is destroyed after the test that left it, with a warning naming that test."""
    yield
    import warnings

    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        warnings.warn(f"{request.node.nodeid} left a default process group in the test "
                      "process (destroyed after it); destroy it where it is made")
