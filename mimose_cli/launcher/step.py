"""One rank's training machinery: the ``Trainer`` (model, optimizer, meter, planner) built from a
recipe, and one micro-batch trained under the planner with its ``StepRecord``.

A step has no side effect on the model, optimizer or data position until ``optimizer.step()``,
so a step that runs out of memory during forward/backward can be redone on the same batch
(out-of-memory recovery builds on this). Under ``torchrun`` each rank builds its own planner and
meter for its own device (LOCAL_RANK), the budget being per device, and trains its slice of each
global batch (``distributed.py`` says how the ranks agree). ``train.py`` runs the loop around it.
"""

import contextlib
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import get_linear_schedule_with_warmup

from mimose_cli.launcher.data.loader import model_input
from mimose_cli.launcher.distributed import World, broadcast_model, data_parallel_step
from mimose_cli.launcher.failures import out_of_memory
from mimose_cli.launcher.models import build_model
from mimose_cli.launcher.recipe import Recipe
from mimose_cli.launcher.sharding import check_world, grad_scaler, is_sharded, shard
from mimose_cli.launcher.sharding import describe as describe_sharding
from mimose_cli.memory import Meter, SavedBytesCounter, build_meter, param_bytes, synchronize
from mimose_cli.planners.base import Planner, build_planner
from mimose_cli.runs.records import StepRecord, completed_step, oom_step
from mimose_cli.units import format_budget, format_bytes


def resolve_device(name: str) -> torch.device:
    """auto -> the rank's GPU when one is present, else the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; set device to cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        expandable_segments()
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def expandable_segments() -> None:
    """Let CUDA's caching allocator grow its segments in place (``expandable_segments:True``)
    unless the user configured the allocator. Shapes that change at every step fragment its
    fixed-size segments, and under the budget's cap it then frees its whole cache and synchronizes
    to retry: on an H200, Mimose's RoBERTa steps at 3.3 of a 3.7 GiB budget took 420-520 ms
    instead of 90-130 ms every other step. Read when CUDA starts, so it is set before that."""
    if not any(os.environ.get(name) for name in ALLOCATOR_SETTINGS):
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def autocast(recipe: Recipe, device: torch.device):
    """Mixed precision on the run's device: CUDA autocast on a GPU, CPU autocast on the CPU (so
    bf16 and fp16 runs are planned and tested here exactly as they run there)."""
    if recipe.training.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if recipe.training.precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


@dataclass
class Trainer:
    """Everything one run holds; ``state_dict`` of these parts is what a resume needs."""

    recipe: Recipe
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    meter: Meter
    planner: Planner
    scaler: torch.amp.GradScaler | None = None
    step: int = 0
    world: World = field(default_factory=World)

    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def forward_backward(self, batch: dict, counter: SavedBytesCounter, loss_weight: float = 1.0):
        """Planner-controlled forward and backward of one micro-batch, retried by the planner
        when it runs out of memory (``Planner.run``); no optimizer side effects. ``loss_weight``
        scales the gradient (a rank's share of a global batch, ``distributed.local_batch``)."""
        step_fn = self.step_fn(counter, loss_weight)
        loss, activation_bytes = self.planner.run(step_fn, batch)
        return loss, self.planner.last, activation_bytes

    def step_fn(self, counter: SavedBytesCounter, loss_weight: float = 1.0):
        """One micro-batch's forward (under the recipe's autocast) and backward (scaled as the
        accumulation, the rank's share and the GradScaler ask): ``step_fn(batch) -> (loss,
        activation bytes)``, what ``Planner.run`` and a planner's probe steps run."""
        accumulation = self.recipe.training.gradient_accumulation_steps

        def step_fn(batch):
            counter.reset()
            with counter, autocast(self.recipe, self.device):
                loss = self.model(**batch).loss
            activation_bytes = counter.bytes
            scaled = loss / accumulation if accumulation > 1 else loss
            if loss_weight != 1.0:
                scaled = scaled * loss_weight
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            return loss.detach(), activation_bytes

        return step_fn

    def optimizer_step(self) -> None:
        clip = self.recipe.training.max_grad_norm
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


def run_meter(recipe: Recipe, device: torch.device) -> str:
    """The meter kind for ``build_meter``: the recipe's ``meter`` on the CPU; on CUDA the caching
    allocator's (saying so when the recipe asked for a CPU meter). ``training.compile`` makes
    ``auto`` the allocator meter on the CPU."""
    if device.type != "cuda":
        # Compiled blocks run compiled only where no dispatch mode turns Dynamo off: the allocator.
        return "allocator" if recipe.meter == "auto" and recipe.training.compile else recipe.meter
    if recipe.meter != "auto":
        warnings.warn(f"meter: {recipe.meter} is ignored on {device}: a GPU's memory figures come from "
                      "its caching allocator; set meter: auto", stacklevel=2)
    return "auto"


def describe_device(device: torch.device, recipe: Recipe) -> str:
    """The device a run picked, for its first setup line."""
    budget = format_budget(recipe.budget, recipe.budget_bytes)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return f"device: {device} ({torch.cuda.get_device_name(device)}, {format_bytes(total)}), budget {budget}"
    threads = torch.get_num_threads()
    cpu = f"device: cpu, {threads} thread{'s' if threads != 1 else ''}"
    if recipe.budget_bytes is not None:
        cpu = f"{cpu}; the simulated device holds the budget {budget}"
    if offloads(recipe):
        cpu += ("; offloaded copies stay in this one memory (memcpys, counted apart as host bytes): their "
                "device bytes are exact, their time is not a GPU's")
    return cpu


def offloads(recipe: Recipe) -> bool:
    """Whether the recipe's planner may offload blocks to host memory."""
    planner = recipe.planner
    return planner.name == "offload" or (planner.name in ("mimose", "oracle")
                                         and getattr(planner, planner.name).choices == "offload")


def describe_model(model: torch.nn.Module, recipe: Recipe) -> str:
    """The model a run built, with its parameter count and size."""
    count = sum(p.numel() for p in model.parameters())
    source = recipe.model.pretrained or f"{recipe.model.type} ({recipe.model.size}) from its config, random init"
    return f"model built: {source}, {count / 1e6:.2f} M parameters ({format_bytes(param_bytes(model))} trainable)"


def build_trainer(recipe: Recipe, config, total_steps: int, world: World = World(), say=None) -> Trainer:
    """Setup: seed, device, model (of ``config``, ``models.model_config(recipe)``), optimizer, meter,
    planner (each rank its own, the same seed); ``say(line)`` hears each phase."""
    say = say or (lambda line: None)
    device = resolve_device(recipe.device)
    if device.type == "cpu" and recipe.training.cpu_threads is not None:
        torch.set_num_threads(recipe.training.cpu_threads)
    say(describe_device(device, recipe))
    torch.manual_seed(recipe.seed)
    model = build_model(recipe, config).to(device)
    model.train()
    say(describe_model(model, recipe))
    blocks = recipe.model.blocks
    if recipe.training.parallel == "fsdp":  # before the optimizer and the planner: they take the shards
        check_world(world.size)
        broadcast_model(model, world)
        blocks = shard(model, recipe, device, world.size)
        say(describe_sharding(model, blocks, world.size))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.training.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=recipe.training.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, recipe.training.warmup_steps, total_steps)
    meter = build_meter(run_meter(recipe, device), recipe.budget_bytes, device)
    planner = build_planner(
        recipe.planner.name, model, recipe.budget_bytes, blocks=blocks,
        safety_margin=recipe.planner.safety_margin_bytes, meter=meter, compile=recipe.training.compile,
        **recipe.planner.keywords)
    scaler = grad_scaler(device, sharded=recipe.training.parallel == "fsdp") if (
        recipe.training.precision == "fp16") else None
    return Trainer(recipe, device, model, optimizer, scheduler, meter, planner, scaler, world=world)


