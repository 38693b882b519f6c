import pytest

from mimose_cli.planners.mimose.scheduler import Greedy, buckets_of, greedy_plan, greedy_plan_checked


def test_buckets_group_sizes_within_ten_percent_smallest_first():
    sizes = [10, 30, 31, 5, 29, 50]
    assert buckets_of(sizes) == [[3], [0], [1, 2, 4], [5]]


def test_greedy_takes_the_smallest_covering_block_else_the_largest_step_by_step():
    sizes = [10, 30, 31, 5, 29, 50]
    greedy = Greedy(sizes)
    assert greedy.take(75) == 5  # nothing covers 75: the largest
    assert greedy.take(25) == 1  # bucket {1, 2, 4} is the smallest that covers; 1 is earliest
    assert greedy.take(8) == 0  # 10 covers 8, 5 does not
    assert greedy.plan == [5, 1, 0]
    assert greedy_plan(sizes, 75) == (1, 5)  # 50 + 30 cover 75: the greedy stops there


def test_earlier_block_first_within_a_bucket_when_it_covers():
    assert greedy_plan([30.0, 29.6, 31.0], 29.5) == (0,)
    assert greedy_plan([29.0, 31.0, 30.0], 29.5) == (1,)  # block 0 is in the bucket but too small
    assert greedy_plan([10.0] * 4, 25) == (0, 1, 2)


def test_homogeneous_blocks_fill_from_the_front():
    assert greedy_plan([10.0] * 6, 45) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("excess", [0, -5])
def test_no_excess_gives_the_empty_plan(excess):
    assert greedy_plan([1.0, 2.0, 3.0], excess) == ()


def test_uncoverable_excess_takes_every_block():
    assert greedy_plan([1.0, 2.0, 3.0], 100) == (0, 1, 2)


def test_checked_variant_continues_until_the_predicted_peak_fits():
    sizes = [10.0] * 5
    # The predictor charges 5 more than the plain sum: the first greedy round (excess 20 -> two
    # blocks) is predicted over the limit, so the scheduler must add a third block.

    def predict(plan):
        return 100.0 - 10.0 * len(plan) + (5.0 if plan else 0.0)

    plan, peak, fits = greedy_plan_checked(sizes, predict, 80.0)
    assert plan == (0, 1, 2) and peak == 75.0 and fits


def test_checked_variant_reports_a_plan_that_cannot_fit():
    plan, peak, fits = greedy_plan_checked([1.0, 1.0], lambda plan: 50.0 - len(plan), 10.0)
    assert plan == (0, 1) and peak == 48.0 and not fits


def test_checked_variant_is_empty_when_everything_fits():
    assert greedy_plan_checked([5.0, 5.0], lambda plan: 10.0, 20.0) == ((), 10.0, True)


def test_checked_variant_leaves_out_blocks_the_plan_fits_without():
    # Each block really lowers the peak by 30, three times its 10 bytes: the greedy takes all
    # four for an excess of 55, and the re-check gives back the last two.
    plan, peak, fits = greedy_plan_checked([10.0] * 4, lambda plan: 100.0 - 30.0 * len(plan), 45.0)
    assert plan == (0, 1) and peak == 40.0 and fits


def test_checked_variant_never_takes_a_nan_peak_as_fitting():
    """As ``choice_plan_checked``: a peak that is not a number does not fit, before or after."""
    nan = float("nan")
    plan, peak, fits = greedy_plan_checked([5.0, 5.0], lambda plan: nan, 20.0)
    assert plan == (0, 1) and peak != peak and not fits
    # The re-check gives back block 3 (three blocks: 30), not block 2 as well (two blocks: NaN).
    peaks = {4: 20.0, 3: 30.0, 2: nan, 1: 40.0, 0: 100.0}
    plan, peak, fits = greedy_plan_checked([10.0] * 4, lambda plan: peaks[len(plan)], 45.0)
    assert plan == (0, 1, 2) and peak == 30.0 and fits
