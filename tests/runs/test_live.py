import io

import pytest
from rich.console import Console

from mimose_cli.runs.live import ProgressView
from mimose_cli.runs.records import StepRecord


def _record(step, oom=False):
    return StepRecord(step=step, input_shape=[4, 4, 70], loss=None if oom else 1.25, iter_ms=80.0,
                      peak_bytes=30 * 2**20, plan=["recompute", "recompute", "keep", "keep"], num_blocks=4, phase="responsive",
                      cache_hit=True, predicted_peak_bytes=31 * 2**20, oom=oom)


def test_terminal_gets_a_live_table():
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, force_terminal=True, width=120))
    assert view.mode == "live"
    view.begin(3)
    view.update(_record(0))
    view.close()
    text = out.getvalue()
    assert "peak (of budget)" in text and "4x4x70" in text and "2/4" in text and "responsive hit" in text
    assert "budget 40MiB" in text and "1/3" in text and "ETA" in text


def test_pipe_gets_plain_lines_every_log_every_steps_and_on_oom():
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, log_every=2, console=Console(file=out, width=200))
    assert view.mode == "plain"
    view.begin(5)
    for step in range(3):
        view.update(_record(step))
    view.update(_record(3, oom=True))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["0/5", "2/5", "3/5"]
    assert "loss OOM" in lines[-1] and "(75%)" in lines[0]
    assert "ckpt 2/4 responsive hit |" in lines[0]


def test_a_plain_line_without_a_phase_has_single_spaces():
    """A planner without phases (the oracle) says hit or miss alone: one space after the blocks."""
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200))
    view.begin(2)
    record = _record(0)
    record.phase, record.cache_hit, record.retries = None, False, 1
    view.update(record)
    assert "ckpt 2/4 miss retried x1 |" in out.getvalue()


def test_each_micro_batch_line_says_which_it_is():
    """With gradient accumulation every micro-batch has a line: each says its place in the step."""
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200), micro_batches=2)
    view.begin(2)
    for step, micro in ((0, 0), (0, 1), (1, 0)):
        record = _record(step)
        record.micro_step = micro
        view.update(record)
    assert [line.split()[1:4] for line in out.getvalue().splitlines()] == [
        ["0/2", "micro", "1/2"], ["0/2", "micro", "2/2"], ["1/2", "micro", "1/2"]]


def test_tables_are_not_cut_when_the_output_is_not_a_terminal(capsys):
    from mimose_cli.runs.live import PLAIN_WIDTH, new_console

    console = new_console()  # pytest captures: not a terminal
    assert not console.is_terminal and console.width == PLAIN_WIDTH


def test_plain_lines_carry_elapsed_eta_and_rate():
    out = io.StringIO()
    clock = iter(float(t) for t in range(100))
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200))
    view._progress.get_time = lambda: next(clock)  # one second per call: a known rate
    view.begin(10)
    for step in range(4):
        view.update(_record(step))
    last = out.getvalue().splitlines()[-1]
    assert "elapsed" in last and "ETA" in last
    rate = float(last.split()[-2])
    assert last.endswith("s/step") and rate > 0
    eta = last.split("ETA ")[1].split(" s")[0]
    assert float(eta) == pytest.approx(6 * rate, rel=0.01)  # 6 steps left at the measured rate


def test_a_phase_change_is_explained_once():
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200))
    view.begin(4)
    for step, phase in enumerate(("sheltered", "sheltered", "responsive", "responsive")):
        record = _record(step)
        record.phase = phase
        view.update(record)
    notes = [line for line in out.getvalue().splitlines() if line.startswith("step ") and ":" in line.split()[1]]
    assert [n.split(":")[1].strip().split()[0] for n in notes] == ["sheltered", "responsive"]
    assert "slower" in notes[0] and notes[0].startswith("step 0:") and notes[1].startswith("step 2:")


def test_a_baseline_gets_no_phase_note():
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200))
    view.begin(2)
    view.update(_record(0))  # responsive from the first step: nothing to explain
    assert "planned from the fitted estimator" not in out.getvalue()


def test_a_reader_that_goes_away_quiets_the_view_not_the_run(tmp_path):
    import os

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write breaks the pipe
    from mimose_cli.runs.live import new_console

    console = new_console()
    console.file = os.fdopen(write, "w")
    view = ProgressView("t", "40MiB", 40 * 2**20, console=console, mode="plain")
    view.begin(2)
    view.update(_record(0))  # raised BrokenPipeError before: the loop took it for a failed write
    assert view.mode == "none"
    view.update(_record(1))
    view.message("after")  # quiet from now on


def test_the_blocks_column_counts_the_finer_choices():
    """A step's selective, partial and offloaded blocks beside the checkpointed (plain lines)."""
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200))
    view.begin(1)
    record = _record(0)
    record.plan = ["recompute", "selective", "partial1", "offload"]
    view.update(record)
    view.close()
    assert "3/4 (1 sel, 1 part, 1 off)" in out.getvalue()


