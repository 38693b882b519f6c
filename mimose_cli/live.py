"""What the user sees while training: a rich live table on a terminal, plain lines otherwise.

Both are views of the same per-iteration ``StepRecord``s that go to metrics.jsonl.
"""

from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mimose_cli.records import StepRecord
from mimose_cli.units import format_bytes

ROWS_SHOWN = 12
PLAIN_WIDTH = 200


def new_console() -> Console:
    """A console for tables: the terminal's width, or when the output is a file or a pipe (a log,
    ``| tee``) wide enough that no cell is cut (rich assumes 80 columns there)."""
    console = Console()
    return console if console.is_terminal else Console(width=PLAIN_WIDTH)
VIEWS = ("auto", "live", "plain", "none")


def check_view(view: str) -> None:
    """Raise ValueError unless ``view`` is one of ``VIEWS`` (checked before a run starts)."""
    if view not in VIEWS:
        raise ValueError(f"view={view!r} is invalid; expected one of {', '.join(VIEWS)}")


def _shape(record: StepRecord) -> str:
    return "x".join(str(d) for d in record.input_shape or [])


def _blocks(record: StepRecord) -> str:
    return f"{len(record.plan)}/{'?' if record.num_blocks is None else record.num_blocks}"


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
    return ((record.phase or "") + ("" if hit is None else (" hit" if hit else " miss"))
            + (f" retried x{retries}" if retries else ""))


def step_table(records: list[StepRecord], budget_bytes, title: str) -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    for name in ("step", "input", "loss", "ms/iter", "peak (of budget)", "predicted", "ckpt", "phase"):
        table.add_column(name, justify="right" if name not in ("input", "phase") else "left")
    for r in records:
        predicted = r.predicted_peak_bytes
        table.add_row(
            str(r.step), _shape(r), _loss(r), f"{r.iter_ms:.0f}",
            _peak(r, budget_bytes), format_bytes(predicted) if predicted else "-",
            _blocks(r), _phase(r),
        )
    return table


class ProgressView:
    """Live table on a terminal, a plain line every ``log_every`` steps otherwise."""

    def __init__(self, title: str, budget_bytes, total_steps, log_every=1, mode="auto", console=None):
        check_view(mode)
        self.console = console or new_console()
        self.mode = ("live" if self.console.is_terminal else "plain") if mode == "auto" else mode
        self.title, self.budget_bytes, self.total_steps = title, budget_bytes, total_steps
        self.log_every = log_every
        self.rows = deque(maxlen=ROWS_SHOWN)
        self._live = None
        if self.mode == "live":
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.start()

    def _render(self):
        done = self.rows[-1].step + 1 if self.rows else 0
        header = Text(f"{self.title}  step {done}/{self.total_steps}  budget {format_bytes(self.budget_bytes)}")
        return Group(header, step_table(list(self.rows), self.budget_bytes, ""))

    def update(self, record: StepRecord) -> None:
        self.rows.append(record)
        if self.mode == "live":
            self._live.update(self._render())
        elif self.mode == "plain" and (record.step % self.log_every == 0 or record.oom):
            self.console.print(
                f"step {record.step}/{self.total_steps} input {_shape(record)} loss {_loss(record)} "
                f"{record.iter_ms:.0f} ms peak {_peak(record, self.budget_bytes)} "
                f"ckpt {_blocks(record)} {_phase(record)}".rstrip(),
                highlight=False, soft_wrap=True,
            )

    def message(self, text: str) -> None:
        if self.mode != "none":
            self.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
