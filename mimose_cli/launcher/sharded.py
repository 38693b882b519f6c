"""Checkpoints of a ``fully_shard``ed (FSDP2) run: ``runs/<id>/checkpoint/``.

Each rank writes its own shard of the weights and of the optimizer's state with
``torch.distributed.checkpoint`` (``get_state_dict``: DTensor shards keyed by the model's own
parameter names), plus what is its own (``checkpoint.rank_state``: its RNG and its planner's
state) as ``rank<k>.pt``; rank 0 writes what the ranks share (``checkpoint.trainer_state``:
progress, scheduler, scaler, recipe, number of processes) as ``trainer.pt``.

A kill at any moment leaves the previous checkpoint whole, as ``checkpoint.save_checkpoint`` does
for one file: the ranks write into ``checkpoint/.step-<N>.tmp/``, wait for each other (a barrier:
every rank's files fsynced), then rank 0 renames the folder to ``step-<N>`` and makes it current by
replacing the one-line file ``checkpoint/current`` atomically (temporary file, fsync,
``os.replace``, fsync of the folder); only then are older folders removed. A reader follows
``current`` alone, so a folder cut short, or one finished whose ``current`` was not yet replaced,
is never read; the next save removes it.

Another number of processes: DCP reshards the weights and the optimizer's state to any number of
ranks (``load_sharded_model`` loads them into a model sharded over any mesh), so ``--resume``
continues on any number. What belonged to the old ranks' places does not carry over: the data
position is kept as a count of the epoch's examples (``Progress.regrouped``: global batches are
``training.batch_size`` x processes), each rank's planner starts afresh (it measured another shard
size) and each rank's RNG is seeded from (seed, step, rank). The run then goes on as a run of the
new size would, not as the old one would have.

The final model is gathered on rank 0 (``StateDictOptions(full_state_dict=True,
cpu_offload=True)``: one full tensor at a time on the device, the whole on the host) and written as
``checkpoint.save_model`` writes an unsharded one (Hugging Face safetensors).
"""

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mimose_cli.launcher.checkpoint import (
    FORMAT,
    Progress,
    check_trainer_state,
    fsync_dir,
    rank_state,
    save_model,
    trainer_state,
    write_durably,
)
from mimose_cli.runs.rundir import SHARDED_CHECKPOINT
from mimose_cli.runs.rundir import SHARDED_CURRENT as CURRENT

TRAINER_FILE = "trainer.pt"


def _barrier(world) -> None:
    if world.distributed:
        dist.barrier()


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def save_sharded_checkpoint(run_dir, trainer, progress: Progress) -> Path:
    """Every rank: write the trainer's state at ``progress`` (an optimizer-step boundary), each
    rank its shard, and make it the run's current checkpoint once every rank's files are on disk;
    returns its folder. Collective: every rank calls it at the same step."""
    world = trainer.world
    root = Path(run_dir) / SHARDED_CHECKPOINT
    name = f"step-{progress.step:08d}"
    tmp = root / f".{name}.tmp"
    if world.is_main:
        root.mkdir(exist_ok=True)
        _remove_stale(root, keep=current_folder(run_dir))
        tmp.mkdir()
    _barrier(world)  # the folder exists, and no stale copy is being removed under a writer
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    with _checkpoint_errors(tmp):
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)  # fsyncs its files
    write_durably(tmp / _rank_file(world.rank), rank_state(trainer))
    if world.is_main:
        write_durably(tmp / TRAINER_FILE, trainer_state(trainer, progress, world.size))
    _barrier(world)  # every rank's files are written: the folder is whole
    if world.is_main:
        final = root / name
        assert final != current_folder(run_dir), "a step is checkpointed once"
        shutil.rmtree(final, ignore_errors=True)  # a whole folder a kill kept from becoming current
        os.replace(tmp, final)
        _point_to(root, name)
        _remove_stale(root, keep=final)
    _barrier(world)  # no rank goes on (or is told the checkpoint exists) before it is current
    return root / name


def _point_to(root: Path, name: str) -> None:
    """Make ``root/name`` current: ``root/current`` replaced atomically and durably."""
    tmp = root / f".{CURRENT}.tmp"
    with open(tmp, "w") as file:
        file.write(name + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, root / CURRENT)
    fsync_dir(root)


def _remove_stale(root: Path, keep: Path | None) -> None:
    """Every folder of ``root`` but ``keep``: earlier checkpoints, and writes a kill cut short."""
    for path in root.iterdir():
        if path.is_dir() and path != keep:
            shutil.rmtree(path, ignore_errors=True)


def current_folder(run_dir) -> Path | None:
    """The folder of the run's current sharded checkpoint, or None when it has none."""
    root = Path(run_dir) / SHARDED_CHECKPOINT
    try:
        name = (root / CURRENT).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return root / name


def load_sharded_checkpoint(run_dir) -> dict:
    """What rank 0 wrote of the run's current sharded checkpoint (``trainer.pt``), with
    ``folder``: where the shards are. ValueError naming the folder when it cannot be read."""
    folder = current_folder(run_dir)
    if folder is None:
        raise ValueError(f"{run_dir} has no sharded checkpoint ({SHARDED_CHECKPOINT}/{CURRENT}): the run stopped "
                         "before its first checkpoint (training.checkpoint_every); start it again instead of resuming")
    try:
        state = torch.load(folder / TRAINER_FILE, map_location="cpu", weights_only=True)
    except Exception:  # torch's own advice (weights_only=False) is wrong for a corrupt file, and unsafe
        raise ValueError(f"{folder} is not a checkpoint mimose wrote, or is corrupt (cut off, overwritten); "
                         "start the run again") from None
    if state.get("format") != FORMAT:
        raise ValueError(f"{folder / TRAINER_FILE} has format {state.get('format')!r}, this mimose reads {FORMAT}")
    return {**state, "folder": str(folder)}


