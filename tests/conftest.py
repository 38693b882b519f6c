import os

# Tests never download: a hub name must fail at once. Set before anything imports huggingface_hub
# or datasets, which read it on import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from pathlib import Path

import pytest

from mimose_cli.recipe import load_recipe

ROOT = Path(__file__).parent.parent
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# The quickstart recipe, cut to a few small steps so the suite stays fast on 2 cores.
QUICK_OVERRIDES = ["training.max_steps=6", "training.batch_size=4", "data.num_examples=48"]


@pytest.fixture
def quick_recipe(tmp_path):
    """The quickstart recipe cut to a few steps, writing into tmp_path."""
    def make(*overrides, **flags):
        base = QUICK_OVERRIDES + [f"out_dir={tmp_path / 'runs'}"]
        return load_recipe(QUICKSTART, base + list(overrides), flags)
    return make
