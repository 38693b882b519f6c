"""Training checkpoints (``runs/<id>/checkpoint.pt``, what ``mimose train --resume`` continues
from) and the trained model (``runs/<id>/model/``, Hugging Face format).

A checkpoint is taken only at an optimizer-step boundary, where the model, optimizer, scheduler,
GradScaler, RNG, data position and planner agree; resuming from it trains the next step exactly
as the uninterrupted run would have (the loss sequence is bit for bit the same on the CPU). It is
one file written atomically (a temporary file in the run directory, fsync, ``os.replace``), so a
kill or a full disk mid-write leaves the previous checkpoint whole; only the last one is kept.
It holds tensors and plain containers only and is read with ``torch.load(weights_only=True)``;
the planner's state is kept as the JSON text ``planner.save`` would write.

RNG: only torch's generators (CPU, and every CUDA device in use) are saved. The data order is
drawn from generators seeded by (seed, epoch) (``data.synthetic.data_rng``), not from numpy's or
Python's global state, which nothing in a run draws from.

A multi-process run (``torchrun``) is checkpointed by rank 0: the weights, optimizer and
scheduler are the same on every rank after a step, while the RNG and the planner are each rank's
own, so the other ranks' (``rank_state``) go in ``other_ranks``, and ``world_size`` says how many
processes a resume needs.
"""

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from mimose_cli.files import disk_errors, file_mode
from mimose_cli.launcher.recipe import recipe_to_dict
from mimose_cli.launcher.resume import RESUMABLE_KEYS, changed_key
from mimose_cli.runs.rundir import CHECKPOINT

MODEL_DIR = "model"
FORMAT = 1


