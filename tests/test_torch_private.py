"""Private torch APIs stay behind mimose_cli/torch_private.py."""

import re
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from mimose_cli.planners.blocks import inside_checkpoint, recomputing
from mimose_cli.torch_private import tensor_version, top_saved_tensors_hook_name

PACKAGE = Path(__file__).resolve().parents[1] / "mimose_cli"
PRIVATE = re.compile(r"torch\._(?!_)|torch\.utils\._|torch\.distributed\._|\._version\b")


def test_no_module_but_torch_private_touches_a_private_torch_api():
    offenders = [f"{path.relative_to(PACKAGE)}:{number}"
                 for path in PACKAGE.rglob("*.py") if path.name != "torch_private.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if PRIVATE.search(line.split("#")[0])]
    assert offenders == []


def test_the_checkpoint_region_queries_see_forward_and_recompute():
    seen = []

    def block(x):
        seen.append((inside_checkpoint(), recomputing(), bool(top_saved_tensors_hook_name())))
        return (x * 2).sin()

    x = torch.randn(4, requires_grad=True)
    assert not inside_checkpoint() and top_saved_tensors_hook_name() == ""
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert seen == [(True, False, True), (True, True, True)]  # forward, then its recompute


def test_tensor_version_counts_in_place_changes():
    x = torch.zeros(3)
    before = tensor_version(x)
    x.add_(1)
    assert tensor_version(x) == before + 1
