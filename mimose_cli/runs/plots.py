"""PNG plots of a run or compare directory (``mimose report``): views of its files, like the tables.

Only matplotlib's object-oriented API is used (a ``Figure`` on its own Agg canvas, never pyplot),
so plotting needs no display and leaves the user's backend and pyplot's figures alone. Each
``*_figure`` function returns its Figure (tests read the axes); ``write_plots`` saves them as
PNGs and says which it could not draw, and why.
"""

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mimose_cli.files import read_json, refuse_dangling_link
from mimose_cli.planners import blocks
from mimose_cli.planners.mimose.estimator import Estimator
from mimose_cli.planners.mimose.features import SEQ2SEQ, TOKENS
from mimose_cli.runs.compare import COMPARE_FILE
from mimose_cli.runs.rundir import load_run
from mimose_cli.units import format_budget, format_bytes

PLOTS_DIR = "plots"
DPI = 100
WIDE = (8.0, 4.5)
PHASE_COLOURS = {"sheltered": "tab:orange", "measuring": "tab:purple", "untrusted": "tab:brown",
                 "recovery": "tab:red"}
"""Phases shaded on the memory plot; steps of any other phase (responsive) are not shaded."""
CHECKPOINTED, PARTIAL, SELECTIVE, OFFLOADED, PLAIN = "tab:blue", "tab:purple", "#9ecae1", "tab:orange", "#ececec"


def new_figure(rows: int = 1, cols: int = 1, size=WIDE, **subplots) -> tuple:
    """(figure, axes) on an Agg canvas of its own; ``axes`` as ``Figure.subplots`` returns them."""
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, **subplots)


def _legend(ax, **options) -> None:
    """The axes' legend, when something on them has a label (matplotlib warns otherwise)."""
    if ax.get_legend_handles_labels()[0] or "handles" in options:
        ax.legend(**options)


def byte_unit(values) -> tuple:
    """(divisor, name) to show byte figures up to the largest of ``values`` in: KiB, MiB or GiB."""
    largest = max((v for v in values if v is not None), default=0)
    for divisor, name in ((2**30, "GiB"), (2**20, "MiB")):
        if largest >= 2 * divisor:
            return divisor, name
    return 2**10, "KiB"


def _step_axis(records) -> str:
    """The x axis of per-record plots: optimizer steps, or micro-batches under accumulation."""
    return "micro-batch" if any(r.micro_step for r in records) else "step"


def _phase_spans(records) -> list:
    """(phase, first index, last index) of each stretch of steps in one shaded phase."""
    spans = []
    for index, record in enumerate(records):
        if record.phase not in PHASE_COLOURS:
            continue
        if spans and spans[-1][0] == record.phase and spans[-1][2] == index - 1:
            spans[-1][2] = index
        else:
            spans.append([record.phase, index, index])
    return spans


def memory_figure(records, budget_bytes=None, title: str = "memory per step", budget: str | None = None) -> Figure:
    """Measured peaks per step (whole step, and forward + backward: what a planner plans for), the
    planner's prediction, the budget; non-responsive phases shaded, retries and OOM marked."""
    fig, ax = new_figure()
    divisor, unit = byte_unit([budget_bytes] + [r.peak_bytes for r in records]
                              + [r.predicted_peak_bytes for r in records] + [r.reached_bytes for r in records])
    done = [(i, r) for i, r in enumerate(records) if not r.oom]
    seen = set()
    for phase, first, last in _phase_spans(records):
        ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLOURS[phase], alpha=0.15, linewidth=0,
                   label=None if phase in seen else f"{phase} steps")
        seen.add(phase)
    ax.plot([i for i, _ in done], [r.peak_bytes / divisor for _, r in done], marker=".",
            label="measured peak (whole step)")
    ax.plot([i for i, _ in done], [(r.fwd_bwd_peak_bytes or r.peak_bytes) / divisor for _, r in done],
            linestyle="--", linewidth=1, label="measured peak (forward + backward)")
    predicted = [(i, r.predicted_peak_bytes) for i, r in enumerate(records) if r.predicted_peak_bytes is not None]
    if predicted:
        ax.scatter(*zip(*[(i, p / divisor) for i, p in predicted]), marker="x", color="tab:green", zorder=3,
                   label="predicted peak (forward + backward)")
    retried = [(i, r.peak_bytes) for i, r in done if r.retries]
    if retried:
        ax.scatter(*zip(*[(i, p / divisor) for i, p in retried]), marker="^", color="tab:orange", zorder=4,
                   label="retried after out of memory")
    oom = [(i, r.reached_bytes or r.peak_bytes or budget_bytes or 0) for i, r in enumerate(records) if r.oom]
    if oom:
        ax.scatter(*zip(*[(i, b / divisor) for i, b in oom]), marker="X", s=80, color="red", zorder=5,
                   label="out of memory (bytes reached)")
    if budget_bytes:
        ax.axhline(budget_bytes / divisor, color="red", linestyle=":", label=f"budget {format_budget(budget, budget_bytes)}")
    ax.set_ylim(bottom=0)
    ax.set_xlabel(_step_axis(records))
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title)
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return fig


