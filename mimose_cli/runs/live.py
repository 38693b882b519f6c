"""What the user sees while training: a rich live table under a progress bar on a terminal,
plain lines otherwise; setup lines before the first step, and a line whenever the planner's phase
changes (why the sheltered steps are slower).

Both are views of the same per-iteration ``StepRecord``s that go to metrics.jsonl.
"""

import os
import time
from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from mimose_cli.runs.records import StepRecord
from mimose_cli.units import format_bytes, format_duration

ROWS_SHOWN = 12
PLAIN_WIDTH = 200


def silence(stream) -> None:
    """Send what is still written to ``stream`` to /dev/null: its reader went away (``| head``, a
    killed ``tee``), and Python would otherwise fail again flushing it at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (``| head``): raise it for the command's boundary to end quietly
        (rich would exit 1, the code of a failure)."""
        raise BrokenPipeError


def new_console() -> Console:
    """A console for tables: the terminal's width, or when the output is a file or a pipe (a log,
    ``| tee``) wide enough that no cell is cut (rich assumes 80 columns there)."""
    console = _Console()
    return console if console.is_terminal else _Console(width=PLAIN_WIDTH)


VIEWS = ("auto", "live", "plain", "none")


def check_view(view: str, flag: str | None = None) -> None:
    """Raise ValueError unless ``view`` is one of ``VIEWS`` (checked before a run starts); the
    error names ``flag`` (a command's ``--view``) when given, else the argument."""
    if view not in VIEWS:
        given = f"{flag} {view!r}" if flag else f"view={view!r}"
        raise ValueError(f"{given} is invalid; expected one of {', '.join(VIEWS)}")


def _shape(record: StepRecord) -> str:
    return "x".join(str(d) for d in record.input_shape or [])


def _blocks(record: StepRecord) -> str:
    parts = [f"{record.blocks(kind)} {label}" for kind, label in (("selective", "sel"), ("partial", "part"),
                                                                  ("offload", "off")) if record.blocks(kind)]
    extra = f" ({', '.join(parts)})" if parts else ""
    return f"{record.blocks('checkpointed')}/{'?' if record.num_blocks is None else record.num_blocks}{extra}"


def _peak(record: StepRecord, budget_bytes) -> str:
    peak = record.peak_bytes
    where = "" if record.rank is None else f" rank {record.rank}"  # a multi-process run's worst rank
    if budget_bytes:
        return f"{format_bytes(peak)} ({100 * peak / budget_bytes:.0f}%){where}" if peak is not None else "-"
    return format_bytes(peak) + where


def _loss(record: StepRecord) -> str:
    return "OOM" if record.oom else ("-" if record.loss is None else f"{record.loss:.4f}")


def _phase(record: StepRecord) -> str:
    hit, retries = record.cache_hit, record.retries
    words = (record.phase, None if hit is None else ("hit" if hit else "miss"),
             f"retried x{retries}" if retries else None)
    return " ".join(word for word in words if word)


def step_table(records: list[StepRecord], budget_bytes, title: str) -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    for name in ("step", "input", "loss", "time", "peak (of budget)", "predicted", "ckpt", "phase"):
        table.add_column(name, justify="right" if name not in ("input", "phase") else "left")
    for r in records:
        predicted = r.predicted_peak_bytes
        table.add_row(
            str(r.step), _shape(r), _loss(r), format_duration(r.iter_ms),
            _peak(r, budget_bytes), format_bytes(predicted) if predicted else "-",
            _blocks(r), _phase(r),
        )
    return table


PHASE_NOTES = {
    "sheltered": "sheltered phase: every block is checkpointed and measured once per step to fit the "
                 "memory estimator, so these steps are slower than the ones after",
    "measuring": "measuring: a batch size the estimator has not seen runs as in the sheltered phase (slower)",
    "untrusted": "untrusted: the estimator cannot vouch for this input size, so every block is checkpointed",
    "recovery": "recovery: a step ran out of memory; this size now checkpoints more",
    "responsive": "responsive: each batch is planned from the fitted estimator",
}
"""Why a phase looks as it does, printed when a run enters it (``responsive`` only after another)."""