@contextlib.contextmanager
def _checkpoint_errors(folder: Path):
    """DCP's ``CheckpointException`` (a BaseException holding every rank's traceback) as what the
    launcher handles: a failed write (a full disk) as its OSError, anything else as it was."""
    try:
        yield
    except CheckpointException as error:
        failures = [exception for exception, _ in error.failures.values()]
        written = next((e for e in failures if isinstance(e, OSError)), None)
        if written is not None:
            raise OSError(written.errno, written.strerror or str(written), str(folder)) from None
        raise failures[0] if failures else error


def _dcp_load(state: dict, folder: Path) -> None:
    try:
        with _checkpoint_errors(folder):
            dcp.load(state, checkpoint_id=folder)
    except (RuntimeError, ValueError, KeyError) as error:  # names or shapes that are not this model's
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{folder} does not hold this recipe's model and optimizer ({first[:300]}): the checkpoint "
                         "is of another model (was recipe.yaml edited?); resume with the recipe it was trained with") from None


def load_sharded_model(model: torch.nn.Module, folder) -> None:
    """The weights of the checkpoint ``folder`` into ``model``, ``fully_shard``ed over any number
    of ranks (DCP reshards); ValueError when they are not this model's or not finite."""
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, Path(folder))
    set_model_state_dict(model, state["model"])
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(_local(p)).all()]
    flag = torch.tensor([int(bool(bad))])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank refuses together, or none
    if flag.item():
        where = bad[0] if bad else "another rank's shard"
        raise ValueError(f"{folder} holds non-finite weights ({where}): the run had diverged when it was saved; "
                         "start the run again (with a lower training.lr if it diverged)")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def resharded(checkpoint: dict, world) -> bool:
    """Whether ``checkpoint`` was written by another number of processes than ``world``'s."""
    return checkpoint.get("world_size") != world.size


def restore_sharded_trainer(trainer, checkpoint: dict) -> Progress:
    """Every rank: the sharded checkpoint's weights, scheduler, scaler and this rank's planner
    state into a freshly built (sharded) trainer; returns where the run stands. The optimizer's
    state and the RNG come back just before the first step (``restore_sharded_step_state``). On
    another number of processes the weights reshard, the planner starts afresh and the data
    position is regrouped (``Progress.regrouped``)."""
    world, saved = trainer.world, checkpoint.get("world_size")
    if resharded(checkpoint, world) and trainer.recipe.training.max_steps is None:
        raise ValueError(f"the checkpoint was written by a run of {saved} process(es) that trains by epochs "
                         f"(training.max_steps unset); on {world.size} its steps hold other numbers of examples, so "
                         f"its step count and learning-rate schedule would not follow: resume it with --nproc-per-node "
                         f"{saved}, or set training.max_steps (the steps to reach)")
    check_trainer_state(trainer, checkpoint)
    folder = Path(checkpoint["folder"])
    load_sharded_model(trainer.model, folder)
    trainer.scheduler.load_state_dict(checkpoint["scheduler"])
    if trainer.scaler is not None and checkpoint["scaler"] is not None:
        trainer.scaler.load_state_dict(checkpoint["scaler"])
    progress = Progress(**checkpoint["progress"])
    if resharded(checkpoint, world):  # the planners measure afresh, the data position is kept in examples
        progress = progress.regrouped(trainer.recipe.training.batch_size, saved, world.size)
    else:
        trainer.planner.load_state_dict(json.loads(_rank_state(folder, world.rank)["planner"]))
    trainer.step = progress.step
    return progress


def _rank_state(folder: Path, rank: int) -> dict:
    try:
        return torch.load(folder / _rank_file(rank), map_location="cpu", weights_only=True)
    except Exception:
        raise ValueError(f"{folder / _rank_file(rank)} is missing or corrupt: the checkpoint is incomplete; "
                         "start the run again") from None


def restore_sharded_step_state(trainer, checkpoint: dict) -> None:
    """Put back this rank's shard of the optimizer's state (resharded by DCP where the number of
    processes changed) and its RNG (seeded from (seed, step, rank) then), right before the first
    step (as ``checkpoint.restore_step_state``). Collective."""
    folder = Path(checkpoint["folder"])
    state = {"optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)}
    _dcp_load(state, folder)
    set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"])
    trainer.meter.track(trainer.optimizer)
    world = trainer.world
    if resharded(checkpoint, world):  # no rank's RNG is this rank's
        # (a tuple of ints hashes alike in every process)
        torch.manual_seed(hash((trainer.recipe.seed, checkpoint["progress"]["step"], world.rank)) % 2**63)
        return
    rng = _rank_state(folder, world.rank)["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_sharded_model(model: torch.nn.Module, run_dir, world) -> Path | None:
    """Every rank: the full weights gathered on rank 0 (on the host), which writes them as
    ``checkpoint.save_model`` does; returns the model folder on rank 0. Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)  # empty on the other ranks
    path = save_model(model, run_dir, state_dict=full) if world.is_main else None
    _barrier(world)
    return path
