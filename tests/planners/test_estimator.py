import numpy as np
import pytest

from mimose_cli.planners.mimose.estimator import (
    BLOCK_QUANTITIES,
    STEP_QUANTITIES,
    Estimator,
    Prediction,
    Timeline,
    features,
    peak_timeline,
    plan_peak_bytes,
    select_features,
)


def _sample(num_blocks, value):
    """A sample where every quantity of every block is ``value`` (a float or an op array)."""
    one = np.atleast_1d(np.asarray(value, dtype=float))
    return ({q: [one.copy() for _ in range(num_blocks)] for q in BLOCK_QUANTITIES},
            {q: one.copy() for q in STEP_QUANTITIES})


def _fitted(sizes, mem):
    est = Estimator(2)
    for size in sizes:
        est.add(size, *_sample(2, mem(*size)))
    est.fit()
    return est


def quadratic(batch, length):
    return 3.0 * batch * length ** 2 + 700.0 * batch * length + 4096.0


def test_recovers_known_quadratic_coefficients_at_unseen_lengths():
    est = _fitted([(8, length) for length in (16, 40, 64, 100, 128)], quadratic)
    for length in (24, 200, 512):
        assert est.predict((8, length)).blocks["saved_bytes"][0] == pytest.approx(quadratic(8, length), rel=1e-9)


def test_extrapolates_across_batch_sizes_when_the_batch_varied():
    sizes = [(8, 16), (8, 64), (4, 100), (16, 32), (8, 128), (12, 80), (4, 20)]
    est = _fitted(sizes, quadratic)
    for size in [(32, 256), (1, 500), (64, 16)]:
        assert est.predict(size).step["pre_bytes"] == pytest.approx(quadratic(*size), rel=1e-9)


def test_a_constant_batch_size_fits_memory_proportional_to_the_batch():
    est = _fitted([(8, length) for length in (16, 40, 64, 100, 128)],
                  lambda b, length: 5.0 * b * length ** 2 + 300.0 * b * length)
    assert select_features(np.stack([features((8, n)) for n in (16, 40, 64)]), ("BL2", "BL", "1", "B", "L2", "L")) == [0, 1, 2]
    assert est.predict((16, 90)).blocks["plain_bytes"][1] == pytest.approx(5.0 * 16 * 90 ** 2 + 300.0 * 16 * 90)


def test_a_peak_is_the_max_over_its_ops_each_fitted_on_its_own():
    est = Estimator(1)
    for length in (8, 16, 24, 48, 64, 96):
        # op 0 grows linearly, op 1 quadratically: the peak switches from one to the other.
        est.add((4, length), *_sample(1, [1000.0 * 4 * length, 2.0 * 4 * length ** 2]))
    est.fit()
    for length in (10, 500, 2000):
        expected = max(1000.0 * 4 * length, 2.0 * 4 * length ** 2)
        assert est.predict((4, length)).blocks["bwd_peak_bytes"][0] == pytest.approx(expected, rel=1e-9)