class _RateColumn(ProgressColumn):
    """Steps per second, or seconds per step when a step takes longer than a second."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed:
            return Text("")
        return Text(f"{speed:.2f} steps/s" if speed >= 1 else f"{1 / speed:.2f} s/step")


class ProgressView:
    """A progress bar (elapsed, ETA, steps/s) over the live table on a terminal, a plain line every
    ``log_every`` steps otherwise. Lines printed before ``begin`` (``setup``) say what the run is
    building; ``begin(total_steps)`` starts the clock at the first step."""

    def __init__(self, title: str, budget_label: str, budget_bytes, log_every=1, mode="auto", console=None,
                 micro_batches: int = 1):
        check_view(mode)
        self.console = console or new_console()
        self.mode = ("live" if self.console.is_terminal else "plain") if mode == "auto" else mode
        self.title, self.budget_label, self.budget_bytes = title, budget_label, budget_bytes
        self.log_every = log_every
        self.micro_batches = micro_batches
        """Micro-batches per step (gradient accumulation): each has a line, which says which."""
        self.rows = deque(maxlen=ROWS_SHOWN)
        self.total_steps = None
        self._phase = None
        self._created = time.perf_counter()
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), _RateColumn(),
                                  console=self.console, auto_refresh=False)
        self._task = None
        self._live = None

    def setup(self, text: str) -> None:
        """A setup line, with the seconds since the command started."""
        self.message(f"[{time.perf_counter() - self._created:5.1f} s] {text}")

    def begin(self, total_steps: int, done: int = 0) -> None:
        """Training starts: ``done`` of ``total_steps`` steps are behind (a resumed run)."""
        self.total_steps = total_steps
        self._task = self._progress.add_task("steps", total=total_steps, completed=done)
        if self.mode == "live":
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.start()

    def _render(self):
        header = Text(f"{self.title}  budget {self.budget_label}")
        return Group(header, self._progress.get_renderable(),
                     step_table(list(self.rows), self.budget_bytes, ""))

    def timing(self) -> str:
        """Elapsed, ETA and rate as one phrase (the plain lines)."""
        task = self._progress.tasks[self._task]
        elapsed = format_duration(1e3 * (task.elapsed or 0.0))
        speed = task.finished_speed or task.speed
        eta = "-" if not speed else format_duration(1e3 * (task.total - task.completed) / speed)
        return f"elapsed {elapsed} ETA {eta} {_RateColumn().render(task)}"

    def update(self, record: StepRecord) -> None:
        self.rows.append(record)
        self._progress.update(self._task, completed=record.step + 1)
        if record.phase != self._phase:
            note = PHASE_NOTES.get(record.phase) if record.phase != "responsive" or self._phase else None
            self._phase = record.phase
            if note:
                self.message(f"step {record.step}: {note}")
        if self.mode == "live":
            self._live.update(self._render())
        elif self.mode == "plain" and (record.step % self.log_every == 0 or record.oom):
            self.message(
                f"step {record.step}/{self.total_steps}{self._micro(record)} input {_shape(record)} "
                f"loss {_loss(record)} "
                f"{format_duration(record.iter_ms)} peak {_peak(record, self.budget_bytes)} "
                f"ckpt {_blocks(record)} {_phase(record)}".rstrip() + f" | {self.timing()}".rstrip())

    def _micro(self, record: StepRecord) -> str:
        return f" micro {record.micro_step + 1}/{self.micro_batches}" if self.micro_batches > 1 else ""

    def message(self, text: str) -> None:
        if self.mode == "none":
            return
        try:
            self.console.print(text, highlight=False, soft_wrap=True)
        except BrokenPipeError:
            # The reader went away (`| head`, a killed `tee`): the run goes on, its record is the
            # run directory; the view goes quiet instead of ending the run as a failed write.
            silence(self.console.file)
            self.mode = "none"

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
