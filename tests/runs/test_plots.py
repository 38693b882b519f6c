"""``mimose report``'s PNGs: drawn from real run and compare directories, with their axes and data."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import mimose_cli.launcher.sweep
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.sweep import run_compare
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.runs.plots import compare_figures, load_estimator, run_figures, write_plots
from mimose_cli.runs.records import StepRecord, read_records

from helpers import QUICK_OVERRIDES, QUICKSTART

RUN_PNGS = ["memory.png", "input_size.png", "plan.png", "estimator.png"]


def png_size(path) -> tuple:
    """(width, height) of a PNG, from its header; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def mimose_run(tmp_path_factory):
    """A real quickstart run, cut short, learning as the paper does: 5 sheltered steps, then 3
    planned by the estimator (the default, planned from the first step, has no phase to shade)."""
    out = tmp_path_factory.mktemp("runs")
    recipe = load_recipe(QUICKSTART, QUICK_OVERRIDES + ["training.max_steps=8", f"out_dir={out}",
                                                        "planner.mimose.estimate=sheltered"])
    return mimose_cli.launcher.train.run_training(recipe, view="none", recipe_name="quickstart").run_dir


@pytest.fixture(scope="module")
def figures(mimose_run) -> dict:
    return run_figures(mimose_run)


def legend_texts(ax) -> list:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_run_gets_every_png_and_leaves_pyplot_alone(mimose_run, tmp_path):
    import matplotlib
    from matplotlib import pyplot

    backend = matplotlib.get_backend()
    plots = write_plots(mimose_run, tmp_path / "plots")
    assert [p.name for p in plots.written] == RUN_PNGS and plots.skipped == []
    for path in plots.written:
        width, height = png_size(path)
        assert width >= 600 and height >= 300 and path.stat().st_size > 8_000, path
    assert pyplot.get_fignums() == [] and matplotlib.get_backend() == backend


def test_memory_and_input_size_have_units_budget_and_phases(mimose_run, figures):
    memory = figures["memory.png"].axes[0]
    assert (memory.get_xlabel(), memory.get_ylabel()) == ("step", "memory (MiB)")
    labels = legend_texts(memory)
    assert "budget 40MB (38.15 MiB)" in labels and "sheltered steps" in labels
    assert "predicted peak (forward + backward)" in labels
    # The measured line is the run's peaks, in MiB.
    records = read_records(mimose_run / "metrics.jsonl")
    measured = memory.get_lines()[0].get_ydata()
    assert list(measured) == pytest.approx([r.peak_bytes / 2**20 for r in records])
    top, bottom = figures["input_size.png"].axes
    assert bottom.get_xlabel() == "step" and bottom.get_ylabel() == "tokens per batch (B × L)"
    assert list(bottom.get_lines()[0].get_ydata()) == [np.prod(r.input_size) for r in records]


def test_the_plan_heat_map_is_the_plans(mimose_run, figures):
    ax = figures["plan.png"].axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "block")
    records = read_records(mimose_run / "metrics.jsonl")
    grid = np.asarray(ax.images[0].get_array())
    assert grid.shape == (4, len(records))
    for column, record in zip(grid.T, records):
        assert tuple(np.flatnonzero(column)) == checkpointed(record.plan)
    assert grid[:, :5].all()  # the sheltered steps checkpoint every block


