"""The planner ``offload``: every block offloaded, a budget keeping cannot meet met, the same step."""

import pytest
import torch
from torch import nn

from mimose_cli.memory import build_meter
from mimose_cli.planners import PLANNERS, Planner, build_planner
from mimose_cli.planners.blocks import KEEP, OFFLOAD, RECOMPUTE, SELECTIVE


def _model(width=32, depth=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width),
                         nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))))


def _step(name, budget_bytes=None):
    """One step under planner ``name`` on a simulated device of ``budget_bytes``: (model, planner,
    loss, meter), the planner closed."""
    model = _model()
    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(1))
    meter = build_meter("simulated", budget_bytes)

    def step_fn(batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss.detach()

    with meter.activate():
        meter.track(model, x)
        policy = PLANNERS[name] if isinstance(name, str) else name
        with Planner(model, policy, budget_bytes, meter=meter, blocks="1.*") as planner:
            loss = planner.run(step_fn, x)
    return model, planner, loss, meter


def test_offloading_every_block_meets_a_budget_keeping_cannot_and_computes_the_same_step():
    """Bit for bit: the same ops run in the same order; backward reads byte-exact copies."""
    kept_model, _, kept_loss, kept = _step("none")
    _, _, _, unlimited = _step("offload")
    assert unlimited.peak_bytes() < kept.peak_bytes()
    budget = (unlimited.peak_bytes() + kept.peak_bytes()) // 2
    model, planner, loss, meter = _step("offload", budget)
    assert planner.last.retries == 0 and planner.last.plan == (OFFLOAD,) * planner.num_blocks
    assert planner.plan == (OFFLOAD,) * planner.num_blocks
    assert meter.peak_bytes() <= budget and meter.peak_host_bytes() > 0 and meter.host_bytes() == 0
    assert torch.equal(loss, kept_loss)
    for (name, a), b in zip(kept_model.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    with pytest.raises(torch.OutOfMemoryError):
        _step("none", budget)


def test_a_model_off_the_cpu_and_cuda_is_refused_in_one_line_and_left_unclaimed():
    model = _model().to("meta")
    with pytest.raises(ValueError, match=r"^planner offload .* on meta; choose another planner$"):
        build_planner("offload", model, blocks="1.*")
    for name in ("mimose", "oracle"):  # offload among their choices: the same refusal
        with pytest.raises(ValueError, match=r"^choices: offload .* on meta; use choices: selective$"):
            build_planner(name, model, blocks="1.*", choices="offload")
    build_planner("none", model, blocks="1.*").close()  # not claimed by the refused planner


def test_a_plan_mixes_the_choices_block_by_block_and_the_run_records_them():
    """One plan, four choices: block 0 recomputed, 1 checkpointed selectively, 2 offloaded, 3
    kept; the step computes what keeping every block computes (the same ops in the same order,
    byte-exact copies and recomputes), and the heat map has a colour for each choice."""
    from mimose_cli.planners.baselines.uniform import NoCheckpointingPolicy
    from mimose_cli.planners.contract import Decision
    from mimose_cli.runs.plots import plan_figure
    from mimose_cli.runs.records import completed_step

    class Mixed(NoCheckpointingPolicy):
        def decide(self, input_size, context=None):
            return Decision((RECOMPUTE, SELECTIVE, OFFLOAD, KEEP))

    kept_model, _, kept_loss, _ = _step("none")
    model, planner, loss, _ = _step(Mixed)
    assert torch.equal(loss, kept_loss)
    for (name, a), b in zip(kept_model.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    info = planner.last
    assert info.plan == planner.plan == (RECOMPUTE, SELECTIVE, OFFLOAD, KEEP)
    record = completed_step(info, step=0, micro_step=0, input_shape=[4, 8], loss=0.0, num_blocks=4, lr=0.0,
                            iter_ms=1.0, peak_bytes=1, fwd_bwd_peak_bytes=1, start_bytes=0, activation_bytes=0)
    assert record.plan == [RECOMPUTE, SELECTIVE, OFFLOAD, KEEP]  # block 2 offloaded
    grid = plan_figure([record]).axes[0].images[0].get_array()
    assert list(grid[:, 0]) == [4.0, 2.0, 1.0, 0.0]
