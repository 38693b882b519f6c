"""Data-parallel training under torchrun: two gloo processes on the CPU train as one process with
twice the batch, each within the per-device budget, and rank 0 writes one run directory."""

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from faults import driver
from typer.testing import CliRunner

from mimose_cli.cli import app
from mimose_cli.launcher.checkpoint import CHECKPOINT, rank_state, save_checkpoint
from mimose_cli.launcher.data.dataset import build_dataset
from mimose_cli.launcher.data.loader import build_dataloader
from mimose_cli.launcher.distributed import World, local_batch
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.resume import resume_recipe
from mimose_cli.launcher.train import _setup, run_training
from mimose_cli.planners.blocks import checkpointed
from mimose_cli.planners.runners import PlanRunner
from mimose_cli.runs.live import ProgressView
from mimose_cli.runs.records import StepRecord, merge_ranks

from helpers import QUICKSTART

# Sequence classification (a per-example mean loss) without dropout: each rank would draw its own
# masks, so only then do two ranks of 4 examples compute what one process of 8 does. At BUDGET the
# longer global batches need blocks checkpointed (4x96 needs 7.6 MiB without), the shorter none.
DATA_PARALLEL = ["task=sequence_classification", "data.preset=qqp", "data.num_examples=64", "data.max_length=96",
                 "training.batch_size=4", "training.max_steps=8", "training.checkpoint_every=4",
                 "planner.mimose.sheltered_steps=2",
                 "model.config_overrides={hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}"]
BUDGET = "6MB"
BUDGET_BYTES = 6 * 10**6
STEPS = 8


RETRIED_STEP = 5
"""The micro-batch whose first backward runs out of memory on rank 1 (``_fail_once_in_backward``)."""


@dataclass
class Launches:
    stopped_status: int
    stopped_output: str
    stopped: dict
    """summary.json of the run as SIGTERM left it."""
    run_dirs: list


def _out_of_memory(grad):
    raise torch.OutOfMemoryError("injected: out of memory in backward")


def _fail_once_in_backward(step: int) -> None:
    """In this process from now on: the first attempt of planner step ``step`` (one that runs
    its plan) runs out of memory in backward, in the first block's gradient, where torch's
    DistributedDataParallel would be all-reducing."""
    begin, run = PlanRunner.begin, PlanRunner.run

    def failing_begin(self, info, inputs=None):
        begin(self, info, inputs)
        self.fail = info.step == step and info.retries == 0

    def failing_run(self, index, forward, args, kwargs):
        output = run(self, index, forward, args, kwargs)
        if getattr(self, "fail", False) and index == 0 and torch.is_grad_enabled():
            self.fail = False
            (output[0] if isinstance(output, tuple) else output).register_hook(_out_of_memory)
        return output

    PlanRunner.begin, PlanRunner.run = failing_begin, failing_run


def _resume_rank(rank: int, port: int, run_dir: str) -> None:
    """One rank of ``--resume run_dir`` with two processes (spawned by torch.multiprocessing),
    rank 1 running out of memory once (``_fail_once_in_backward``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if rank == 1:
        _fail_once_in_backward(RETRIED_STEP)
    result = run_training(resume_recipe(run_dir), view="none", resume=run_dir, world=World(rank, 2))
    assert result.summary["status"] == "completed", result.summary


def _free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """``mimose train --nproc-per-node 2`` (torchrun, gloo) of the recipe at BUDGET, stopped by
    SIGTERM once step 1 is written; then resumed by two processes of the library, rank 1
    running out of memory once in backward."""
    out = tmp_path_factory.mktemp("runs")
    status, output, sent = driver.interrupt(signal.SIGTERM, 1, *DATA_PARALLEL, "--budget", BUDGET,
                                            "--nproc-per-node", "2", out=out)
    assert sent, output
    run_dir = driver.run_dir_in(out)
    stopped = driver.summary(run_dir)
    ranks = torch.multiprocessing.spawn(_resume_rank, args=(_free_port(), str(run_dir)), nprocs=2, join=False)
    deadline = time.monotonic() + driver.TIMEOUT_S
    while not ranks.join(timeout=1):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the resumed ranks hang")
    return Launches(status, output, stopped, list(out.iterdir()))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same steps in one process with twice the batch (no budget to plan for)."""
    out = tmp_path_factory.mktemp("one")
    recipe = load_recipe(QUICKSTART, DATA_PARALLEL + ["training.batch_size=8", "planner.name=none", f"out_dir={out}"])
    return run_training(recipe, view="none", world=World())