def test_dropped_samples_are_left_out_of_the_fit():
    # The data filter dropped block 0 at length 16 and block 1 at length 32: each block keeps the
    # three lengths that determine B·L², B·L and 1, so its fit is exact only if a dropped value is
    # left out and the rest of its sample kept.
    est = Estimator(2)
    for length in (16, 32, 48, 64):
        blocks, step = _sample(2, quadratic(2, length))
        if length in (16, 32):
            blocks["saved_bytes"][length // 32] = None
        est.add((2, length), blocks, step)
    est.fit()
    saved = est.predict((2, 300)).blocks["saved_bytes"]
    assert saved == pytest.approx([quadratic(2, 300)] * 2, rel=1e-9)


def test_a_stretch_measured_with_another_op_count_is_left_out_of_the_fit():
    # Another kernel ran at length 32: block 0's stretch has two ops where the others have one.
    # Fitted in any way, their 1e12 bytes would ruin the quadratic.
    est = Estimator(2)
    for length in (16, 32, 48, 64, 80):
        blocks, step = _sample(2, quadratic(2, length))
        if length == 32:
            blocks["saved_bytes"][0] = np.array([1e12, 1e12])
        est.add((2, length), blocks, step)
    est.fit()
    saved = est.predict((2, 300)).blocks["saved_bytes"]
    assert saved == pytest.approx([quadratic(2, 300)] * 2, rel=1e-9)


def test_a_block_never_measured_borrows_its_nearest_measured_neighbour():
    est = Estimator(3)
    for length in (16, 32, 64, 128):
        blocks, step = _sample(3, quadratic(1, length))
        blocks["plain_bytes"][2] = None
        est.add((1, length), blocks, step)
    est.fit()
    pred = est.predict((1, 256)).blocks["plain_bytes"]
    assert pred[2] == pytest.approx(pred[1]) and pred[1] == pytest.approx(quadratic(1, 256))


def test_state_dict_round_trip_predicts_the_same():
    est = _fitted([(8, 16), (8, 64), (4, 100), (16, 32), (8, 128)], quadratic)
    again = Estimator(2)
    again.load_state_dict(est.state_dict())
    a, b = est.predict((5, 77)), again.predict((5, 77))
    assert all(np.array_equal(a.blocks[q], b.blocks[q]) for q in BLOCK_QUANTITIES)
    with pytest.raises(ValueError, match="blocks"):
        Estimator(3).load_state_dict(est.state_dict())


def test_peak_timeline_checkpointing_the_first_block_lowers_the_forward_end_peak():
    est = Estimator(2)
    for length in (8, 16, 32, 64):
        blocks, step = _sample(2, 0.0)
        blocks["plain_bytes"] = [np.array([100.0 * length])] * 2
        blocks["ckpt_bytes"] = [np.array([10.0 * length])] * 2
        blocks["bwd_peak_bytes"] = [np.array([150.0 * length])] * 2
        step["head_peak_bytes"] = np.array([5.0 * length])
        est.add((1, length), blocks, step)
    est.fit()
    pred = est.predict((1, 10))
    none = peak_timeline(pred, np.array([False, False])).max()
    first = peak_timeline(pred, np.array([True, False])).max()
    last = peak_timeline(pred, np.array([False, True])).max()
    assert none == pytest.approx(1000 + 1500)  # block 1's backward above block 0's activations
    assert first == pytest.approx(100 + 1500)  # block 1's backward above block 0's checkpoint
    assert last == pytest.approx(none)  # the last block's recompute brings its bytes back


def test_the_timeline_of_blocks_run_out_of_index_order_is_that_of_the_blocks_stored_in_it():
    """Blocks whose forward order is shuffled (some letting inputs go) give the same events as
    the same blocks stored in that order, for a batch of plans with selective blocks; exact: the
    same float64 operations in the same order."""
    rng = np.random.default_rng(1)
    n, order = 7, np.array([3, 0, 6, 1, 5, 2, 4])
    blocks = {q: rng.integers(0, 100, n).astype(float) for q in BLOCK_QUANTITIES}
    step = {q: float(rng.integers(0, 100)) for q in STEP_QUANTITIES}
    consumers = rng.random((n, n)) < 0.2
    shuffled = Prediction((1, 1), blocks, step, tuple(order.tolist()), True, consumers)
    stored = Prediction((1, 1), {q: v[order] for q, v in blocks.items()}, step, None, True,
                        consumers[np.ix_(order, order)])
    plans = rng.random((16, n)) < 0.5
    selective = plans & (rng.random((16, n)) < 0.5)
    assert np.array_equal(peak_timeline(shuffled, plans, selective),
                          peak_timeline(stored, plans[:, order], selective[:, order]))


def test_a_plans_peak_does_not_depend_on_the_plans_predicted_with_it():
    """A scheduler predicts a pass's plans in batches (``choices._each_that_fits``) and a plan alone
    elsewhere (``plan_peak_bytes``): each plan's events and peak are the same either way, on
    non-integer bytes, shuffled blocks letting inputs go, backward in or out of order. Exact: the
    batch runs the same float64 operations in the same order per plan (the inputs let go of are
    summed over rows, not by a matrix product whose BLAS kernel differs with the batch)."""
    rng = np.random.default_rng(2)
    for trial in range(20):
        n = int(rng.integers(2, 64))
        blocks = {q: rng.uniform(0, 1e6, n) for q in BLOCK_QUANTITIES}
        step = {q: float(rng.uniform(0, 1e6)) for q in STEP_QUANTITIES}
        pred = Prediction((1, 1), blocks, step, tuple(rng.permutation(n).tolist()), bool(trial % 3),
                          rng.random((n, n)) < 0.3)
        plans = rng.random((32, n)) < 0.5
        selective = plans & (rng.random((32, n)) < 0.5)
        timeline = Timeline(pred)
        events, peaks = timeline.events(plans, selective), timeline.peaks(plans, selective)
        assert np.array_equal(peaks, events.max(axis=-1))
        assert np.array_equal(timeline.level_peaks(Timeline.levels(plans, selective)), peaks)
        for k in range(len(plans)):
            assert np.array_equal(peak_timeline(pred, plans[k], selective[k]), events[k]), trial
            plan = tuple("selective" if s else "recompute" if p else "keep" for p, s in zip(plans[k], selective[k]))
            assert plan_peak_bytes(pred, plan) == peaks[k], trial


def test_the_timeline_of_a_selective_block_and_an_input_let_go_of_worked_by_hand():
    """Two blocks: block 0 selective holds its checkpoint plus the kept outputs (10 + 30) and
    peaks at its selective forward (50) and backward (210); recomputed, at its checkpointed
    forward (20) and the larger of backward and recompute (200). Block 1 run plainly lets go of 7
    bytes of its input once it returns (off its backward's base too); checkpointed, it keeps them."""
    blocks = {q: np.zeros(2) for q in BLOCK_QUANTITIES}
    blocks.update(plain_bytes=np.array([100.0, 50.0]), ckpt_bytes=np.array([10.0, 5.0]),
                  selective_extra_bytes=np.array([30.0, 0.0]), fwd_peak_bytes=np.array([120.0, 60.0]),
                  ckpt_fwd_peak_bytes=np.array([20.0, 8.0]), selective_fwd_peak_bytes=np.array([50.0, 0.0]),
                  bwd_peak_bytes=np.array([200.0, 100.0]), selective_bwd_peak_bytes=np.array([210.0, 0.0]),
                  recompute_peak_bytes=np.array([130.0, 70.0]), selective_recompute_peak_bytes=np.array([40.0, 0.0]),
                  release_bytes=np.array([0.0, 7.0]))
    pred = Prediction((1, 1), blocks, {q: 0.0 for q in STEP_QUANTITIES},
                      releases=np.array([[False, False], [False, True]]))
    plans = np.array([[True, False], [True, False], [False, True]])
    selective = np.array([[True, False], [False, False], [False, False]])
    # pre, forward 0 and 1, head, backward 0 and 1, tail
    assert peak_timeline(pred, plans, selective).tolist() == [[0, 50, 100, 83, 210, 133, 0],
                                                                [0, 20, 70, 53, 200, 103, 0],
                                                                [0, 120, 108, 105, 200, 200, 0]]
    assert Timeline(pred).level_peaks(np.array([[1, 0], [2, 0], [0, 2]])).tolist() == [210, 200, 200]
