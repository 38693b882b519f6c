"""Private torch APIs stay behind mimose_cli/torch_private.py."""

import re
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from mimose_cli.planners.runners import inside_checkpoint, recomputing
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


def test_autocast_open_holds_for_the_ops_autocast_casts_for():
    """Inside a dispatch mode, ``autocast_enabled`` reads False for an op autocast redispatches
    (a linear it casts to bf16), so the probe's per-op flag uses ``autocast_open``: True for
    every op while a context is open (its cache of casts not cleared), False after it."""
    from mimose_cli.memory.probe import LiveProbe
    from mimose_cli.torch_private import autocast_enabled, autocast_open

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    enabled = []

    class Seen(LiveProbe):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            enabled.append(autocast_enabled())
            return super().__torch_dispatch__(func, types, args, kwargs)

    probe = Seen()
    with probe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, w)
        (y.float() * 2).sum()
    inside = len(probe.autocast) - 3  # the last three ops ran after the context closed
    assert not all(enabled[:inside])  # why autocast_enabled() cannot be the flag
    assert probe.autocast[:inside] == [True] * inside and probe.autocast[inside:] == [False] * 3
    assert not autocast_open()