def _lines(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_as_one_process_with_twice_the_batch(two_processes, one_process):
    one = one_process
    (run_dir,) = two_processes.run_dirs  # written once, by rank 0
    lines = _lines(run_dir)
    assert [r.input_shape for r in one.records] == [[8, line["input_shape"][1]] for line in lines]
    assert [line["loss"] for line in lines] == pytest.approx([r.loss for r in one.records], rel=1e-4)
    assert len({line["loss"] for line in lines}) > 1
    # The averaged gradients were the one process's: AdamW's first moments (which, unlike its
    # steps, scale with the gradients) and the weights agree.
    two_state, one_state = (torch.load(d / CHECKPOINT, weights_only=True) for d in (run_dir, one.run_dir))
    for key, moments in one_state["optimizer"]["state"].items():
        assert torch.allclose(two_state["optimizer"]["state"][key]["exp_avg"], moments["exp_avg"], rtol=1e-3, atol=1e-7)
    for name, weight in one_state["model"].items():
        assert torch.allclose(two_state["model"][name], weight, rtol=1e-4, atol=1e-6), name


def test_every_rank_plans_its_own_batches_within_the_budget(two_processes):
    (run_dir,) = two_processes.run_dirs
    lines = _lines(run_dir)
    assert len(lines) == STEPS
    for line in lines:
        ranks = line["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and not line["oom"] and not any(r["oom"] for r in ranks)
        assert all(r["input_shape"] == [4, line["input_shape"][1]] for r in ranks)
        assert all(r["peak_bytes"] <= BUDGET_BYTES for r in ranks)
        worst = max(ranks, key=lambda r: r["peak_bytes"])
        assert line["memory/peak_bytes"] == worst["peak_bytes"] and line["rank"] in (0, 1)
    responsive = [r for line in lines for r in line["ranks"] if r["phase"] == "responsive"]
    assert any(checkpointed(r["plan"]) for r in responsive) and any(not checkpointed(r["plan"]) for r in responsive)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["over_budget_steps"] == 0
    assert [(r["rank"], r["oom_steps"], r["over_budget_steps"]) for r in summary["ranks"]] == [(0, 0, 0), (1, 0, 0)]
    assert max(r["peak_bytes"] for r in summary["ranks"]) == summary["peak_bytes"] <= BUDGET_BYTES


def test_a_signal_stops_every_rank_at_the_same_step_and_they_resume_from_it(two_processes):
    stopped = two_processes.stopped
    assert two_processes.stopped_status == 143  # SIGTERM, rank 0's status passed on through torchrun
    assert stopped["status"] == "interrupted" and stopped["signal"] == "SIGTERM"
    assert 1 <= stopped["checkpoint_step"] == stopped["optimizer_steps"] < STEPS
    summary = driver.summary(two_processes.run_dirs[0])
    assert summary["resumed_from_steps"] == [stopped["checkpoint_step"]] and summary["optimizer_steps"] == STEPS


def test_a_rank_retrying_its_backward_neither_hangs_nor_changes_the_step(two_processes, one_process):
    lines = _lines(two_processes.run_dirs[0])
    retried = lines[RETRIED_STEP]
    assert (retried["retries"], [r["retries"] for r in retried["ranks"]]) == (1, [0, 1])
    assert sum(line["retries"] for line in lines) == 1
    assert retried["loss"] == pytest.approx(one_process.records[RETRIED_STEP].loss, rel=1e-4)


def test_rank_zero_alone_prints_and_checkpoints_every_ranks_state(two_processes):
    output, (run_dir,) = two_processes.stopped_output, two_processes.run_dirs
    assert output.count("step 0/8 ") == 1 and output.count("run directory:") == 1
    assert "peak memory per rank" in output and output.count("SIGTERM: stopping") == 1
    state = torch.load(run_dir / CHECKPOINT, weights_only=True)
    assert state["world_size"] == 2 and len(state["other_ranks"]) == 1
    assert json.loads(state["other_ranks"][0]["planner"])["name"] == "mimose"
    assert (run_dir / "model").is_dir() and (run_dir / "estimator.json").is_file()


def test_a_run_of_two_processes_resumes_only_with_two(two_processes):
    (run_dir,) = two_processes.run_dirs
    result = CliRunner().invoke(app, ["train", "--resume", str(run_dir), "--max-steps", "10", "--view", "none"])
    assert result.exit_code == 2
    assert f"was trained by 2 process(es), not 1; resume it with mimose train --resume {run_dir} --nproc-per-node 2" \
        in result.output


def test_only_a_data_parallel_run_must_resume_on_as_many_processes(tmp_path):
    """A sharded run's checkpoint reshards (tests/launcher/test_sharded.py), so it resumes on any
    number of processes; a data-parallel one is told the number it was trained with."""
    from mimose_cli.cli.train import _check_processes
    from mimose_cli.launcher.recipe import RecipeError

    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 2}))
    with pytest.raises(RecipeError, match="was trained by 2 process"):
        _check_processes(tmp_path, 3, sharded=False)
    _check_processes(tmp_path, 3, sharded=True)
    with pytest.raises(RecipeError, match="not 3; .* --nproc-per-node 2, or set training.max_steps"):
        _check_processes(tmp_path, 3, sharded=True, by_epochs=True)


