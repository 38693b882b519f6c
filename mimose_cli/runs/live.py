"""What the user sees while training: a rich live table under a progress bar on a terminal, with
a panel of the run's figures so far under it, plain lines otherwise; setup lines before the first
step, and a line whenever the planner's phase changes (why the sheltered steps are slower).

Both are views of the same per-iteration ``StepRecord``s that go to metrics.jsonl.
"""

import os
import time
from collections import deque
from dataclasses import dataclass, field

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


@dataclass
class RunningFigures:
    """The run's figures so far, added up from its ``StepRecord``s (``add``): what the live panel
    and the plain lines show beside the step at hand. Plain data, so a test builds one from a few
    records."""

    last_peak_bytes: int | None = None
    """The latest micro-batch's peak (an out-of-memory one's: the bytes it reached)."""
    highest_peak_bytes: int | None = None
    """The highest peak of the micro-batches that completed."""
    lookups: int = 0
    """Micro-batches whose plan the planner looked up in its plan cache (``cache_hit`` not None)."""
    hits: int = 0
    planned_sizes: set = field(default_factory=set)
    """Input sizes planned on a miss: one cached plan each (the oracle's cache and Mimose's, whose key
    rounds a size up so that a size rounded to a cached key hits it). Counted from the records, so
    at most the planner's own count: Mimose empties its cache when it refits after measuring."""
    planner_ms: float | None = None
    """The planner's time deciding, in ms (None until a step records one)."""
    train_ms: float = 0.0
    """Training time of the completed micro-batches (``StepRecord.train_ms``), in ms."""
    completed: int = 0
    recompute_ms: float | None = None
    """Time spent recomputing in backward, in ms (None until a step records one)."""
    checkpointed_any: bool = False
    """Whether a step so far checkpointed (DTR: evicted) a block: recomputing applies."""
    retries: int = 0
    retried_steps: int = 0

    def add(self, record: StepRecord) -> None:
        """Count one micro-batch's record."""
        self.last_peak_bytes = (record.reached_bytes or record.peak_bytes) if record.oom else record.peak_bytes
        if not record.oom and record.peak_bytes is not None:
            self.highest_peak_bytes = max(self.highest_peak_bytes or 0, record.peak_bytes)
            self.train_ms += record.train_ms
            self.completed += 1
        if record.cache_hit is not None:
            self.lookups += 1
            self.hits += record.cache_hit
            if not record.cache_hit and record.input_size:
                self.planned_sizes.add(tuple(record.input_size))
        if record.planner_ms is not None:
            self.planner_ms = (self.planner_ms or 0.0) + record.planner_ms
        if record.recompute_ms is not None:
            self.recompute_ms = (self.recompute_ms or 0.0) + record.recompute_ms
        self.checkpointed_any |= record.blocks("checkpointed") > 0
        self.retries += record.retries
        self.retried_steps += record.retries > 0

    @property
    def hit_rate(self) -> float | None:
        """Share of the plan-cache lookups that hit; None for a planner without a cache."""
        return self.hits / self.lookups if self.lookups else None

    @property
    def overhead_iterations(self) -> float | None:
        """The planner's time so far in mean iterations (``planner_ms`` / mean ``train_ms``)."""
        if self.planner_ms is None or not self.train_ms:
            return None
        return self.planner_ms / (self.train_ms / self.completed)

    @property
    def recompute_share(self) -> float | None:
        """Share of the training time spent recomputing; None where nothing was checkpointed."""
        if self.recompute_ms is None or not self.checkpointed_any or not self.train_ms:
            return None
        return self.recompute_ms / self.train_ms


def _of_budget(num_bytes, budget_bytes) -> str:
    share = f" ({100 * num_bytes / budget_bytes:.0f}%)" if budget_bytes and num_bytes is not None else ""
    return format_bytes(num_bytes) + share


def _ms(ms: float) -> str:
    """Planner time: tenths of a ms below a second (a step's decision often takes less than one)."""
    return f"{ms:.1f} ms" if ms < 1000 else format_duration(ms)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def running_lines(figures: RunningFigures, budget_label: str, budget_bytes) -> list:
    """The panel's (label, text) lines; a figure that does not apply to the run is left out."""
    lines = [("memory", f"this step {_of_budget(figures.last_peak_bytes, budget_bytes)}, highest "
                        f"{_of_budget(figures.highest_peak_bytes, budget_bytes)} of budget {budget_label}")]
    if figures.hit_rate is not None:
        lines.append(("plan cache", f"{100 * figures.hit_rate:.0f}% hits ({figures.hits} of {figures.lookups}), "
                                    f"{_count(len(figures.planned_sizes), 'plan')} cached"))
    if figures.planner_ms is not None:
        iterations = figures.overhead_iterations
        in_iterations = f" = {iterations:.2f} iterations" if iterations is not None else ""
        lines.append(("planner", f"{_ms(figures.planner_ms)} deciding{in_iterations}"))
    if figures.recompute_share is not None:
        lines.append(("recompute", f"{100 * figures.recompute_share:.1f}% of training time "
                                   f"({format_duration(figures.recompute_ms)})"))
    retried = f" ({_count(figures.retried_steps, 'step')})" if figures.retries else ""
    lines.append(("retries", f"{figures.retries}{retried}"))
    return lines


def running_panel(figures: RunningFigures, budget_label: str, budget_bytes) -> Table:
    """The live view's panel under the step table: the run's figures so far."""
    panel = Table.grid(padding=(0, 2))
    panel.title, panel.title_justify = "so far", "left"
    panel.add_column(style="bold")
    panel.add_column()
    for label, text in running_lines(figures, budget_label, budget_bytes):
        panel.add_row(label, text)
    return panel


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
        self.figures = RunningFigures()
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
                     step_table(list(self.rows), self.budget_bytes, ""),
                     running_panel(self.figures, self.budget_label, self.budget_bytes))

    def timing(self) -> str:
        """Elapsed, ETA and rate as one phrase (the plain lines)."""
        task = self._progress.tasks[self._task]
        elapsed = format_duration(1e3 * (task.elapsed or 0.0))
        speed = task.finished_speed or task.speed
        eta = "-" if not speed else format_duration(1e3 * (task.total - task.completed) / speed)
        return f"elapsed {elapsed} ETA {eta} {_RateColumn().render(task)}"

    def update(self, record: StepRecord) -> None:
        self.rows.append(record)
        self.figures.add(record)
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
                f"ckpt {_blocks(record)} {_phase(record)}".rstrip() + self._hit_rate() + f" | {self.timing()}".rstrip())

    def _hit_rate(self) -> str:
        """The plain line's running hit rate, for a planner with a plan cache."""
        rate = self.figures.hit_rate
        return "" if rate is None else f" | hit rate {100 * rate:.0f}%"

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