def test_the_estimator_fits_pass_through_their_samples(mimose_run, figures):
    estimator = load_estimator(mimose_run / "estimator.json")
    figure = figures["estimator.png"]
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert len(panels) == estimator.num_blocks == 4
    assert panels[0].get_ylabel() == "held until backward (MiB)"
    assert panels[-1].get_xlabel() == "length L (tokens)"
    for ax in panels:
        samples, fits = ax.collections, [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        assert len(samples) == 2 and len(fits) == 2  # plain and checkpointed
        for dots, line in zip(samples, fits):
            x, y = np.asarray(dots.get_offsets()).T
            assert len(x) == len(estimator.sizes) == 5
            # Memory is exactly quadratic in the length: the fit meets every sample.
            assert np.interp(x, line.get_xdata(), line.get_ydata()) == pytest.approx(y, rel=1e-3)


def test_a_run_of_one_step_plots_what_it_has(quick_recipe):
    recipe = quick_recipe("training.max_steps=1", "planner.mimose.estimate=sheltered")
    run_dir = mimose_cli.launcher.train.run_training(recipe, view="none").run_dir
    plots = write_plots(run_dir)
    assert [p.name for p in plots.written] == RUN_PNGS
    figure = run_figures(run_dir)["estimator.png"]
    assert "1 samples; not fitted yet" in figure.get_suptitle()
    ax = figure.axes[0]
    assert len(ax.collections) == 2 and not ax.get_lines()  # the samples, no fit


@pytest.mark.filterwarnings("error")
def test_a_first_step_out_of_memory_before_any_plan_is_still_drawn():
    from mimose_cli.runs.plots import input_size_figure, memory_figure, plan_figure

    records = [StepRecord(step=0, oom=True, peak_bytes=None, reached_bytes=3 * 2**20, error="out of memory")]
    ax = memory_figure(records, budget_bytes=2**21).axes[0]
    (cross,) = [c for c in ax.collections if c.get_label() == "out of memory (bytes reached)"]
    assert list(cross.get_offsets()[0]) == [0, 3.0] and ax.get_ylabel() == "memory (MiB)"
    assert input_size_figure(records).axes[1].get_xlabel() == "step"
    assert np.asarray(plan_figure(records).axes[0].images[0].get_array()).shape == (1, 1)


def test_a_run_without_estimator_or_with_a_corrupt_one_still_plots(mimose_run, tmp_path):
    run = shutil.copytree(mimose_run, tmp_path / "run")
    (run / "estimator.json").unlink()
    plots = write_plots(run)
    assert [p.name for p in plots.written] == RUN_PNGS[:3]
    assert plots.skipped == [("estimator.png", "no estimator.json in the run directory "
                                               "(only the mimose planner keeps one)")]
    (run / "estimator.json").write_text('{"estimator": {"num_blocks": 4}}')
    (name, reason), = write_plots(run).skipped
    assert name == "estimator.png" and "estimator.json" in reason and "corrupt" in reason


@pytest.fixture
def compare_dir(monkeypatch, tmp_path):
    """A compare directory as tests/runs/test_compare.py makes one: runs faked, none OOM at 30MB."""
    times = {"mimose": 11.0, "sublinear": 14.0, "dtr": 15.0, "hf-every-n": 13.0, "none": 10.0, "oracle": 10.5}

    def run_training(recipe, *, out_dir=None, view="auto", console=None, recipe_name="run", save=True):
        run_dir = out_dir / recipe_name
        run_dir.mkdir(parents=True)
        oom = recipe.planner.name == "none" and recipe.budget == "30MB"
        summary = {"status": "oom" if oom else "completed", "steps": 2 if oom else 5,
                   "oom_steps": int(oom), "train_time_s": times[recipe.planner.name] * 40e6 / recipe.budget_bytes,
                   "peak_bytes": recipe.budget_bytes * 9 // 10, "budget_bytes": recipe.budget_bytes, "planner": {}}
        return mimose_cli.launcher.train.RunResult(run_dir, summary)

    monkeypatch.setattr(mimose_cli.launcher.sweep, "run_training", run_training)
    recipe = load_recipe(QUICKSTART)
    return run_compare(recipe, budgets=["30MB", "60MB"], steps=5, out=tmp_path / "cmp", view="none",
                       console=None, recipe_name="quickstart")


def test_a_compare_directory_gets_time_and_memory_against_budget(compare_dir):
    plots = write_plots(compare_dir)
    assert [p.name for p in plots.written] == ["compare_time.png", "compare_memory.png"]
    for path in plots.written:
        assert path.parent == compare_dir / "plots" and path.stat().st_size > 8_000
        png_size(path)
    figures = compare_figures(compare_dir)
    time_ax = figures["compare_time.png"].axes[0]
    assert (time_ax.get_xlabel(), time_ax.get_ylabel()) == ("budget (axis in MiB)", "training time (s)")
    assert [t.get_text() for t in time_ax.get_xticklabels()] == ["30MB\n(28.61 MiB)", "60MB\n(57.22 MiB)"]
    lines = {line.get_label(): line for line in time_ax.get_lines()}
    assert list(lines) == ["mimose", "sublinear", "dtr", "hf-every-n", "none", "oracle"]
    assert list(lines["mimose"].get_ydata()) == pytest.approx([11.0 * 40 / 30, 11.0 * 40 / 60])
    assert list(lines["none"].get_xdata()) == pytest.approx([60e6 / 2**20])  # out of memory at 30MB
    assert "out of memory (on the x axis)" in legend_texts(time_ax)
    memory_ax = figures["compare_memory.png"].axes[0]
    assert (memory_ax.get_xlabel(), memory_ax.get_ylabel()) == ("budget", "peak memory (MiB)")
    assert [t.get_text() for t in memory_ax.get_xticklabels()] == ["30MB", "60MB"]
    assert "budget" in legend_texts(memory_ax)
    assert len(memory_ax.patches) == 12 and any(t.get_text() == "oom" for t in memory_ax.texts)
    assert json.loads((compare_dir / "compare.json").read_text())["budgets"][0]["budget"] == "30MB"


def test_a_plot_that_cannot_be_written_is_named_and_leaves_no_file(mimose_run, tmp_path, monkeypatch):
    import errno

    from matplotlib.figure import Figure

    def full_disk(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")  # a write cut short
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    out = tmp_path / "plots"
    with pytest.raises(OSError, match=r"memory\.png could not be written \(No space left on device\); .*--no-plots"):
        write_plots(mimose_run, out)
    assert list(out.iterdir()) == []  # neither a torn PNG nor its temporary file


def test_the_plan_map_is_titled_by_what_the_blocks_did():
    """plan.png's title: blocks checkpointed (DTR: evicted), offloaded, or both where a run did both."""
    from mimose_cli.runs.plots import _plan_title

    def steps(*plans):
        return [StepRecord(step=i, plan=list(plan)) for i, plan in enumerate(plans)]

    kept, recomputed = ("keep", "keep", "keep"), ("keep", "recompute", "keep")
    assert _plan_title(steps(recomputed, kept), "checkpointed") == "blocks checkpointed"
    assert _plan_title(steps(("offload", "offload", "keep"), kept), "checkpointed") == "blocks offloaded"
    assert _plan_title(steps(recomputed, ("keep", "keep", "offload")), "checkpointed") == "blocks checkpointed or offloaded"
    assert _plan_title(steps(recomputed), "evicted") == "blocks evicted"


def test_the_plan_legend_names_only_the_choices_the_run_made():
    """Neither "kept" nor "recomputed" is named for a run that never kept or never recomputed a block."""
    from mimose_cli.runs.plots import plan_figure

    def legend(*plans, oom=False, what="checkpointed"):
        records = [StepRecord(step=i, plan=list(plan), num_blocks=3) for i, plan in enumerate(plans)]
        records[-1].oom = oom
        return legend_texts(plan_figure(records, what=what).axes[0])

    assert legend(("selective", "selective", "offload")) == ["checkpointed selectively", "offloaded to host memory"]
    assert legend(("keep", "recompute", "keep"), ("keep", "keep", "keep")) == [
        "kept (run plainly)", "checkpointed (recomputed whole)"]
    assert legend(("recompute",) * 3, ("partial2", "recompute", "keep"), oom=True) == [
        "kept (run plainly)", "checkpointed partially", "checkpointed (recomputed whole)", "out of memory"]
    assert legend(("keep", "recompute", "recompute"), what="evicted") == ["kept (run plainly)", "evicted"]


def test_each_block_of_the_plan_map_is_a_full_row_of_its_colour():
    """Rows are one block high and centred on the block's tick, with a line between blocks; a
    step with no plan (out of memory before one) is left blank, not drawn as kept."""
    from matplotlib.colors import to_rgba

    from mimose_cli.runs.plots import CHECKPOINTED, PLAIN, SELECTIVE, plan_figure

    records = [StepRecord(step=0, plan=["selective", "keep", "recompute"], num_blocks=3),
               StepRecord(step=1, plan=[], num_blocks=3, oom=True)]
    ax = plan_figure(records).axes[0]
    image = ax.images[0]
    assert image.get_extent() == [-0.5, 1.5, -0.5, 2.5] and ax.get_ylim() == (-0.5, 2.5)
    assert list(ax.get_yticks()) == [0, 1, 2] and list(ax.get_yticks(minor=True)) == [0.5, 1.5]
    colours = image.to_rgba(image.get_array())
    assert [tuple(c) for c in colours[:, 0]] == [to_rgba(SELECTIVE), to_rgba(PLAIN), to_rgba(CHECKPOINTED)]
    assert image.get_array().mask[:, 1].all()
