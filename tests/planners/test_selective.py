"""A block checkpointed selectively (``blocks.SELECTIVE``): the compute-heavy ops' outputs kept,
the rest recomputed in backward, through torch's selective activation checkpointing."""

import pytest
import torch

from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.memory import build_meter
from mimose_cli.planners.base import build_planner
from mimose_cli.planners.blocks import RECOMPUTE, SELECTIVE
from mimose_cli.planners.ops import COMPUTE_HEAVY_OPS
from mimose_cli.planners.runners import run_block

from helpers import bert_batch, run_step, tiny_bert

QUICKSTART = "recipes/quickstart.yaml"


def _step(planner_name: str, **options):
    """Loss, gradients and peak of one planned step of a 4-layer BERT under ``planner_name``."""
    model = tiny_bert(layers=4)
    meter = build_meter("simulated", 10**9)
    with meter.activate():
        meter.track(model)
        planner = build_planner(planner_name, model, None, meter=meter, **options)
        loss, peak, _ = run_step(planner, meter, bert_batch(4, 64))
        planner.close()
    return loss.item(), [p.grad.clone() for p in model.parameters()], peak


def test_a_selective_block_holds_between_kept_and_recomputed_and_computes_the_same():
    """Bit-identical loss and gradients: the recompute runs the same ops in the same order on the
    same inputs as the forward (the kept outputs are the forward's own, dropout's RNG is put
    back), so torch computes the same values; its peak lies between plain and full
    checkpointing's."""
    plain, selective, full = _step("none"), _step("full", selective=True), _step("full")
    for other in (selective, full):
        assert other[0] == plain[0]
        assert all(torch.equal(a, b) for a, b in zip(other[1], plain[1]))
    assert full[2] < selective[2] < plain[2], (full[2], selective[2], plain[2])


def test_the_compute_heavy_ops_include_linear_and_attention_kernels():
    aten = torch.ops.aten
    assert {aten.addmm.default, aten.mm.default, aten.bmm.default, aten.convolution.default} <= COMPUTE_HEAVY_OPS


def test_run_block_refuses_an_unknown_choice_and_keeps_under_no_grad():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="choice='halfway' cannot be checkpointed"):
        run_block("halfway", linear, (x,), {})
    with torch.no_grad():
        assert torch.equal(run_block(SELECTIVE, linear, (x,), {}), linear(x))
    assert run_block(RECOMPUTE, linear, (x,), {}).grad_fn is not None


def test_a_recipe_turns_selective_checkpointing_on_for_full():
    recipe = load_recipe(QUICKSTART, ["planner.name=full", "planner.full.selective=true"])
    assert recipe.planner.keywords == {"selective": True}
    with pytest.raises(ValueError, match="selective"):
        load_recipe(QUICKSTART, ["planner.name=full", "planner.full.selective=3"])


def test_blocks_with_batchnorm_statistics_cannot_be_checkpointed_selectively():
    """Their recompute puts the statistics back (ops its forward did not run), which torch's
    selective checkpointing refuses mid-backward: refused up front, in one line, the model left
    free for the planner asked for next."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
                                  for _ in range(3)])
    with pytest.raises(ValueError, match="block 0 selectively: it holds buffers"):
        build_planner("full", model, None, selective=True)
    build_planner("full", model, None).close()
    assert all("forward" not in m.__dict__ for m in model)  # no router left in the blocks
