"""Oracle: the least-recompute plan that fits, from measurements at each input size."""

import itertools
import random

import torch
from torch import nn

from mimose_cli.memory import build_meter
from mimose_cli.planners import build_planner
from mimose_cli.planners.oracle import exact_plan, knapsack_plan, min_cost_cover
from mimose_cli.planners.profile import BlockProfile


def brute_force(profile, limit):
    n = len(profile.act_bytes)
    fitting = [plan for k in range(n + 1) for plan in itertools.combinations(range(n), k)
               if profile.peak_bytes(plan) <= limit]
    return min((profile.recompute_ms(p), len(p)) for p in fitting) if fitting else None


def test_exact_search_matches_brute_force():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(2, 7)
        profile = BlockProfile((1, 1), [rng.randint(1, 100) for _ in range(n)],
                               [rng.uniform(0.5, 3.0) for _ in range(n)], fixed_bytes=rng.randint(0, 50))
        limit = rng.randint(50, 300)
        best = brute_force(profile, limit)
        plan = exact_plan(profile, limit)
        if best is None:
            assert plan == tuple(range(n))
        else:
            assert profile.peak_bytes(plan) <= limit
            assert abs(profile.recompute_ms(plan) - best[0]) < 1e-9


def test_knapsack_fits_and_is_exact_on_its_bound():
    rng = random.Random(1)
    for _ in range(20):
        n = rng.randint(3, 8)
        act = [rng.randint(10, 100) for _ in range(n)]
        ms = [rng.uniform(0.5, 3.0) for _ in range(n)]
        profile = BlockProfile((1, 1), act, ms)
        limit = rng.randint(sum(act) // 3, sum(act))

        def bound(plan):  # kept activations + the largest recomputed block
            return sum(a for i, a in enumerate(act) if i not in plan) + max((act[i] for i in plan), default=0)

        plan = knapsack_plan(profile, limit)
        fitting = [p for k in range(1, n + 1) for p in itertools.combinations(range(n), k) if bound(p) <= limit]
        if fitting:
            assert bound(plan) <= limit and profile.peak_bytes(plan) <= limit
            assert profile.recompute_ms(plan) <= min(profile.recompute_ms(p) for p in fitting) + 1e-9


def test_min_cost_cover():
    assert min_cost_cover([5, 4, 3], [5.0, 1.0, 1.0], 6.5) == (2.0, (1, 2))
    assert min_cost_cover([5, 4, 3], [5.0, 1.5, 1.0], 7.5) == (6.0, (0, 2))
    assert min_cost_cover([1, 1], [1.0, 1.0], 3) is None
    assert min_cost_cover([1], [1.0], 0) == (0.0, ())


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(8, width), nn.Linear(width, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_plans_per_input_size_from_measurements():
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(w) for w in (16, 64, 16, 64)])
    planner = build_planner("oracle", model, 4000)  # no meter: the budget covers activations
    infos = []
    for rows in (8, 2, 8):
        x = torch.randn(rows, 8)
        with planner.step(x) as info:
            model(x).sum().backward()
        infos.append(info)
    big, small, again = infos
    # rows=8 holds [512, 2048, 512, 2048] = 5120 > 4000: block 1 alone frees its bytes at the peak
    assert planner.profiles[(8, 8)].act_bytes == [512, 2048, 512, 2048]
    assert big.plan == (1,) and big.predicted_peak_bytes == 3072
    assert small.plan == () and small.cache_hit is False
    assert again.cache_hit is True and again.plan == big.plan
    assert all(i.extra["excluded_ms"] > 0 for i in infos)


def test_the_calibrated_model_predicts_the_simulated_peak():
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(256) for _ in range(5)])
    x = torch.randn(64, 8)
    meter = build_meter("simulated", None)
    planner = build_planner("oracle", model, None, meter=meter)
    with meter.activate():
        meter.track(model, x)
        with meter.step() as free, planner.step(x):
            model(x).sum().backward()
    budget = int(free.peak_bytes * 0.75)
    for p in model.parameters():
        p.grad = None
    meter = build_meter("simulated", budget)
    planner = build_planner("oracle", model, budget, meter=meter)
    with meter.activate():
        meter.track(model, x)
        with meter.step() as mem, planner.step(x) as info:
            model(x).sum().backward()
    assert info.plan and mem.peak_bytes <= budget
    assert abs(mem.peak_bytes - info.predicted_peak_bytes) <= 0.02 * budget
