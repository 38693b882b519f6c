import os

# Tests never download: a hub name must fail at once. Set before anything imports huggingface_hub
# or datasets, which read it on import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch

from mimose_cli.launcher.recipe import load_recipe

from helpers import QUICK_OVERRIDES, QUICKSTART


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test on one intra-op thread: the suite's models are tiny, and on cores shared with
    other jobs the threads of one op wait on each other (a cut quickstart step took 3 s on two
    threads of two busy cores, 80 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quick_recipe(tmp_path):
    """The quickstart recipe cut to a few steps, writing into tmp_path."""
    def make(*overrides, **flags):
        base = QUICK_OVERRIDES + [f"out_dir={tmp_path / 'runs'}"]
        return load_recipe(QUICKSTART, base + list(overrides), flags)
    return make