def input_size_figure(records, title: str = "input size per step") -> Figure:
    """The planner's input size per step: its lengths (top) and B × L, the tokens of the batch
    (bottom; L the product of the lengths, as the estimator's features take it)."""
    fig, (top, bottom) = new_figure(2, 1, sharex=True)
    sized = [(i, r.input_size) for i, r in enumerate(records) if r.input_size]
    dims = max((len(s) for _, s in sized), default=2) - 1
    for dim in range(dims):
        points = [(i, s[dim + 1]) for i, s in sized if len(s) > dim + 1]
        top.plot(*zip(*points), marker=".", label="L" if dims == 1 else f"length {dim + 1}")
    top.plot(*zip(*[(i, s[0]) for i, s in sized]), marker=".", linestyle=":", label="B (batch)")
    bottom.plot(*zip(*[(i, math.prod(s)) for i, s in sized]), marker=".", color="tab:green", label="B × L")
    for i, record in enumerate(records):
        if record.oom:
            bottom.axvline(i, color="red", linestyle=":", label="out of memory")
    top.set_ylabel("size (tokens)")
    bottom.set_ylabel("tokens per batch (B × L)")
    bottom.set_xlabel(_step_axis(records))
    top.set_title(title)
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        _legend(ax, fontsize="small")
    return fig


def _plan_choices(what: str) -> tuple:
    """The heat map's choices, its shade the index: (choices of ``blocks.CHOICES``, colour, legend
    label). ``what`` a recomputed block is: checkpointed (recomputed whole), DTR's evicted."""
    recomputed = f"{what} (recomputed whole)" if what == "checkpointed" else what
    return (((blocks.KEEP,), PLAIN, "kept (run plainly)"),
            ((blocks.OFFLOAD,), OFFLOADED, "offloaded to host memory"),
            ((blocks.SELECTIVE,), SELECTIVE, "checkpointed selectively"),
            (blocks.PARTIAL_LEVELS, PARTIAL, "checkpointed partially"),
            ((blocks.RECOMPUTE,), CHECKPOINTED, recomputed))


_LEGEND_ORDER = (0, 2, 3, 4, 1)
"""The legend's order of the shades: from the block kept to the blocks freed whole."""


def plan_grid(records, num_blocks: int) -> np.ma.MaskedArray:
    """The plans as (block, step) shades, an index into ``_plan_choices``; masked where a step has
    no choice for the block (it ran out of memory before any plan)."""
    shade = {choice: index for index, (choices, _, _) in enumerate(_plan_choices("checkpointed")) for choice in choices}
    grid = np.full((num_blocks, len(records)), np.nan)
    for i, record in enumerate(records):
        grid[:len(record.plan), i] = [shade[choice] for choice in record.plan]
    return np.ma.masked_invalid(grid)