@dataclass
class Progress:
    """Where a run stands at a checkpoint: what a resume continues from."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Pass over the data the next micro-batch comes from."""
    batch: int = 0
    """Batches of ``epoch`` already trained."""
    wall_s: float = 0.0
    """Wall time of the run so far, earlier segments of a resumed run included."""
    resumed_from_steps: list = field(default_factory=list)
    """The step each earlier resume started from."""

    @classmethod
    def at_step(cls, step: int, micro_batches_per_step: int, batches_per_epoch: int, **kwargs) -> "Progress":
        """The position after ``step`` optimizer steps of ``micro_batches_per_step`` batches each."""
        epoch, batch = divmod(step * micro_batches_per_step, batches_per_epoch)
        return cls(step=step, epoch=epoch, batch=batch, **kwargs)

    def advanced(self, step: int, micro_batches_per_step: int, batches_per_epoch: int, **kwargs) -> "Progress":
        """The position after ``step`` optimizer steps, the ones after this one's of
        ``micro_batches_per_step`` batches each (``at_step`` from a start that was not: a resume on
        another number of processes, whose batches before it were of another size)."""
        done = self.epoch * batches_per_epoch + self.batch + (step - self.step) * micro_batches_per_step
        epoch, batch = divmod(done, batches_per_epoch)
        return Progress(step=step, epoch=epoch, batch=batch, **kwargs)

    def regrouped(self, batch_size: int, saved_processes: int, processes: int) -> "Progress":
        """This position in global batches of ``batch_size`` x ``processes`` examples, from one in
        batches of ``batch_size`` x ``saved_processes``: as many of the epoch's examples as were
        trained are left out (rounded down to whole batches: a few may be trained again). They are
        the same examples where the epoch's order does not depend on the batch size, other ones
        with ``data.group_by_length`` (the epoch is grouped anew)."""
        examples = self.batch * batch_size * saved_processes
        return replace(self, batch=examples // (batch_size * processes))


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rank_state(trainer) -> dict:
    """What is a rank's own in a checkpoint: its RNG and its planner's state (as JSON text)."""
    return {"rng": _rng_state(trainer.device),
            "planner": json.dumps(trainer.planner.state_dict(), allow_nan=False)}


def _rank_part(checkpoint: dict, rank: int) -> dict:
    return checkpoint if rank == 0 else checkpoint["other_ranks"][rank - 1]


def restore_step_state(trainer, checkpoint: dict, rank: int = 0) -> None:
    """Put back what the next step reads besides the weights: the optimizer's state and the RNG.
    Called right before the first step, after the budget checks and ``planner.prepare``, which
    then see the optimizer's state as still to come, as in a new run (it is counted once it is
    here), and may draw from the RNG."""
    trainer.optimizer.load_state_dict(checkpoint["optimizer"])
    trainer.meter.track(trainer.optimizer)
    rng = _rank_part(checkpoint, rank)["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_checkpoint(run_dir: Path, trainer, progress: Progress, other_ranks: list = ()) -> Path:
    """Write the trainer's state at ``progress`` (an optimizer-step boundary) atomically, with
    the ``rank_state`` of every other rank of a multi-process run."""
    state = {
        **trainer_state(trainer, progress, world_size=1 + len(other_ranks)),
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        **rank_state(trainer),
        "other_ranks": list(other_ranks),
    }
    path = Path(run_dir) / CHECKPOINT
    tmp = path.with_name(f".{CHECKPOINT}.tmp")
    try:
        write_durably(tmp, state)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def trainer_state(trainer, progress: Progress, world_size: int) -> dict:
    """What every rank shares in a checkpoint besides the weights and the optimizer's state."""
    return {"format": FORMAT, "progress": asdict(progress), "scheduler": trainer.scheduler.state_dict(),
            "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
            "recipe": json.dumps(recipe_to_dict(trainer.recipe)), "world_size": world_size}


def write_durably(path: Path, state) -> None:
    """``torch.save(state)`` to ``path``, on disk when this returns (fsync)."""
    with open(path, "wb") as file, disk_errors(path):
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a power cut after ``os.replace`` could lose it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(run_dir: Path) -> dict:
    """The checkpoint of a run directory (tensors on the CPU); ValueError naming the file when
    there is none or it cannot be read."""
    path = Path(run_dir) / CHECKPOINT
    (Path(run_dir) / f".{CHECKPOINT}.tmp").unlink(missing_ok=True)  # a write cut off by a kill
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a checkpoint file; move it away and start the run again")
    if not path.is_file():
        raise ValueError(f"{run_dir} has no {CHECKPOINT}: the run stopped before its first checkpoint "
                         "(training.checkpoint_every); start it again instead of resuming")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torch's own advice (weights_only=False) is wrong for a corrupt file, and unsafe
        raise ValueError(f"{path} is not a checkpoint mimose wrote, or is corrupt (cut off, overwritten); "
                         "start the run again") from None
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} has format {state.get('format')!r}, this mimose reads {FORMAT}")
    _check_finite(path, state.get("model"))
    return state


def _check_finite(path: Path, weights) -> None:
    """Weights that are NaN or infinite would make every loss NaN, which the run would then blame
    on the learning rate; say it is the checkpoint instead."""
    for name, tensor in (weights.items() if isinstance(weights, dict) else ()):
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            what = "NaN" if torch.isnan(tensor).any() else "infinite values"
            raise ValueError(f"{path} holds non-finite weights ({name} has {what}): the run had diverged "
                             "when it was saved; start the run again (with a lower training.lr if it diverged)")


_ENTRIES = ("progress", "model", "optimizer", "scheduler", "scaler")
_RANK_ENTRIES = ("rng", "planner")


def check_checkpoint(trainer, checkpoint: dict, rank: int = 0) -> None:
    """Everything a resume will read of ``checkpoint``, checked against the recipe's trainer before
    anything is loaded or any file changed: each entry there, the weights' names and shapes those
    of this model, the optimizer's groups those of this optimizer. ValueError naming what differs."""
    part = _rank_part(checkpoint, rank) if rank == 0 or len(checkpoint.get("other_ranks", ())) >= rank else {}
    missing = [key for key in _ENTRIES if key not in checkpoint] + [key for key in _RANK_ENTRIES if key not in part]
    if missing:
        raise ValueError(f"the checkpoint has no {missing[0]} entry: it is incomplete (written by something "
                         "else than mimose train?); start the run again")
    ours, saved = trainer.model.state_dict(), checkpoint["model"]
    for name in sorted(set(ours) | set(saved)):
        if name not in saved or name not in ours:
            where = "this recipe's model" if name in ours else "the checkpoint"
            raise ValueError(f"{name} is in {where} only: the checkpoint is of another model (was "
                             "recipe.yaml edited?); resume with the recipe it was trained with")
        if tuple(saved[name].shape) != tuple(ours[name].shape):
            raise ValueError(f"{name} has shape {tuple(saved[name].shape)} in the checkpoint and "
                             f"{tuple(ours[name].shape)} in this recipe's model: the checkpoint is of another "
                             "model (was recipe.yaml edited?); resume with the recipe it was trained with")
    groups = checkpoint["optimizer"].get("param_groups", [])
    if [len(g.get("params", ())) for g in groups] != [len(g["params"]) for g in trainer.optimizer.param_groups]:
        raise ValueError("the checkpoint's optimizer holds other parameter groups than this recipe's; "
                         "the checkpoint is of another model or optimizer")
    check_trainer_state(trainer, checkpoint)


def check_trainer_state(trainer, checkpoint: dict) -> None:
    """The checkpoint's progress is one mimose writes and its recipe the trainer's (but
    ``RESUMABLE_KEYS``); ValueError naming what differs."""
    if set(checkpoint["progress"]) != {f.name for f in fields(Progress)}:
        raise ValueError("the checkpoint's progress entry is not one mimose writes; start the run again")
    # The recipe it resumes with is the one it was trained with (an edited recipe.yaml would claim
    # settings the run never had); checkpoints of earlier releases do not hold it.
    changed = changed_key(json.loads(checkpoint["recipe"]), recipe_to_dict(trainer.recipe)) if (
        "recipe" in checkpoint) else None
    if changed is not None:
        key, trained, now = changed
        raise ValueError(f"{key} is {now!r} in the recipe now but the run was trained with {trained!r} "
                         "(recipe.yaml edited?); resume with the recipe it was trained with: only "
                         f"{', '.join(RESUMABLE_KEYS)} may change")


def restore_trainer(trainer, checkpoint: dict, rank: int = 0, world_size: int = 1) -> Progress:
    """Load the checkpoint's weights, scheduler, scaler and rank ``rank``'s planner state into a
    freshly built trainer; returns where the run stands. The optimizer's state and the RNG come
    back just before the first step (``restore_step_state``). ValueError when the checkpoint was
    written by another number of processes (the global batch, and each rank's state, depend on it)."""
    saved = checkpoint.get("world_size", 1)
    if saved != world_size:
        raise ValueError(f"the checkpoint was written by a run of {saved} process(es) and this run has "
                         f"{world_size}; resume it with {saved} (torchrun --nproc_per_node {saved})")
    check_checkpoint(trainer, checkpoint, rank)
    trainer.model.load_state_dict(checkpoint["model"])
    trainer.scheduler.load_state_dict(checkpoint["scheduler"])
    if trainer.scaler is not None and checkpoint["scaler"] is not None:
        trainer.scaler.load_state_dict(checkpoint["scaler"])
    trainer.planner.load_state_dict(json.loads(_rank_part(checkpoint, rank)["planner"]))
    progress = Progress(**checkpoint["progress"])
    trainer.step = progress.step
    return progress


def save_model(model, run_dir: Path, state_dict: dict | None = None) -> Path:
    """The trained model in Hugging Face format (``save_pretrained``, safetensors) in
    ``run_dir/model``, replacing what an earlier segment of the run left there; ``state_dict``:
    the weights to write when the model's own are shards (``sharded.save_sharded_model``)."""
    from transformers.utils import logging as hf_logging

    final = Path(run_dir) / MODEL_DIR
    tmp = final.with_name(f".{MODEL_DIR}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for the one shard a run writes says nothing
    try:
        with disk_errors(tmp):
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    for path in tmp.iterdir():  # transformers writes some files 0600 (through a temporary file)
        os.chmod(path, file_mode())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final