def test_a_rank_restores_its_own_planner_and_rng(quick_recipe):
    recipe = quick_recipe("training.max_steps=1")
    quiet = ProgressView("t", "-", None, mode="none")
    run = _setup(recipe, None, "run", None, quiet)
    planner = {**json.loads(rank_state(run.trainer)["planner"]), "steps": 41}
    other = {"rng": {"torch": torch.ByteTensor([1, 2, 3])}, "planner": json.dumps(planner)}
    save_checkpoint(run.run_dir, run.trainer, run.start, [other])
    resumed = _setup(recipe, None, "run", run.run_dir, quiet, World(rank=1, size=2))
    assert resumed.trainer.planner.steps == 41
    assert resumed.checkpoint["other_ranks"][0]["rng"]["torch"].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="written by a run of 2 process"):
        _setup(recipe, None, "run", run.run_dir, quiet)


def test_a_global_batch_is_sliced_by_rank_with_weights_for_the_mean():
    batch = {"input_ids": torch.arange(7 * 3).view(7, 3), "labels": torch.arange(7)}
    parts = [local_batch(batch, World(rank=r, size=2)) for r in (0, 1)]
    assert [len(p["labels"]) for p, _ in parts] == [4, 3]
    assert torch.equal(torch.cat([p["input_ids"] for p, _ in parts]), batch["input_ids"])
    # Weighted so that the average of the ranks' gradients is the mean over the 7 rows.
    assert [w for _, w in parts] == pytest.approx([8 / 7, 6 / 7])
    assert parts[1][0]["labels"].untyped_storage().nbytes() == 3 * 8  # its own rows only, not the batch
    assert local_batch(batch, World()) == (batch, 1.0)


def test_every_rank_builds_the_global_batches_of_one_process(quick_recipe):
    recipe = quick_recipe("task=sequence_classification", "data.num_examples=19", "training.batch_size=3")
    config = model_config(recipe)
    dataset = build_dataset(recipe, config)
    two = build_dataloader(recipe, dataset, config, epoch=1, world_size=2)
    one = build_dataloader(quick_recipe("task=sequence_classification", "data.num_examples=19",
                                        "training.batch_size=6"), dataset, config, epoch=1)
    # 19 examples: three batches of 6 and one of 1, which two processes cannot share.
    assert two.batches == one.batches[:3] and len(one.batches[3]) == 1
    three = build_dataloader(recipe, dataset, config, world_size=3)
    assert [len(b) for b in three.batches] == [9, 9]  # the last global batch of 1 is left out


def _record(rank_loss, peak, rows=4, **fields):
    return StepRecord(step=2, input_shape=[rows, 50], input_size=[rows, 50], loss=rank_loss, peak_bytes=peak,
                      iter_ms=10.0 + peak, plan=["recompute" if peak > 5 else "keep", "keep"], **fields)


def test_records_of_the_ranks_merge_into_the_worst_ranks_with_the_global_loss():
    merged = merge_ranks([_record(1.0, 5, rows=4, retries=1), _record(4.0, 9, rows=2, retries=2)])
    assert (merged.rank, merged.peak_bytes, merged.plan, merged.iter_ms) == (1, 9, ["recompute", "keep"], 19.0)
    assert merged.loss == pytest.approx((4 * 1.0 + 2 * 4.0) / 6) and merged.retries == 3 and not merged.oom
    assert [(r.rank, r.peak_bytes, r.loss) for r in merged.ranks] == [(0, 5, 1.0), (1, 9, 4.0)]
    assert StepRecord.from_json(json.loads(json.dumps(merged.to_json()))) == merged
    oom = StepRecord(step=2, input_shape=[4, 50], peak_bytes=3, oom=True, error="out of memory")
    failed = merge_ranks([_record(1.0, 9), oom])
    assert failed.oom and failed.rank == 1 and failed.loss is None and failed.error == "rank 1: out of memory"


