from pathlib import Path

import pytest

from mimose_cli.recipe import load_recipe

ROOT = Path(__file__).parent.parent


@pytest.fixture
def quick_recipe(tmp_path):
    """The quickstart recipe cut to a few steps, writing into tmp_path."""
    def make(*overrides, **flags):
        base = ["training.max_steps=6", "data.num_examples=64", f"out_dir={tmp_path / 'runs'}"]
        return load_recipe(ROOT / "recipes" / "quickstart.yaml", base + list(overrides), flags)
    return make