def _figures(*records):
    from mimose_cli.runs.live import RunningFigures

    figures = RunningFigures()
    for record in records:
        figures.add(record)
    return figures


def _timed(step, *, peak_mib, hit, size, planner_ms=2.0, recompute_ms=0.0, iter_ms=100.0, retries=0,
           plan=("keep", "keep", "keep", "keep")):
    return StepRecord(step=step, input_shape=[4, 4, size], input_size=[16, size], loss=1.0, iter_ms=iter_ms,
                      peak_bytes=peak_mib * 2**20, plan=list(plan), num_blocks=4, planner_ms=planner_ms,
                      cache_hit=hit, recompute_ms=recompute_ms, retries=retries)


def test_the_running_figures_add_up_the_records():
    """Hit rate over the lookups, plans cached (sizes planned on a miss), the highest peak, the
    planner's time in mean iterations, the share recomputing and the retries."""
    ckpt = ("recompute", "keep", "keep", "keep")
    figures = _figures(_timed(0, peak_mib=30, hit=False, size=64, planner_ms=6.0, plan=ckpt, recompute_ms=10.0),
                       _timed(1, peak_mib=36, hit=True, size=64, iter_ms=300.0, retries=2),
                       _timed(2, peak_mib=20, hit=False, size=32),
                       _timed(3, peak_mib=25, hit=True, size=32, plan=ckpt, recompute_ms=30.0))
    assert (figures.hits, figures.lookups, figures.hit_rate) == (2, 4, 0.5)
    assert figures.planned_sizes == {(16, 64), (16, 32)}
    assert figures.last_peak_bytes == 25 * 2**20 and figures.highest_peak_bytes == 36 * 2**20
    assert figures.planner_ms == 12.0 and figures.overhead_iterations == pytest.approx(12.0 / 150.0)
    assert figures.recompute_share == pytest.approx(40.0 / 600.0)
    assert (figures.retries, figures.retried_steps) == (2, 1)


def test_the_panel_says_the_figures_and_leaves_out_what_does_not_apply():
    from mimose_cli.runs.live import running_lines

    mimose = dict(running_lines(_figures(_timed(0, peak_mib=30, hit=False, size=64, plan=("recompute",) * 4,
                                                recompute_ms=25.0),
                                         _timed(1, peak_mib=20, hit=True, size=64, retries=1)),
                                "40MiB", 40 * 2**20))
    assert mimose["memory"] == "this step 20.00 MiB (50%), highest 30.00 MiB (75%) of budget 40MiB"
    assert mimose["plan cache"] == "50% hits (1 of 2), 1 plan cached"
    assert mimose["planner"] == "4.0 ms deciding = 0.04 iterations"
    assert mimose["recompute"] == "12.5% of training time (25 ms)"
    assert mimose["retries"] == "1 (1 step)"
    # A planner without a cache that never checkpointed (none): no hit rate, nothing recomputed.
    plain = dict(running_lines(_figures(_timed(0, peak_mib=30, hit=None, size=64)), "unlimited", None))
    assert list(plain) == ["memory", "planner", "retries"]
    assert plain["memory"] == "this step 30.00 MiB, highest 30.00 MiB of budget unlimited"


def test_an_out_of_memory_step_is_this_steps_memory_not_the_highest():
    figures = _figures(_timed(0, peak_mib=30, hit=None, size=64),
                       StepRecord(step=1, oom=True, reached_bytes=41 * 2**20, peak_bytes=None, planner_ms=1.0))
    assert figures.last_peak_bytes == 41 * 2**20 and figures.highest_peak_bytes == 30 * 2**20
    assert figures.overhead_iterations == pytest.approx(3.0 / 100.0)  # the mean of the completed step


def test_the_live_view_shows_the_panel_under_the_table():
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, force_terminal=True, width=120))
    view.begin(2)
    view.update(_timed(0, peak_mib=30, hit=False, size=64))
    view.update(_timed(1, peak_mib=20, hit=True, size=64))
    view.close()
    text = out.getvalue()
    assert "so far" in text and "50% hits (1 of 2), 1 plan cached" in text
    assert text.rindex("so far") > text.rindex("peak (of budget)")


def test_plain_lines_carry_the_running_hit_rate_where_the_planner_has_a_cache():
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200))
    view.begin(4)
    for step, hit in enumerate((False, True, True, True)):
        view.update(_timed(step, peak_mib=30, hit=hit, size=64))
    rates = [line.split("| hit rate ")[1].split()[0] for line in out.getvalue().splitlines()]
    assert rates == ["0%", "50%", "67%", "75%"]
    out = io.StringIO()
    view = ProgressView("t", "40MiB", 40 * 2**20, console=Console(file=out, width=200))
    view.begin(1)
    view.update(_timed(0, peak_mib=30, hit=None, size=64))
    assert "hit rate" not in out.getvalue()