def test_nproc_per_node_runs_the_same_command_under_torchrun(monkeypatch, tmp_path):
    from mimose_cli.launcher import spawn as launch

    calls = []
    monkeypatch.setattr(launch, "relaunch", lambda nproc, args: calls.append((nproc, args)) or 143)
    result = CliRunner().invoke(app, ["train", str(QUICKSTART), "training.max_steps=3", "--budget", "40MB",
                                      "--out", str(tmp_path), "--nproc-per-node", "2"])
    assert result.exit_code == 143  # rank 0's status, passed on
    assert calls == [(2, ["train", str(QUICKSTART), "training.max_steps=3", "--budget=40MB", f"--out={tmp_path}",
                          "--view=auto"])]
    command = launch.torchrun_command(2, ["train", "r.yaml"])
    assert command[1:] == ["-m", "mimose_cli.launcher.torchrun", "--standalone", "--nproc-per-node=2", "-m", "mimose_cli",
                           "train", "r.yaml"]
    bad = CliRunner().invoke(app, ["train", str(QUICKSTART), "no_such_key=1", "--nproc-per-node", "2"])
    assert bad.exit_code == 2 and calls == [calls[0]]  # a bad recipe fails before any process starts
    dry = CliRunner().invoke(app, ["train", str(QUICKSTART), "--dry-run", "--nproc-per-node", "2"])
    assert dry.exit_code == 2 and "with --dry-run" in dry.output
    monkeypatch.setenv("LOCAL_RANK", "0")
    nested = CliRunner().invoke(app, ["train", str(QUICKSTART), "--nproc-per-node", "2"])
    assert nested.exit_code == 2 and "under torchrun" in nested.output and len(calls) == 1


def test_the_launcher_passes_on_rank_zeros_exit_status(monkeypatch):
    from mimose_cli.launcher import spawn as launch

    leave = "import os, pathlib; pathlib.Path(os.environ['MIMOSE_EXIT_FILE']).write_text('130'); raise SystemExit(1)"
    monkeypatch.setattr(launch, "torchrun_command", lambda nproc, args: [sys.executable, "-c", leave])
    assert launch.relaunch(2, []) == 130
    monkeypatch.setattr(launch, "torchrun_command", lambda nproc, args: [sys.executable, "-c", "raise SystemExit(3)"])
    assert launch.relaunch(2, []) == 3  # rank 0 left nothing: torchrun's own status


def test_compare_refuses_to_run_under_torchrun(monkeypatch, quick_recipe):
    from mimose_cli.launcher.sweep import run_compare

    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="without torchrun"):
        run_compare(quick_recipe(), budgets=["40MB"])



def test_a_mistake_every_rank_finds_is_one_line_without_torchruns_logs(tmp_path):
    """A refusal both ranks reach alike (dtr cannot plan an FSDP-sharded model) is printed once, not
    once per rank, and torchrun's agent adds no warning or error lines of its own."""
    done = driver.train(tmp_path, "training.parallel=fsdp", "--planner", "dtr", "--nproc-per-node", "2")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert errors == ["error: planner 'dtr' cannot plan an FSDP-sharded model (it evicts tensors one by one, FSDP "
                      "gathers and frees each block's parameters itself): use mimose, sublinear or hf-every-n"]
    assert "torch/distributed/elastic" not in done.stderr and "Traceback" not in done.stderr


def test_each_line_is_said_once_by_the_first_rank_to_say_it(monkeypatch, tmp_path):
    from mimose_cli.launcher.spawn import SAID_DIR_ENV, first_to_say

    assert first_to_say("error: a") and first_to_say("error: a")  # outside the launcher: always said
    monkeypatch.setenv(SAID_DIR_ENV, str(tmp_path))
    assert first_to_say("error: a") and not first_to_say("error: a")
    assert first_to_say("error: b")  # another line is said too
    monkeypatch.setenv(SAID_DIR_ENV, str(tmp_path / "gone"))
    assert first_to_say("error: a")  # the launcher's folder is gone: said rather than lost