def train_step(trainer: Trainer, batch: dict, counter: SavedBytesCounter, micro_step: int = 0,
               loss_weight: float = 1.0) -> StepRecord:
    """One micro-batch's forward and backward, and the optimizer step after the last micro-batch
    of ``training.gradient_accumulation_steps`` (under torchrun the ranks step together after it:
    ``distributed.data_parallel_step``); returns its record. Raises torch.OutOfMemoryError
    (``PlanOutOfMemoryError`` once the planner's retries are spent)."""
    batch = trainer.to_device(batch)
    trainer.meter.track(batch)
    synchronize(trainer.device)
    start = time.perf_counter()
    last_micro = micro_step == trainer.recipe.training.gradient_accumulation_steps - 1
    steps = last_micro and not trainer.world.distributed
    lr = trainer.scheduler.get_last_lr()[0]  # the rate this step's update uses
    with trainer.meter.step() as mem:
        loss, info, activation_bytes = trainer.forward_backward(batch, counter, loss_weight)
        planned_peak = trainer.meter.peak_bytes()  # what the planner plans for: before the optimizer
        if steps:
            trainer.optimizer_step()
    synchronize(trainer.device)
    iter_ms = (time.perf_counter() - start) * 1e3
    return completed_step(
        info, step=trainer.step, micro_step=micro_step, input_shape=model_input(batch).shape,
        num_blocks=trainer.planner.num_blocks, loss=loss.item(), lr=lr, iter_ms=iter_ms,
        peak_bytes=mem.peak_bytes, fwd_bwd_peak_bytes=planned_peak, start_bytes=mem.start_bytes,
        activation_bytes=activation_bytes,
        reserved_peak_bytes=mem.reserved_peak_bytes if trainer.device.type == "cuda" else None,
        host_peak_bytes=mem.peak_host_bytes)


def _oom_record(trainer: Trainer, batch: dict, error: Exception, micro_step: int = 0) -> StepRecord:
    """Record a step that ran out of memory for good, and drop its partial gradients."""
    trainer.optimizer.zero_grad(set_to_none=True)
    return oom_step(trainer.planner.last, error, step=trainer.step, micro_step=micro_step,
                    input_shape=model_input(batch).shape, num_blocks=trainer.planner.num_blocks,
                    peak_bytes=trainer.meter.peak_bytes())


def micro_batch(trainer: Trainer, batch: dict, counter: SavedBytesCounter, micro_step: int) -> StepRecord:
    """One micro-batch trained, and its record (out of memory included); under torchrun every
    rank trains its slice and gets the ranks' records merged (the same on every rank)."""
    def run(part: dict, loss_weight: float = 1.0) -> StepRecord:
        try:
            return train_step(trainer, part, counter, micro_step, loss_weight)
        except torch.OutOfMemoryError as error:
            if trainer.world.distributed and is_sharded(trainer.model):
                # The peers wait inside this step's collectives: no retry, no further collective;
                # every rank stops (failures.py).
                info = trainer.planner.last
                size = info.input_size if info is not None else model_input(part).shape
                raise out_of_memory(trainer.world.rank, trainer.step, micro_step, size, error) from None
            return _oom_record(trainer, part, error, micro_step)

    if not trainer.world.distributed:
        return run(batch)
    last_micro = micro_step == trainer.recipe.training.gradient_accumulation_steps - 1
    return data_parallel_step(trainer, batch, last_micro, run)
