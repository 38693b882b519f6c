import pytest

from mimose_cli.recipe import load_recipe

from helpers import QUICK_OVERRIDES, QUICKSTART


@pytest.fixture
def quick_recipe(tmp_path):
    """The quickstart recipe cut to a few steps, writing into tmp_path."""
    def make(*overrides, **flags):
        base = QUICK_OVERRIDES + [f"out_dir={tmp_path / 'runs'}"]
        return load_recipe(QUICKSTART, base + list(overrides), flags)
    return make
