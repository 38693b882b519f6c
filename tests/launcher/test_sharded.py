"""Sharded checkpoints of a ``fully_shard``ed model (``launcher/sharded.py``) and a rank out of memory
under FSDP2 (``launcher/failures.py``), on 2 gloo ranks of a tiny BERT (``sharded_ranks.py``, run
under mimose's torchrun)."""

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from faults import driver
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import BertForSequenceClassification

from mimose_cli.launcher.failures import OUT_OF_MEMORY_FILE, sizes_out_of_memory
from mimose_cli.launcher.distributed import World
from mimose_cli.launcher.checkpoint import Progress
from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.sharded import (
    current_folder,
    load_sharded_checkpoint,
    load_sharded_model,
    restore_sharded_trainer,
    save_sharded_checkpoint,
)
from mimose_cli.launcher.spawn import EXIT_FILE_ENV

from helpers import QUICKSTART, sharded_probe_batch, tiny_bert

RANKS = Path(__file__).with_name("sharded_ranks.py")
STEPS = 6
OOM_STEP = 3


def _launch(run_dir: Path, *args, processes: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mimose_cli.launcher.torchrun", "--standalone", f"--nproc-per-node={processes}",
               str(RANKS), str(run_dir), *map(str, args)]
    exit_file = run_dir.parent / f"exit-{run_dir.name}-{time.monotonic_ns()}"
    return subprocess.run(command, env={**driver.ENV, EXIT_FILE_ENV: str(exit_file)}, capture_output=True,
                          text=True, timeout=driver.TIMEOUT_S)


def _losses(run_dir: Path, tag: str, rank: int = 0) -> dict:
    return {int(k): v for k, v in json.loads((run_dir / f"losses-{tag}-rank{rank}.json").read_text()).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of STEPS steps, a checkpoint every 2."""
    run_dir = tmp_path_factory.mktemp("reference")
    done = _launch(run_dir, STEPS)
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The same run, out of memory on rank 1 in the backward of step OOM_STEP; then resumed and
    SIGKILLed on rank 1 while writing the checkpoint of step 4; then resumed and SIGKILLed on
    rank 0 after renaming the checkpoint of step 6, before making it current. Returns the run
    directory, the three launches and, per launch, (the current folder, the seconds from the
    out-of-memory record to the end)."""
    run_dir = tmp_path_factory.mktemp("interrupted")
    oom = _launch(run_dir, STEPS, "--oom-at", OOM_STEP, "--tag", "oom")
    ended = time.time()
    after_oom = (current_folder(run_dir), ended - (run_dir / OUT_OF_MEMORY_FILE).stat().st_mtime)
    written = _launch(run_dir, STEPS, "--resume", "--kill", "write:4", "--tag", "write")
    after_write = (current_folder(run_dir), sorted(p.name for p in current_folder(run_dir).parent.iterdir()))
    switched = _launch(run_dir, STEPS, "--resume", "--kill", "switch:6", "--tag", "switch")
    after_switch = (current_folder(run_dir), sorted(p.name for p in current_folder(run_dir).parent.iterdir()))
    return run_dir, (oom, written, switched), (after_oom, after_write, after_switch)


def test_each_rank_writes_its_shard_and_the_last_checkpoint_is_current(reference):
    folder = current_folder(reference)
    assert folder.name == f"step-{STEPS:08d}"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["current", folder.name]  # earlier ones removed
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                        "rank0.pt", "rank1.pt", "trainer.pt"]
    shared = torch.load(folder / "trainer.pt", weights_only=True)
    assert shared["world_size"] == 2 and shared["progress"]["step"] == STEPS
    assert json.loads(torch.load(folder / "rank1.pt", weights_only=True)["planner"]) == {"name": "counter", "steps": STEPS}


def test_the_final_model_is_gathered_into_hugging_face_safetensors(reference):
    model_dir = reference / "model"
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()
    loaded = BertForSequenceClassification.from_pretrained(model_dir).eval()
    assert set(loaded.state_dict()) == set(tiny_bert().state_dict())
    with torch.no_grad():
        logits = loaded(**sharded_probe_batch()).logits
    torch.testing.assert_close(logits, torch.tensor(json.loads((reference / "logits-run.json").read_text())))


