import io

from rich.console import Console

from mimose_cli.live import ProgressView
from mimose_cli.records import StepRecord


def _record(step, oom=False):
    return StepRecord(step=step, input_shape=[4, 4, 70], loss=None if oom else 1.25, iter_ms=80.0,
                      peak_bytes=30 * 2**20, plan=[0, 1], num_blocks=4, phase="responsive",
                      cache_hit=True, predicted_peak_bytes=31 * 2**20, oom=oom)


def test_terminal_gets_a_live_table():
    out = io.StringIO()
    view = ProgressView("t", 40 * 2**20, 3, console=Console(file=out, force_terminal=True, width=120))
    assert view.mode == "live"
    view.update(_record(0))
    view.close()
    text = out.getvalue()
    assert "peak (of budget)" in text and "4x4x70" in text and "2/4" in text and "responsive hit" in text


def test_pipe_gets_plain_lines_every_log_every_steps_and_on_oom():
    out = io.StringIO()
    view = ProgressView("t", 40 * 2**20, 5, log_every=2, console=Console(file=out, width=200))
    assert view.mode == "plain"
    for step in range(3):
        view.update(_record(step))
    view.update(_record(3, oom=True))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["0/5", "2/5", "3/5"]
    assert "loss OOM" in lines[-1] and "(75%)" in lines[0]


def test_tables_are_not_cut_when_the_output_is_not_a_terminal(capsys):
    from mimose_cli.live import PLAIN_WIDTH, new_console

    console = new_console()  # pytest captures: not a terminal
    assert not console.is_terminal and console.width == PLAIN_WIDTH
