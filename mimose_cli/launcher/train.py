"""The training run: setup -> train -> cleanup, one planner deciding each step's checkpointing.

``step.py`` holds what one step needs (the ``Trainer`` and a micro-batch under the planner);
this module builds the run around it: data, pre-flight, the loop with its checkpoints,
evaluation and stop requests, and the run directory. Under ``torchrun`` rank 0 writes the run
directory (``distributed.py`` says how the ranks agree).
"""

import contextlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path

import torch
import transformers

from mimose_cli.launcher.checkpoint import (
    MODEL_DIR,
    Progress,
    load_checkpoint,
    rank_state,
    restore_step_state,
    restore_trainer,
    save_checkpoint,
    save_model,
)
from mimose_cli.launcher.data.dataset import build_dataset, build_validation
from mimose_cli.launcher.data.loader import build_dataloader, build_eval_loader, make_batch, max_input_size
from mimose_cli.launcher.distributed import (
    SilentWriter,
    World,
    all_ranks,
    any_rank,
    broadcast_model,
    first_error,
    from_main,
    process_group,
    quiet_unless_main,
)
from mimose_cli.launcher.evaluate import eval_line, evaluate
from mimose_cli.launcher.failures import RankOutOfMemory, sizes_out_of_memory, stopped_by
from mimose_cli.launcher.models import model_config
from mimose_cli.launcher.preflight import (
    BudgetRange,
    HostMemoryError,
    budget_error,
    budget_problem,
    budget_warning,
    check_model_state,
    optimizer_state_bytes,
    preflight,
)
from mimose_cli.launcher.recipe import Recipe, recipe_yaml
from mimose_cli.launcher.resume import cut_records
from mimose_cli.launcher.sharded import (
    load_sharded_checkpoint,
    resharded,
    restore_sharded_step_state,
    restore_sharded_trainer,
    save_sharded_checkpoint,
    save_sharded_model,
)
from mimose_cli.launcher.sharding import is_sharded
from mimose_cli.launcher.signals import EXIT_CODES, StopRequest
from mimose_cli.launcher.spawn import stop_with_agent
from mimose_cli.launcher.step import ALLOCATOR_SETTINGS, Trainer, autocast, build_trainer, micro_batch, resolve_device
from mimose_cli.memory import SavedBytesCounter
from mimose_cli.planners.inputs import with_padding
from mimose_cli.runs.live import ProgressView, check_view, new_console
from mimose_cli.runs.records import StepRecord
from mimose_cli.runs.rundir import RunLock, RunWriter, check_out_dir, new_run_dir
from mimose_cli.runs.summary import summarize, summary_tables
from mimose_cli.runs.tblog import TENSORBOARD_DIR
from mimose_cli.units import format_budget


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    records: list[StepRecord] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The command's exit status: 0 completed, 1 out of memory, a diverged loss or a failed write, 130 / 143
        stopped by Ctrl-C / SIGTERM (what a shell reports for a process those signals end)."""
        status = self.summary["status"]
        if status == "interrupted":
            return EXIT_CODES.get(self.summary.get("signal"), EXIT_CODES["SIGINT"])
        return {"completed": 0, "oom": 1, "diverged": 1, "failed": 1}[status]


def environment(device) -> dict:
    """Versions and device, for env.json."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["allocator"] = {name: os.environ[name] for name in ALLOCATOR_SETTINGS if name in os.environ}
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def divergence_error(record: StepRecord, recipe: Recipe, model, updated: bool) -> str:
    """Why a run whose loss stopped being finite ended, and what to change: the learning rate
    only when an update came before (``updated``); else the weights it started from, or the
    forward itself."""
    if updated:
        return (f"loss became {record.loss} at step {record.step}: training diverged; lower training.lr "
                f"(now {recipe.training.lr:g})")
    if any(not torch.isfinite(p).all() for p in model.parameters()):
        source = (f"model.pretrained={recipe.model.pretrained!r}" if recipe.model.pretrained
                  else "the checkpoint or model.config_overrides")
        return (f"loss is {record.loss} at step {record.step}, before any update: the model's weights hold "
                f"NaN or inf (from {source}); load finite weights")
    return (f"loss is {record.loss} at step {record.step}, before any update: the forward computes it from "
            f"finite weights (an overflow: try training.precision=fp32 or bf16, or check the data)")