def test_a_checkpoint_of_two_ranks_reshards_to_one_and_a_resume_goes_on_there(reference, tmp_path):
    """The weights of two ranks load into one (the same logits), and ``--resume`` on one process
    trains on: the optimizer's state resharded (AdamW's step counts on from STEPS, not from 0),
    the planner afresh (it measured another shard size), the checkpoint now of one process."""
    resharded = _launch(reference, STEPS, "--reshard", processes=1)
    assert resharded.returncode == 0, resharded.stderr
    torch.testing.assert_close(torch.tensor(json.loads((reference / "logits-resharded-1.json").read_text())),
                               torch.tensor(json.loads((reference / "logits-run.json").read_text())))
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    resumed = _launch(run_dir, STEPS + 2, "--resume", "--tag", "one", processes=1)
    assert resumed.returncode == 0, resumed.stderr
    losses = _losses(run_dir, "one")
    assert sorted(losses) == [STEPS, STEPS + 1] and all(math.isfinite(v) for v in losses.values())
    folder = current_folder(run_dir)
    shared = torch.load(folder / "trainer.pt", weights_only=True)
    assert shared["world_size"] == 1 and shared["progress"]["step"] == STEPS + 2
    assert json.loads(torch.load(folder / "rank0.pt", weights_only=True)["planner"])["steps"] == 2
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    optimizer = torch.load(tmp_path / "whole.pt", weights_only=False)["optimizer"]
    assert {float(state["step"]) for state in optimizer["state"].values()} == {STEPS + 2.0}
    # A run that trains by epochs would count other steps on another number: refused in one line.
    by_epochs = SimpleNamespace(world=World(0, 1), recipe=load_recipe(QUICKSTART, ["training.max_steps=null"]))
    with pytest.raises(ValueError, match=r"run of 2 process\(es\) that trains by epochs .* resume it with "
                                         r"--nproc-per-node 2, or set training.max_steps"):
        restore_sharded_trainer(by_epochs, load_sharded_checkpoint(reference))


def test_out_of_memory_on_rank_1_ends_both_ranks_with_one_line_and_keeps_the_checkpoint(interrupted):
    run_dir, (oom, _, _), ((folder, seconds), _, _) = interrupted
    assert oom.returncode == 1 and seconds <= 60
    errors = [line for line in oom.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: rank 1 ran out of memory at step {OOM_STEP} on input size (2, 8) "
                      "(injected: out of memory in backward); under training.parallel=fsdp a rank cannot retry a "
                      "step alone, so every rank stopped and the last checkpoint is kept: raise the budget or lower "
                      "the batch size or sequence length, or resume (the planner measures that size again before "
                      "trusting it)"], oom.stderr
    assert "Traceback" not in oom.stderr
    assert folder.name == "step-00000002"  # the last one before the failed step: nobody saved after it
    assert sizes_out_of_memory(run_dir) == [(2, 8)]


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_whole(interrupted, reference):
    run_dir, (_, written, switched), (_, after_write, after_switch) = interrupted
    assert written.returncode != 0 and switched.returncode != 0
    # Rank 1 killed while writing step 4: step 2 stays current, the cut folder is never read.
    assert after_write == (run_dir / "checkpoint" / "step-00000002",
                           [".step-00000004.tmp", "current", "step-00000002"])
    # Rank 0 killed between renaming step 6 and pointing to it: step 4 (saved by that run) is current.
    assert after_switch == (run_dir / "checkpoint" / "step-00000004", ["current", "step-00000004", "step-00000006"])
    planner = torch.load(run_dir / "checkpoint" / "step-00000004" / "rank1.pt", weights_only=True)["planner"]
    assert json.loads(planner)["steps"] == 4  # 2 restored from step 2's checkpoint, 2 trained since
    # Each resume continued from a whole checkpoint as the uninterrupted run did (its RNG too: dropout).
    expected = _losses(reference, "run")
    for tag, steps in (("write", range(2, 4)), ("switch", range(2, 6))):
        losses = _losses(run_dir, tag)
        assert sorted(losses) == list(steps)
        assert [losses[s] for s in steps] == pytest.approx([expected[s] for s in steps], rel=1e-5)


def _linear_trainer(mesh, features: int, layers: int = 1) -> SimpleNamespace:
    model = torch.nn.Sequential(*[torch.nn.Linear(features, features) for _ in range(layers)])
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    return SimpleNamespace(model=model, optimizer=optimizer, scaler=None, recipe=load_recipe(QUICKSTART),
                           scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                           planner=SimpleNamespace(state_dict=lambda: {"name": "none"}), device=torch.device("cpu"),
                           world=World(0, 1))


def test_a_checkpoint_of_another_model_or_with_non_finite_weights_is_refused_in_one_line(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        trainer = _linear_trainer(mesh, 2)
        save_sharded_checkpoint(tmp_path, trainer, Progress(step=1))
        folder = current_folder(tmp_path)
        with pytest.raises(ValueError, match=r"does not hold this recipe's model and optimizer \(Size mismatch .* "
                                             r"for model.0.weight\): the checkpoint is of another model"):
            load_sharded_model(_linear_trainer(mesh, 3).model, folder)
        with pytest.raises(ValueError, match=r"\(Missing key in checkpoint state_dict: model.1.weight.\)"):
            load_sharded_model(_linear_trainer(mesh, 2, layers=2).model, folder)
        with torch.no_grad():
            trainer.model[0].weight.fill_(float("nan"))
        save_sharded_checkpoint(tmp_path, trainer, Progress(step=2))
        with pytest.raises(ValueError, match=r"step-00000002 holds non-finite weights \(0.weight\): the run had diverged"):
            load_sharded_model(_linear_trainer(mesh, 2).model, current_folder(tmp_path))
    finally:
        dist.destroy_process_group()