def plan_figure(records, title: str = "blocks checkpointed per step", what: str = "checkpointed") -> Figure:
    """Heat map of the plan: one column per step, one row per block (a full row each, between
    lines), coloured by the block's choice: kept (run plainly), checkpointed selectively (its
    compute-heavy ops' outputs kept) or partially (the first of them kept), recomputed whole
    (``what`` it is: checkpointed; DTR's plan is what it evicted), offloaded (what it saves held in
    host memory). The legend names the choices the run made, and out of memory where a step ran out."""
    num_blocks = max([r.num_blocks or 0 for r in records] + [len(r.plan) for r in records] + [1])
    grid = plan_grid(records, num_blocks)
    choices = _plan_choices(what)
    fig, ax = new_figure()
    ax.imshow(grid, cmap=ListedColormap([colour for _, colour, _ in choices]), vmin=-0.5, vmax=len(choices) - 0.5,
              aspect="auto", origin="lower", interpolation="nearest",
              extent=(-0.5, len(records) - 0.5, -0.5, num_blocks - 0.5))
    made = set(np.unique(grid.compressed()).astype(int))
    handles = [Patch(color=choices[index][1], label=choices[index][2]) for index in _LEGEND_ORDER if index in made]
    oom = [i for i, r in enumerate(records) if r.oom]
    for i in oom:
        ax.axvline(i, color="red", linewidth=2)
    if oom:
        handles.append(Patch(color="red", label="out of memory"))
    if num_blocks <= 24:
        ax.set_yticks(range(num_blocks))
    if num_blocks <= 48:  # a line between blocks: each reads as a row of its own
        ax.set_yticks(np.arange(1, num_blocks) - 0.5, minor=True)
        ax.grid(which="minor", axis="y", color="white", linewidth=1)
        ax.tick_params(which="minor", left=False)
    ax.set_xlabel(_step_axis(records))
    ax.set_ylabel("block")
    ax.set_title(title, loc="left")  # a run's name makes it wider than the axes: it runs on over the legend
    _legend(ax, handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return fig


FITTED = (("plain_bytes", "run plainly", "tab:red"), ("ckpt_bytes", "checkpointed", "tab:blue"))
"""The estimator's quantities drawn per block: the bytes a block holds until its backward, run
plainly and checkpointed; the scheduler's savings are their difference."""


def load_estimator(path):
    """The ``Estimator`` in a run's estimator.json (Mimose's ``state_dict``), refitted as the
    planner would; ValueError naming the file when it is not one mimose can read."""
    state = read_json(Path(path))
    try:
        saved = state["estimator"]
        feature_set = next((f for f in (TOKENS, SEQ2SEQ) if list(f.names) == list(saved["features"])), None)
        if feature_set is None:
            raise ValueError(f"unknown features {saved['features']}")
        estimator = Estimator(int(saved["num_blocks"]), feature_set)
        estimator.load_state_dict(saved)
    except (KeyError, TypeError, IndexError, ValueError) as err:
        raise ValueError(f"{path}: not an estimator this mimose can read ({err}); "
                         "the file is corrupt or from another version") from None
    return estimator


def _length(size) -> int:
    return math.prod(size[1:])


def _samples(estimator, quantity: str, block: int) -> list:
    """(L, bytes) of each sample of one block's quantity (a peak's: its largest op)."""
    if (quantity, block) not in estimator.layout:
        return []
    offset, ops = estimator.layout[(quantity, block)]
    points = []
    for size, row in zip(estimator.sizes, estimator.rows):
        values = row[offset: offset + ops]
        if len(values) == ops and not np.isnan(values).all():
            points.append((_length(size), float(np.nanmax(values))))
    return points


def _fit_sizes(estimator, planned) -> list:
    """Sizes to draw the fit at: lengths across the samples and the ``planned`` ones, at each
    batch measured (token inputs), else the sizes measured (an encoder-decoder's two lengths)."""
    if estimator.feature_set is not TOKENS:
        return sorted(set(estimator.sizes), key=_length)
    lengths = [_length(s) for s in estimator.sizes] + list(planned)
    grid = np.unique(np.linspace(min(lengths), max(lengths), 80).round().astype(int))
    return [(batch, int(length)) for batch in sorted({s[0] for s in estimator.sizes}) for length in grid]


def _block_panel(ax, estimator, block: int, fits: list, divisor: float) -> None:
    """One block's samples (dots) and fitted curves (``fits``: (size, prediction) pairs), solid
    between the lengths sampled and dotted outside them."""
    low, high = min(map(_length, estimator.sizes)), max(map(_length, estimator.sizes))
    batches = sorted({size[0] for size, _ in fits})
    for quantity, label, colour in FITTED:
        points = _samples(estimator, quantity, block)
        if points:
            ax.scatter(*zip(*[(x, v / divisor) for x, v in points]), s=14, color=colour, label=f"{label}: samples")
        for batch in batches:
            curve = [(_length(size), pred.blocks[quantity][block] / divisor) for size, pred in fits
                     if size[0] == batch]
            inside = [c for c in curve if low <= c[0] <= high]
            ax.plot(*zip(*inside), color=colour, linewidth=1, label=f"{label}: fit" if batch == batches[0] else None)
            for outside in ([c for c in curve if c[0] <= low], [c for c in curve if c[0] >= high]):
                if len(outside) > 1:
                    ax.plot(*zip(*outside), color=colour, linewidth=1, linestyle=":")
    ax.set_title(f"block {block}", fontsize="medium")
    ax.set_ylim(bottom=0)


def estimator_figure(estimator, planned=()) -> Figure:
    """One panel per block: the estimator's samples and fitted curves, drawn across the lengths
    the run ``planned`` for too; samples alone while it is not fitted."""
    n = estimator.num_blocks
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = new_figure(rows, cols, size=(3.0 * cols + 0.6, 2.4 * rows + 0.8), squeeze=False)
    sizes = _fit_sizes(estimator, planned) if estimator.fitted else []
    fits = [(size, estimator.predict(size)) for size in sizes]
    values = [v for q, _, _ in FITTED for b in range(n) for _, v in _samples(estimator, q, b)]
    divisor, unit = byte_unit(values + [float(p.blocks[q].max()) for _, p in fits for q, _, _ in FITTED])
    for block, ax in enumerate(axes.flat):
        if block >= n:
            ax.set_visible(False)
            continue
        _block_panel(ax, estimator, block, fits, divisor)
        if block % cols == 0:
            ax.set_ylabel(f"held until backward ({unit})")
        if block >= n - cols:
            ax.set_xlabel("length L (tokens)" if len(estimator.sizes[0]) == 2 else "L: product of the lengths")
    _legend(axes.flat[0], fontsize="x-small")
    state = "fits dotted outside the samples" if estimator.fitted else "not fitted yet (sheltered phase)"
    fig.suptitle(f"estimator: per-block samples and fits, {len(estimator.sizes)} samples; {state}")
    return fig


def _compare_series(data: dict) -> tuple:
    """(budget entries sorted by budget, planners in compare.json's order)."""
    entries = sorted(data["budgets"], key=lambda e: e["budget_bytes"] or 0)
    planners = list(data.get("planners") or [])
    for entry in entries:
        planners += [r["planner"] for r in entry["runs"] if r["planner"] not in planners]
    return entries, planners


def compare_time_figure(data: dict) -> Figure:
    """The paper's main figure: training time of each planner against the budget; a planner that
    ran out of memory at a budget is a cross on the x axis."""
    entries, planners = _compare_series(data)
    divisor, unit = byte_unit([e["budget_bytes"] for e in entries])
    fig, ax = new_figure()
    any_oom = False
    for n, planner in enumerate(planners):
        rows = [((e["budget_bytes"] or 0) / divisor, r) for e in entries for r in e["runs"]
                if r["planner"] == planner]
        done = [(x, r["train_time_s"]) for x, r in rows if r["status"] == "completed" and r.get("train_time_s")]
        oom = [x for x, r in rows if r["status"] == "oom"]
        # A planner that never completed still needs its colour in the legend.
        ax.plot(*(zip(*done) if done else ([], [])), marker="o", color=f"C{n}", label=planner)
        if oom:
            ax.scatter(oom, [0] * len(oom), marker="x", s=60, color=f"C{n}", clip_on=False, zorder=3)
            any_oom = True
    if any_oom:
        ax.scatter([], [], marker="x", color="grey", label="out of memory (on the x axis)")
    ax.set_ylim(bottom=0)
    ax.set_xticks([(e["budget_bytes"] or 0) / divisor for e in entries],  # the budgets as the user wrote them
                  [f"{e['budget']}\n({format_bytes(e['budget_bytes'])})" for e in entries], fontsize="small")
    ax.set_xlabel(f"budget (axis in {unit})")
    ax.set_ylabel("training time (s)")
    ax.set_title(f"{data.get('recipe', 'compare')}: time per planner against budget, "
                 f"{data.get('steps')} steps each")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return fig


def compare_memory_figure(data: dict) -> Figure:
    """Peak memory of each planner at each budget (bars), the budget (a line over its group)."""
    entries, planners = _compare_series(data)
    divisor, unit = byte_unit([e["budget_bytes"] for e in entries]
                              + [r.get("peak_bytes") for e in entries for r in e["runs"]])
    fig, ax = new_figure()
    width = 0.8 / max(1, len(planners))
    labelled = set()  # each planner named once, at its first bar (it may have none at a budget)
    for g, entry in enumerate(entries):
        rows = {r["planner"]: r for r in entry["runs"]}
        for n, planner in enumerate(planners):
            row = rows.get(planner)
            x = g - 0.4 + (n + 0.5) * width
            peak = (row or {}).get("peak_bytes")
            if peak is not None:
                ax.bar(x, peak / divisor, width, color=f"C{n}", label=None if planner in labelled else planner)
                labelled.add(planner)
            if row is not None and row["status"] != "completed":
                ax.text(x, (peak or 0) / divisor, row["status"], rotation=90, ha="center", va="bottom",
                        fontsize="x-small", color="red")
        if entry["budget_bytes"]:
            ax.hlines(entry["budget_bytes"] / divisor, g - 0.45, g + 0.45, colors="red", linestyles=":",
                      label="budget" if g == 0 else None)
    ax.set_xticks(range(len(entries)), [e["budget"] for e in entries])
    ax.set_xlabel("budget")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title("peak memory per planner")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return fig


@dataclass
class Plots:
    """What ``write_plots`` did: the PNGs written, and each one not drawn with the reason."""

    written: list[Path] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(file name, reason) pairs."""


def _plan_title(records, what: str) -> str:
    """What the plan heat map shows: the blocks checkpointed (DTR: evicted), and offloaded where any was."""
    if not any(r.blocks("offload") for r in records):
        return f"blocks {what}"
    return f"blocks {what} or offloaded" if any(r.blocks("checkpointed") for r in records) else "blocks offloaded"


def run_figures(run_dir) -> dict:
    """A run directory's figures by file name; a plot that cannot be drawn maps to the reason."""
    run_dir = Path(run_dir)
    summary, records = load_run(run_dir)
    what = "evicted" if (summary.get("planner") or {}).get("planner") == "dtr" else "checkpointed"
    if not records:
        return {name: "no step recorded in metrics.jsonl" for name in ("memory.png", "input_size.png",
                                                                         "plan.png", "estimator.png")}
    figures = {"memory.png": memory_figure(records, summary.get("budget_bytes"), f"{run_dir.name}: memory per step",
                                           summary.get("budget")),
               "input_size.png": input_size_figure(records, f"{run_dir.name}: input size per step"),
               "plan.png": plan_figure(records, f"{run_dir.name}: {_plan_title(records, what)} per step", what)}
    path = run_dir / "estimator.json"
    if not path.is_file():
        figures["estimator.png"] = "no estimator.json in the run directory (only the mimose planner keeps one)"
        return figures
    try:
        estimator = load_estimator(path)
    except ValueError as err:  # the other plots are still worth having
        figures["estimator.png"] = str(err)
        return figures
    if not estimator.sizes:
        figures["estimator.png"] = "estimator.json holds no sample (the run ended before its first measured step)"
    else:
        figures["estimator.png"] = estimator_figure(estimator, [_length(r.input_size) for r in records
                                                                if r.input_size])
    return figures


def compare_figures(compare_dir) -> dict:
    """A compare directory's figures by file name."""
    data = read_json(Path(compare_dir) / "compare.json", COMPARE_FILE)
    if not any(e["runs"] for e in data["budgets"]):
        reason = "compare.json holds no finished run yet"
        return {"compare_time.png": reason, "compare_memory.png": reason}
    return {"compare_time.png": compare_time_figure(data), "compare_memory.png": compare_memory_figure(data)}


def write_plots(path, out_dir=None) -> Plots:
    """Draw a run or compare directory's plots into ``out_dir`` (default ``path/plots``)."""
    path = Path(path)
    out_dir = Path(out_dir) if out_dir is not None else path / PLOTS_DIR
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file, where the plots go; move it away (or leave plots out)")
    refuse_dangling_link(out_dir, f"{out_dir}, where the plots go,")
    figures = compare_figures(path) if (path / "compare.json").exists() else run_figures(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = Plots()
    for name, figure in figures.items():
        if isinstance(figure, str):
            plots.skipped.append((name, figure))
            continue
        _save(figure, out_dir / name)
        plots.written.append(out_dir / name)
    return plots


def _save(figure: Figure, target: Path) -> None:
    """Write ``figure`` as ``target`` whole or not at all (a temporary file, then a rename); a
    write that fails (a full disk, no permission) is an OSError naming the file and the way out."""
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        figure.savefig(tmp, dpi=DPI, format="png")
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(f"{target} could not be written ({err.strerror or err}); free the space or fix the "
                      "permissions, or leave the plots out: mimose report --no-plots") from None