def total_steps_of(recipe: Recipe, batches_per_epoch: int) -> int:
    """Optimizer steps in the run (each of ``gradient_accumulation_steps`` micro-batches)."""
    if recipe.training.max_steps is not None:
        return recipe.training.max_steps
    training = recipe.training
    if 0 < training.epochs * batches_per_epoch < training.gradient_accumulation_steps:
        raise ValueError(
            f"training.gradient_accumulation_steps={training.gradient_accumulation_steps} needs that many batches "
            f"for one optimizer step, but training.epochs={training.epochs} of {batches_per_epoch} batches hold "
            f"{training.epochs * batches_per_epoch}: lower it, raise training.epochs, or set training.max_steps "
            "to train across epochs")
    return max(1, training.epochs * batches_per_epoch // training.gradient_accumulation_steps)


def _data_batches(recipe: Recipe, dataset, config, micro_batches: int, first_loader, start: Progress,
                  world_size: int = 1):
    """Yield (epoch, batch) for ``micro_batches`` micro-batches (global ones under torchrun) from
    the data position ``start``; the order depends only on (seed, epoch), so a resumed run sees
    the batches it would have."""
    produced, epoch, skip = 0, start.epoch, start.batch
    while produced < micro_batches:
        fresh = (epoch, skip) == (0, 0)
        loader = first_loader if fresh else build_dataloader(recipe, dataset, config, epoch, skip, world_size)
        if loader.batches_per_epoch == 0:
            raise ValueError("the data set yields no batch; raise data.num_examples or lower training.batch_size")
        for batch in loader:
            if produced >= micro_batches:
                return
            yield epoch, batch
            produced += 1
        epoch, skip = epoch + 1, 0


@dataclass
class LoopEnd:
    """How the training loop ended."""

    records: list = field(default_factory=list)
    status: str = "completed"
    """completed, oom, diverged (the loss stopped being finite), interrupted (a signal or Ctrl-C)
    or failed (the run directory could not be written: a full disk)."""
    at_boundary: bool = True
    """Whether the trainer stands at an optimizer-step boundary, where a checkpoint is exact; not
    after a second Ctrl-C, which may land anywhere, nor after a failed write (a trained step may
    lack its record)."""
    error: str | None = None
    failed_rank: int | None = None
    """The rank whose failure ended every rank (``failures.py``), when known."""


def _loop(trainer: Trainer, batches, writer: RunWriter, view: ProgressView, stop: StopRequest,
          checkpoint, evaluate=None) -> LoopEnd:
    """Train until the data ends, a step (or an evaluation) runs out of memory for good, a signal
    asks to stop, or the run directory cannot be written. ``batches`` yields micro-batches; every
    ``gradient_accumulation_steps`` of them make a step, after which ``evaluate(record)`` (when
    given) may fill the step's record before it is written, and ``checkpoint()`` (when given) is
    called every ``training.checkpoint_every`` steps; a stop request is honoured between steps."""
    end = LoopEnd()
    world = trainer.world
    counter = SavedBytesCounter(exclude=trainer.model.parameters())
    accumulation = trainer.recipe.training.gradient_accumulation_steps
    every = trainer.recipe.training.checkpoint_every if checkpoint else None
    try:
        for index, (epoch, batch) in enumerate(batches):
            micro_step = index % accumulation
            # Also a signal before the first step; under torchrun, one rank's stops them all.
            if micro_step == 0 and any_rank(stop.requested, world, trainer.device):
                end.status = "interrupted"
                break
            end.at_boundary = False
            record = micro_batch(trainer, batch, counter, micro_step)
            if record.oom:
                end.status = "oom"
            record.epoch = epoch
            view.update(record)
            if evaluate is not None and end.status != "oom" and micro_step == accumulation - 1:
                end.error = evaluate(record)  # None, or why evaluating ran out of memory
            end.records.append(record)
            writer.metric(record)
            writer.plan(record)
            if end.status == "oom":
                end.error = record.error
                view.message(f"[red]step {record.step} ran out of memory[/red]: {record.error}")
                break
            if end.error is not None:
                end.status = "oom"
                view.message(f"[red]{end.error}[/red]")
                break
            if not math.isfinite(record.loss):  # before any checkpoint: never save NaN weights
                end.status, end.at_boundary = "diverged", False
                end.error = divergence_error(record, trainer.recipe, trainer.model, updated=trainer.step > 0)
                view.message(f"[red]{end.error}[/red]")
                break
            if micro_step == accumulation - 1:
                trainer.step += 1
                end.at_boundary = True
                if every and trainer.step % every == 0:
                    checkpoint()
    except (RankOutOfMemory, RuntimeError) as error:  # no collective, and no checkpoint, after these
        stopped = stopped_by(error, writer.path, world.rank, trainer.step)
        if stopped is None:
            raise
        end.status, end.error, end.failed_rank, end.at_boundary = *astuple(stopped), False
    except KeyboardInterrupt:
        end.status = "interrupted"
        # Under torchrun a rank stopped at once may have left the others inside a collective: no
        # checkpoint (a collective too).
        end.at_boundary = end.at_boundary and not world.distributed
    except OSError as error:
        end.status, end.at_boundary = "failed", False
        end.error = f"writing {writer.path} failed: {error}"
        view.message(f"[red]{end.error}[/red]")
    return end


@dataclass
class Run:
    """One run's parts, built before the first step: a new run, or one resumed from a checkpoint."""

    recipe: Recipe
    config: object
    dataset: object
    first_loader: object
    total_steps: int
    trainer: Trainer
    run_dir: Path
    start: Progress
    """Where training starts: step 0, or the checkpoint's position."""
    checkpoint: dict | None = None
    records: list = field(default_factory=list)
    """Records of the steps before ``start`` (a resumed run's earlier segments)."""
    checkpoint_step: int | None = None
    """The step of the run directory's checkpoint (None: it has none yet)."""
    preflight: BudgetRange | None = None
    """The budgets the recipe needs, measured before the first step (``preflight``)."""
    saves: bool = True
    """Whether checkpoints and the trained model are written (not for ``compare``'s runs)."""
    validation: object = None
    """The validation batches (``build_eval_loader``); None without a validation split."""
    finish_only: bool = False
    """A resumed run that had trained every step but whose final save was cut (a second Ctrl-C
    while writing the model): nothing to train, only the model and the summary to write."""

    @property
    def resumed_from_steps(self) -> list:
        """The step each resume of this run started from, this one included."""
        return self.start.resumed_from_steps + ([self.start.step] if self.checkpoint else [])

    def save_checkpoint(self, segment_s: float) -> None:
        """Checkpoint the trainer where it stands (an optimizer-step boundary), ``segment_s``
        seconds into this segment of the run."""
        progress = self.start.advanced(  # from the start: its batches may have been of another size
            self.trainer.step, self.recipe.training.gradient_accumulation_steps,
            self.first_loader.batches_per_epoch, wall_s=self.start.wall_s + segment_s,
            resumed_from_steps=self.resumed_from_steps)
        world = self.trainer.world
        if is_sharded(self.trainer.model):  # training.parallel=fsdp: every rank writes its shard
            save_sharded_checkpoint(self.run_dir, self.trainer, progress)
        else:
            others = all_ranks(rank_state(self.trainer), world)[1:] if world.distributed else []
            if world.is_main:
                save_checkpoint(self.run_dir, self.trainer, progress, others)
        self.checkpoint_step = self.trainer.step


def _setup(recipe: Recipe, out_dir, recipe_name: str, resume, view: ProgressView, world: World = World()) -> Run:
    """Build the run; when resuming, load the checkpoint into it and cut the run directory's
    records back to it (the steps after it are trained again). Under torchrun every rank builds
    its own, rank 0 creates the run directory (and cuts its records)."""
    config = model_config(recipe)
    dataset = build_dataset(recipe, config)
    examples = build_validation(recipe, config)
    validation = None if examples is None else build_eval_loader(recipe, examples, config)
    first_loader = build_dataloader(recipe, dataset, config, epoch=0, world_size=world.size)
    total = total_steps_of(recipe, len(first_loader))
    view.setup(f"data ready: {recipe.data.source} {recipe.task}, {len(dataset)} examples, "
               f"{len(first_loader)} batches of {recipe.training.batch_size * world.size} per epoch; {total} steps"
               + ("" if examples is None else f"; {len(examples)} validation examples"))
    trainer = build_trainer(recipe, config, total, world, say=view.setup)
    if resume is None:
        run_dir = new_run_dir(out_dir or recipe.out_dir, recipe_name, recipe.planner.name) if world.is_main else None
        run_dir = from_main(run_dir, world)
        return Run(recipe, config, dataset, first_loader, total, trainer, run_dir, Progress(),
                   validation=validation)
    run_dir = Path(resume)
    if is_sharded(trainer.model):
        checkpoint = load_sharded_checkpoint(run_dir)
        start = restore_sharded_trainer(trainer, checkpoint)
        if resharded(checkpoint, world):
            view.setup(f"resuming on {world.size} processes a run of {checkpoint.get('world_size')}: weights and "
                       "optimizer state resharded, the data position kept in examples, each rank's planner "
                       "measuring afresh")
    else:
        checkpoint = load_checkpoint(run_dir)
        start = restore_trainer(trainer, checkpoint, world.rank, world.size)
    finish_only = start.step >= total and not _saved_whole(run_dir)
    if start.step >= total and not finish_only:
        raise ValueError(f"{run_dir} has trained {start.step} of training.max_steps={total} steps already; "
                         "raise training.max_steps to train further")
    records = cut_records(run_dir, start.step, recipe.training.gradient_accumulation_steps) if world.is_main else []
    return Run(recipe, config, dataset, first_loader, total, trainer, run_dir, start, checkpoint, records,
               checkpoint_step=start.step, validation=validation, finish_only=finish_only)


def _saved_whole(run_dir: Path) -> bool:
    """Whether a run's final save got through: the model and a summary that says completed."""
    summary = run_dir / "summary.json"
    try:
        completed = json.loads(summary.read_text()).get("status") == "completed"
    except (OSError, ValueError, AttributeError):
        completed = False
    return completed and (run_dir / MODEL_DIR).is_dir()


def _train(run: Run, writer: RunWriter, view: ProgressView, stop: StopRequest, clock: float) -> LoopEnd:
    """Check the model's state and the largest step fit (pre-flight), let the planner prepare,
    and run the loop."""
    trainer, recipe = run.trainer, run.recipe
    with trainer.meter.activate():
        state_bytes, error = check_model_state(trainer)
        if error is None:
            try:
                run.preflight = preflight(trainer, run.config, state_bytes)
            except HostMemoryError as host:  # ends the run as a budget it cannot hold does
                error = str(host)
            else:
                error = budget_error(recipe.budget_bytes, run.preflight, recipe.budget)
            if error is None:  # else the error says it
                view.setup(f"pre-flight: {run.preflight.describe()}")
                warning = budget_warning(recipe.budget_bytes, run.preflight, recipe.budget)
                if warning is not None:
                    view.setup(f"pre-flight: {warning}")
        error = first_error(error, trainer.world)  # one rank that cannot train stops them all
        if error is not None:  # the run's error: the command prints it
            return LoopEnd(status="oom", at_boundary=False, error=error)
        trainer.planner.prepare(lambda size: with_padding(make_batch(recipe, run.config, size)),
                                max_input_size(recipe), state_bytes,
                                step_fn=trainer.step_fn(SavedBytesCounter(exclude=list(trainer.model.parameters()))))
        note = trainer.planner.prepared_note()
        if note:
            view.setup(note)
        if run.checkpoint is not None and is_sharded(trainer.model):
            restore_sharded_step_state(trainer, run.checkpoint)
        elif run.checkpoint is not None:
            restore_step_state(trainer, run.checkpoint, trainer.world.rank)
        if run.checkpoint is not None:  # the estimate that planned a step out of memory was wrong there
            for size in sizes_out_of_memory(run.run_dir):
                trainer.planner.policy.distrust(size)
        accumulation = recipe.training.gradient_accumulation_steps
        micro_batches = (run.total_steps - run.start.step) * accumulation
        batches = _data_batches(recipe, run.dataset, run.config, micro_batches, run.first_loader, run.start,
                                trainer.world.size)
        checkpoint = (lambda: run.save_checkpoint(time.perf_counter() - clock)) if run.saves else None
        view.begin(run.total_steps, run.start.step)
        evaluation = (lambda record: _evaluate(run, record, view)) if run.validation is not None else None
        return _loop(trainer, batches, writer, view, stop, checkpoint, evaluation)


def _evaluate(run: Run, record: StepRecord, view: ProgressView) -> str | None:
    """Evaluate on the validation split after the step of ``record`` when it is due (every
    ``training.eval_every`` steps, and after the last), its figures into the record and a line to
    the view; returns why the run must end when evaluating ran out of memory, else None. The
    step's ``iter_ms`` stays the step's alone, so planners compare as without evaluation. Under
    torchrun every rank evaluates the whole split (the same weights: the same figures) and the
    ranks agree on whether it fitted."""
    done, every = record.step + 1, run.recipe.training.eval_every
    due = done == run.total_steps or (every is not None and done % every == 0)
    if not due or not math.isfinite(record.loss):  # a diverged run ends; nothing worth evaluating
        return None
    trainer, error = run.trainer, None
    try:
        result = evaluate(trainer.model, run.validation, run.recipe.task, device=trainer.device,
                          meter=trainer.meter, autocast=lambda: autocast(run.recipe, trainer.device))
    except torch.OutOfMemoryError as oom:
        error = (f"evaluating on the validation split after step {record.step} ran out of memory "
                 f"({str(oom).splitlines()[0]}); raise the budget")
    error = first_error(error, trainer.world)
    if error is not None:
        return error
    record.eval_loss, record.eval_accuracy = result.loss, result.accuracy
    record.eval_ms, record.eval_peak_bytes = result.ms, result.peak_bytes
    view.message(eval_line(record.step, result))
    return None


def run_training(recipe: Recipe, *, out_dir=None, view: str = "auto", console=None,
                 recipe_name: str = "run", resume=None, save: bool = True, world: World | None = None) -> RunResult:
    """Train ``recipe`` and write ``runs/<id>/``, or continue the run directory ``resume`` from
    its checkpoint. Out of memory ends the run with status 'oom'; SIGTERM or Ctrl-C stops it after
    the current step with status 'interrupted', a checkpoint and the model saved. ``save=False``
    writes neither checkpoints nor the model (runs that are measurements). ``world``: the
    processes training together, by default torchrun's (one process without it); rank 0 alone
    writes and prints."""
    world = world or World.from_env()
    check_view(view)
    view = view if world.is_main else "none"
    if resume is None and world.is_main:
        out_dir = check_out_dir(out_dir or recipe.out_dir)  # before anything slow is built
    with (StopRequest(announce=world.is_main) as stop, process_group(world, resolve_device(recipe.device)),
          quiet_unless_main(world), contextlib.ExitStack() as locks):
        stop_with_agent()  # a SIGKILLed launcher or agent stops the ranks as SIGTERM does
        live = ProgressView(f"mimose train {Path(resume).name if resume else recipe_name} [{recipe.planner.name}]",
                            format_budget(recipe.budget, recipe.budget_bytes), recipe.budget_bytes,
                            recipe.training.log_every, view, console,
                            micro_batches=recipe.training.gradient_accumulation_steps)
        if world.distributed:
            live.setup(f"{world.size} processes: global batches of {world.size} x {recipe.training.batch_size} "
                       "examples; the table shows each step's rank with the highest peak")
        if resume is not None and world.is_main:  # before the checkpoint is read or a record cut
            locks.enter_context(RunLock(resume))
        run = _setup(recipe, out_dir, recipe_name, resume, live, world)
        if resume is None and world.is_main:
            locks.enter_context(RunLock(run.run_dir))
        if recipe.training.parallel == "ddp":  # fsdp: broadcast before sharding (``build_trainer``)
            broadcast_model(run.trainer.model, world)
        run.saves = save
        tensorboard = recipe.training.gradient_accumulation_steps if recipe.training.tensorboard else None
        writer = (RunWriter(run.run_dir, recipe_yaml(recipe), environment(run.trainer.device), tensorboard)
                  if world.is_main else SilentWriter(run.run_dir))
        if tensorboard is not None and world.is_main:
            live.setup(f"tensorboard: tensorboard --logdir {run.run_dir / TENSORBOARD_DIR}")
        if run.finish_only:
            live.message(f"{run.run_dir} trained all {run.total_steps} steps but its final save was cut: "
                         "writing the model and the summary")
        elif resume is not None:
            live.message(f"resuming {run.run_dir} at step {run.start.step} of {run.total_steps}")
        clock = time.perf_counter()
        try:
            end = LoopEnd() if run.finish_only else _train(run, writer, live, stop, clock)
        finally:
            live.close()
            writer.close()
        summary = _finish(run, end, writer, stop, time.perf_counter() - clock)
    if live.mode != "none":
        for table in summary_tables(summary) if end.records else ():  # no step, no figures
            live.console.print(table)
        if summary["status"] in ("interrupted", "failed") and run.checkpoint_step is not None:
            processes = f" --nproc-per-node {world.size}" if world.distributed else ""
            live.console.print(f"checkpoint at step {run.checkpoint_step}: continue with "
                               f"mimose train --resume {run.run_dir}{processes}", highlight=False, soft_wrap=True)
        live.console.print(f"run directory: {run.run_dir}")
    return RunResult(run.run_dir, summary, run.records + end.records)


def _finish(run: Run, end: LoopEnd, writer: RunWriter, stop: StopRequest, segment_s: float) -> dict:
    """Cleanup: the last checkpoint when the run stands at a step boundary, the planner's state
    file, the model, then summary.json (over every segment of the run). A write that fails here
    (a full disk) turns the status to 'failed'; the earlier checkpoint stays whole."""
    trainer = run.trainer
    keep = run.saves and end.status in ("completed", "interrupted") and end.at_boundary
    stats = trainer.planner.stats

    def written(action) -> bool:
        try:
            action()
            return True
        except OSError as error:
            end.status, end.error = "failed", f"writing {run.run_dir} failed: {error}"
            return False

    main = trainer.world.is_main  # the other ranks write nothing
    if keep and run.checkpoint_step != trainer.step:
        keep = written(lambda: run.save_checkpoint(segment_s))
    if main:
        written(lambda: _save_planner_state(trainer.planner, writer))
    trainer.planner.close()  # puts back the model's own forwards and config before saving it
    if is_sharded(trainer.model):  # every rank gathers, rank 0 writes
        keep = keep and written(lambda: save_sharded_model(trainer.model, run.run_dir, trainer.world)) and main
    else:
        keep = keep and main and written(lambda: save_model(trainer.model, run.run_dir))
    summary = summarize(run.records + end.records, status=end.status, budget_bytes=run.recipe.budget_bytes,
                        wall_s=run.start.wall_s + segment_s, planner_stats=stats)
    summary.update(budget=run.recipe.budget, world_size=trainer.world.size, signal=stop.signal_name,
                   checkpoint_step=run.checkpoint_step, resumed_from_steps=run.resumed_from_steps, model_dir=MODEL_DIR if keep else None)
    if run.preflight is not None:
        summary["preflight"] = asdict(run.preflight)
    if end.error is not None:
        summary["error"] = end.error
    if end.failed_rank is not None:
        summary["failed_rank"] = end.failed_rank
    if end.status == "oom" and end.error is not None:
        summary["oom_steps"] = max(summary["oom_steps"], 1)  # also when no step started
    if end.status == "diverged":
        summary["diverged_step"] = end.records[-1].step
    if not written(lambda: writer.write_json("summary.json", summary)):
        summary.update(status=end.status, error=end.error)
    return summary


def dry_run(recipe: Recipe, console=None) -> BudgetRange:
    """Build the recipe's model and measure the budgets it needs (``preflight``) without training
    or writing a run directory; prints them."""
    console = console or new_console()
    config = model_config(recipe)
    trainer = build_trainer(recipe, config, total_steps=1)
    try:
        with trainer.meter.activate():
            trainer.meter.track(trainer.model, trainer.optimizer)
            state_bytes = optimizer_state_bytes(trainer.optimizer)
            needs = preflight(trainer, config, state_bytes)
    finally:
        trainer.planner.close()
    console.print(f"{recipe.model.type} ({recipe.model.size}): {needs.describe()}", highlight=False, soft_wrap=True)
    error = budget_problem(recipe.budget_bytes, needs, recipe.budget)
    if error is not None:
        console.print(f"[red]{error}[/red]", highlight=False, soft_wrap=True)
    elif recipe.budget_bytes is not None:
        enough = needs.none_bytes is not None and recipe.budget_bytes >= needs.none_bytes
        console.print(f"budget {format_budget(recipe.budget, recipe.budget_bytes)}: fits; "
                      + ("no checkpointing needed" if enough else
                         f"the longest batches need the {recipe.planner.name} planner to save memory"),
                      highlight=False, soft_wrap=True)
    return needs


def _save_planner_state(planner, writer: RunWriter) -> None:
    """The planner's state worth keeping (Mimose: estimator.json, its fit and plan cache)."""
    if planner.state_file is not None:
        planner.save(writer.path / planner.state_file)
