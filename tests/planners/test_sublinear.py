"""Sublinear: the static plan at the largest input, and Chen et al.'s variants, on blocks of known size."""

import math

import pytest
import torch
from torch import nn

from mimose_cli.planners import build_planner
from mimose_cli.planners.baselines.sublinear import (
    BlockProfile,
    chen_budget_candidates,
    chen_plan,
    chen_segments,
    sqrt_plan,
)

WIDTHS = (16, 32, 64, 32, 16)
BATCH = 8


class Block(nn.Module):
    """Linear -> ReLU -> Linear: saves exactly the ReLU output (batch x width fp32) besides its
    input and weights, so checkpointing it frees 4 * batch * width bytes."""

    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(8, width), nn.Linear(width, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def stack():
    torch.manual_seed(0)
    return nn.Sequential(*[Block(w) for w in WIDTHS])


def prepared(budget, **options):
    sizes = []

    def make_batch(size):
        sizes.append(size)
        return torch.randn(size[0], 8)

    planner = build_planner("sublinear", stack(), budget, **options)
    planner.prepare(make_batch, (BATCH, 8))
    return planner, sizes


def test_measures_known_block_bytes_at_the_largest_input():
    planner, sizes = prepared(10**6)
    assert sizes == [(BATCH, 8)]
    assert planner.policy.profile.act_bytes == [4 * BATCH * w for w in WIDTHS]  # 512, 1024, 2048, 1024, 512
    assert planner.policy.profile.fixed_bytes == 0  # no meter: the budget covers block activations


def test_greedy_plan_step_by_step():
    # Blocks freeing [512, 1024, 2048, 1024, 512] bytes, limit 3000; no plan peaks at 5120.
    # The paper's greedy on excess 2120: no block covers it alone -> the largest (2); 72 left ->
    # the smallest bucket's earliest (0). Plan (0, 2) still peaks at 3072 when backward
    # recomputes block 2 with block 1 held, so the check goes on with 72: block 4 (peak still
    # 3072), then block 1: (0, 1, 2, 4) peaks at 2048 (recomputing block 2 alone).
    planner, _ = prepared(3000)
    assert planner.policy.static_plan == (0, 1, 2, 4)
    assert planner.policy.profile.peak_bytes(planner.policy.static_plan) == 2048
    assert planner.policy.profile.peak_bytes((0, 2)) == 3072


def test_the_static_plan_applies_to_every_batch():
    planner, _ = prepared(3000)
    seen = []
    for rows in (1, 3, BATCH):
        x = torch.randn(rows, 8)
        with planner.step(x) as info:
            planner.model(x).sum().backward()
        seen.append(info.plan)
    assert seen == [("recompute", "recompute", "recompute", "keep", "recompute")] * 3


@pytest.mark.parametrize("variant", ["greedy", "chen"])
def test_no_plan_when_the_largest_input_fits(variant):
    planner, _ = prepared(5120, variant=variant)
    assert planner.policy.static_plan == ()


def test_chen_checkpoints_nothing_without_a_limit():
    assert chen_plan(BlockProfile((1, 8), [512, 1024, 2048], [1.0, 1.0, 1.0]), None) == ()


def test_sqrt_segmentation():
    assert sqrt_plan(9) == (0, 1, 2, 3, 4, 5)  # segments of 3, the last kept
    assert sqrt_plan(10) == tuple(range(8))  # segments of 4: [0-3] [4-7] [8-9]
    assert sqrt_plan(1) == ()
    planner, sizes = prepared(10, variant="sqrt")
    assert planner.policy.static_plan == (0, 1, 2) and sizes == []  # ⌈√5⌉ = 3; needs no measurement


def test_chen_algorithm_3_step_by_step():
    # budget 7 over sizes 4,4,4,4: totals 4, 8 > 7 -> keep block 1 (x=4, y=8), restart; 4, 8 -> keep 3.
    assert chen_segments([4, 4, 4, 4], 7) == ((1, 3), 8, 8)
    # budget 0 keeps every block: x = total, y = the largest
    assert chen_segments([1, 2, 3], 0) == ((0, 1, 2), 6, 3)
    # budget 10 over 4,4,4,4: 12 > 10 at block 2; the tail (4) is the last segment
    assert chen_segments([4, 4, 4, 4], 10) == ((2,), 4, 12)
    # a total equal to the budget does not exceed it: 8 goes on to 12 > 8 at block 2
    assert chen_segments([4, 4, 4, 4], 8) == ((2,), 4, 12)


# The stack's blocks (WIDTHS), and the plans Algorithm 3 gives over its budget grid.
ACT = [512, 1024, 2048, 1024, 512]
CHEN_PEAKS = {(0, 4): 4608, (0, 3): 4096, (0, 1, 3, 4): 3072, (0, 1, 2, 4): 2048, (0, 1, 2, 3, 4): 2048}


def test_chen_segments_the_stack_at_every_budget_of_the_grid():
    # Budget 0 keeps every block: x = 5120, y = 2048; the grid is √(x·y) ≈ 3238 times 2^(k/4),
    # k in [-8, 8]: 810 ... 12953.
    assert chen_segments(ACT, 0) == ((0, 1, 2, 3, 4), 5120, 2048)
    grid = chen_budget_candidates(ACT)
    assert len(grid) == 17 and grid[8] == pytest.approx(math.sqrt(5120 * 2048))
    assert (grid[0], grid[-1]) == (pytest.approx(grid[8] / 4), pytest.approx(grid[8] * 4))
    # 1000: 512 + 1024 keeps block 1; 2048 and 1024 alone exceed it; the tail is 512.
    assert chen_segments(ACT, 1000) == ((1, 2, 3), 4096, 2048)
    # 1200: block 3's 1024 fits, 1024 + 512 does not: block 4 is kept, the tail empty.
    assert chen_segments(ACT, 1200) == ((1, 2, 4), 3584, 2048)
    # 2000: 512 + 1024 fit; + 2048 = 3584 keeps block 2; 1024 + 512 is the tail.
    assert chen_segments(ACT, 2000) == ((2,), 2048, 3584)
    # 4000: 3584 fits; + 1024 = 4608 keeps block 3; the tail is 512.
    assert chen_segments(ACT, 4000) == ((3,), 1024, 4608)
    # 6000: all 5120 fit: one segment, every block recomputed.
    assert chen_segments(ACT, 6000) == ((), 0, 5120)
    # Budgets 810-963, 1145-1362, 1619-3238, 3851-4579 and 5446 on give the five plans (the
    # blocks not kept), whose modelled peaks are CHEN_PEAKS.
    kept = [chen_segments(ACT, budget)[0] for budget in grid]
    assert kept == [(1, 2, 3)] * 2 + [(1, 2, 4)] * 2 + [(2,)] * 5 + [(3,)] * 2 + [()] * 6
    profile = BlockProfile((BATCH, 8), ACT, [1.0] * 5)
    assert {plan: profile.peak_bytes(plan) for plan in CHEN_PEAKS} == CHEN_PEAKS


@pytest.mark.parametrize("slow, limit, plan", [
    # 3100: (0, 1, 3, 4), (0, 1, 2, 4) and all fit; the one that leaves the slow block out wins.
    (2, 3100, (0, 1, 3, 4)),
    (3, 3100, (0, 1, 2, 4)),
    # 4096: (0, 3) fits too, and wins unless it recomputes the slow block: then four fast blocks
    # (4 ms) beat two (6 ms).
    (2, 4096, (0, 3)),
    (3, 4096, (0, 1, 2, 4)),
    # 2048: (0, 1, 2, 4) and all fit; all recomputes block 3 on top.
    (2, 2048, (0, 1, 2, 4)),
    # Nothing fits 1000: the least x + y (6144, 5632, 5632, 5632, 5120): one segment, every block.
    (2, 1000, (0, 1, 2, 3, 4)),
])
def test_chen_plan_is_the_least_recompute_candidate_that_fits(slow, limit, plan):
    fwd_ms = [5.0 if i == slow else 1.0 for i in range(5)]
    assert chen_plan(BlockProfile((BATCH, 8), ACT, fwd_ms), limit) == plan


def test_chen_keeps_the_cheapest_fitting_candidate():
    profile = BlockProfile((8, 8), [100] * 9, [1.0] * 9)
    plan = chen_plan(profile, 450)
    assert profile.peak_bytes(plan) <= 450
    # a segmentation keeping more blocks would not fit: 4 kept blocks peak at 400 + 100 > 450
    assert len(plan) == 9 - 3
    # Nothing fits 50: the least memory x + y. Budgets in [100, 200) keep every second block
    # (x = 400, y = 200), tying √n's segments of 3 (x = 300, y = 300); fewer recomputed wins.
    assert chen_plan(profile, 50) == (0, 2, 4, 6, 8)


def test_chen_variant_plans_at_the_largest_input():
    # Of CHEN_PEAKS only (0, 1, 2, 4) and all fit 3000, and all recomputes block 3 on top, so the
    # plan is (0, 1, 2, 4) whatever the measured times.
    planner, _ = prepared(3000, variant="chen")
    assert planner.policy.profile.act_bytes == ACT
    assert planner.policy.static_plan == (0, 1, 2, 4)


def test_unknown_variant_names_the_option():
    model = stack()
    with pytest.raises(ValueError, match="variant='fastest' is invalid"):
        build_planner("sublinear", model, "1MB", variant="fastest")
    build_planner("sublinear", model, "1MB").close()  # the model is not left claimed


def test_deciding_before_prepare_is_an_error():
    planner = build_planner("sublinear", stack(), "1MB")
    with pytest.raises(RuntimeError, match="prepare"):
        planner.policy.decide((1, 8))


def test_measuring_that_runs_out_of_memory_leaves_nothing_behind():
    """An OOM while profiling at the largest input must free the failed pass's tensors (the
    profiler's saved-tensor hook forms a cycle through autograd that gc cannot break)."""
    from mimose_cli.memory import build_meter

    model = nn.Sequential(*[Block(4096) for _ in range(4)])
    meter = build_meter("simulated", 2_000_000, torch.device("cpu"))
    planner = build_planner("sublinear", model, 2_000_000, meter=meter)
    with meter.activate():
        meter.track(model)
        before = meter.current_bytes()
        with pytest.warns(UserWarning, match="ran out of memory"):
            planner.prepare(lambda size: torch.randn(size[0], 8), (64, 8))
        assert planner.policy.static_plan == (0, 1, 2, 3)
        assert meter.current_bytes() == before


def test_static_plan_leaves_room_for_the_optimizer_state():
    # No plan peaks at 5120 bytes: a budget of 6000 needs none, unless 1500 of it will hold the
    # optimizer's state from the first step on.
    roomy, _ = prepared(6000)
    assert roomy.policy.static_plan == ()
    planner = build_planner("sublinear", stack(), 6000)
    planner.prepare(lambda size: torch.randn(size[0], 8), (BATCH, 8), reserve_bytes=1500)
    assert planner.policy.static_plan and planner.policy.profile.peak_bytes(planner.policy.static_plan) <= 4500
    assert planner.stats["reserve_bytes"] == 1500


def test_warns_when_even_the_plan_does_not_fit_at_the_largest_input():
    with pytest.warns(UserWarning, match="may run out of memory"):
        planner, _ = prepared(1000)  # the largest block alone needs 2048
    assert planner.policy.static_plan == (0, 1, 2, 3, 4)
