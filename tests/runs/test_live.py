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
