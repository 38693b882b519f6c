"""Data-parallel training over ``torchrun``'s processes: one process (rank) per device, each
planning its own micro-batches under the per-device budget, gradients averaged once per
optimizer step.

Why not torch's ``DistributedDataParallel`` module: its reducer all-reduces gradient buckets
*during* backward, and a planner retries a backward that ran out of memory (``Planner.run``), so a
retrying rank would issue the same bucket's all-reduce again while the others wait on the next:
the collectives no longer match and the run hangs. Under ``no_sync()`` the reducer stays out of
the way, but it still holds buckets as large as all the gradients (device memory the budget
would lose for nothing). So we do DDP's two jobs ourselves, where a retry cannot reach them:
rank 0's parameters and buffers are broadcast once at the start (as DDP's constructor does), and
after every rank's micro-batches of a step finished and all agreed to step, each gradient is
all-reduced in place (no extra device memory) and divided by the number of ranks. The optimizer
step then runs on identical gradients, so the ranks' weights stay identical without further
communication. Buffers a forward updates (BatchNorm's running statistics) stay per rank, as
DDP's ``broadcast_buffers=False``; transformers have none.

Data: every rank builds the same seeded order of *global* batches (``batch_size`` x world size
examples, padded together) and trains on its slice (``local_batch``), so a one-process run with
the global batch size sees exactly the same batches. A rank's loss is weighted by its share of the
global batch, so the averaged gradient (and the recorded loss, the weighted mean of the ranks')
equals the one-process run's for losses that are a mean over examples.

Under ``training.parallel=fsdp`` (``sharding.py``) the same loop runs, with the data sliced and the
losses weighted the same way, each rank's rows padded only to their own longest (``own_padding``:
the collectives are over parameters, not activations, so the ranks' shapes may differ, and each
rank plans its own input size), but FSDP reduce-scatters each block's gradient in backward, averaged
over the ranks (its default divide factor, the world size), so ``average_gradients`` is not
called. There no rank may run a backward alone: a retry would gather and reduce-scatter while the
others wait elsewhere.

Every function here is the identity (or nothing) for one process.
"""

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimose_cli.launcher.sharding import is_sharded
from mimose_cli.memory import synchronize
from mimose_cli.runs.records import StepRecord, merge_ranks

OK, NOT_FINITE, OUT_OF_MEMORY = 0, 1, 2
"""A rank's micro-batch status; the ranks agree on the worst (the highest)."""


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (torchrun's environment)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def from_env(cls) -> "World":
        """The world torchrun set up (``RANK``, ``WORLD_SIZE``; the device comes from
        ``LOCAL_RANK``, ``step.resolve_device``); one process without it."""
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run directory and prints."""
        return self.rank == 0


def backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(world: World, device: torch.device):
    """Join the other ranks for the duration (``init_process_group`` / ``destroy_process_group``);
    nothing for one process."""
    if not world.distributed:
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the objects collectives pickle go to this rank's GPU
    dist.init_process_group(backend(device), rank=world.rank, world_size=world.size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def quiet_unless_main(world: World):
    """Warnings silenced on ranks other than 0 for the duration: N copies of the same line say
    nothing more (each rank's phases and retries are in rank 0's records)."""
    with warnings.catch_warnings():
        if not world.is_main:
            warnings.simplefilter("ignore")
        yield


def local_batch(batch: dict, world: World) -> tuple[dict, float]:
    """This rank's rows of a global batch and its loss weight: the rows are split as evenly as
    they go (``tensor_split``), and the weight (rows x world size / global rows; 1.0 when every
    rank has as many) makes the ranks' averaged gradient the global batch's mean."""
    if not world.distributed:
        return batch, 1.0
    rows = len(next(iter(batch.values())))
    part = {key: value.tensor_split(world.size)[world.rank].clone() for key, value in batch.items()}
    mine = len(next(iter(part.values())))
    return part, mine * world.size / rows


def own_padding(part: dict) -> dict:
    """A rank's rows (``local_batch``) padded only to their own longest: the columns no row of
    theirs uses (``attention_mask`` 0 throughout, on the padded side) cut off every tensor of the
    mask's shape (ids, token types, a causal LM's labels); with left padding, the answer positions
    move with the tokens. The model computes the same for each row: a padded position is masked.
    Images, without a mask, stay as the global batch padded them."""
    mask = part.get("attention_mask")
    if mask is None:
        return part
    used = mask.reshape(-1, mask.shape[-1]).any(0).nonzero().flatten().tolist()
    if not used:
        return part
    first, last = used[0], used[-1] + 1
    trimmed = {key: value[..., first:last] if value.shape == mask.shape else value for key, value in part.items()}
    for key in ("start_positions", "end_positions"):  # question answering's token indices
        if key in trimmed and first:
            trimmed[key] = trimmed[key] - first
    return trimmed


def _tensor(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def worst(code: int, world: World, device: torch.device) -> int:
    """The highest of every rank's ``code`` (a status, or a flag as 0/1)."""
    if not world.distributed:
        return code
    value = _tensor([code], device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def any_rank(flag: bool, world: World, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank (a stop request: every rank stops at the same step)."""
    return bool(worst(int(flag), world, device))


def all_ranks(value, world: World) -> list:
    """Every rank's ``value`` (small, picklable), in rank order, on every rank."""
    if not world.distributed:
        return [value]
    values = [None] * world.size
    dist.all_gather_object(values, value)
    return values


def from_main(value, world: World):
    """Rank 0's ``value`` on every rank (the run directory rank 0 created)."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_model(model: torch.nn.Module, world: World) -> None:
    """Rank 0's parameters and buffers on every rank, in place (what DDP's constructor does)."""
    if not world.distributed:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


def average_gradients(model: torch.nn.Module, world: World) -> None:
    """Replace every gradient by its mean over the ranks, in place. A parameter without a gradient
    on this rank but with one on another (a branch this rank's data did not take) takes zeros,
    so every rank all-reduces the same tensors in the same order."""
    if not world.distributed:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    grads = []
    for param, needed in zip(params, has_grad.tolist()):
        if needed and param.grad is None:
            param.grad = torch.zeros_like(param)
        if needed:
            grads.append(param.grad)
    pending = [dist.all_reduce(grad, async_op=True) for grad in grads]
    for work, grad in zip(pending, grads):
        work.wait()
        grad.div_(world.size)


def first_error(error: str | None, world: World) -> str | None:
    """The first rank's error, naming the rank, on every rank: one rank that cannot go on (a
    budget its device cannot hold) stops them all."""
    if not world.distributed:
        return error
    return next((f"rank {rank}: {e}" for rank, e in enumerate(all_ranks(error, world)) if e is not None), None)


class SilentWriter:
    """What a rank other than 0 holds in place of a ``RunWriter``: rank 0 alone writes the run
    directory (every rank's figures are in its records)."""

    def __init__(self, path):
        self.path = path

    def metric(self, record) -> None:
        pass

    def plan(self, record) -> None:
        pass

    def write_json(self, name: str, data) -> None:
        pass

    def close(self) -> None:
        pass


def _status(record: StepRecord) -> int:
    if record.oom:
        return OUT_OF_MEMORY
    return OK if math.isfinite(record.loss) else NOT_FINITE


def data_parallel_step(trainer, batch: dict, last_micro: bool, run_local) -> StepRecord:
    """One global micro-batch on every rank: ``run_local(part, loss_weight)`` trains this rank's
    slice (retrying it alone when it runs out of memory: nothing is communicated meanwhile) and
    returns its record; after the last micro-batch of a step, if every rank's finished with a
    finite loss, the gradients are averaged and the optimizer steps, measured into this rank's
    record. Returns the ranks' records merged (``records.merge_ranks``), the same on every rank."""
    world = trainer.world
    part, weight = local_batch(batch, world)
    if is_sharded(trainer.model):  # FSDP's collectives are over parameters: the ranks' shapes may differ
        part = own_padding(part)
    record = run_local(part, weight)
    if last_micro and worst(_status(record), world, trainer.device) == OK:
        _step_optimizer(trainer, record)
    return merge_ranks(all_ranks(record, world))


def _step_optimizer(trainer, record: StepRecord) -> None:
    """Average the gradients and step the optimizer; its time and peak go into ``record`` (as a
    one-process step's include them). Out of memory here (the optimizer's first step allocating
    its state) makes the record out of memory."""
    synchronize(trainer.device)
    start = time.perf_counter()
    try:
        with trainer.meter.step() as mem:
            if not is_sharded(trainer.model):  # FSDP reduce-scattered them in backward already
                average_gradients(trainer.model, trainer.world)
            trainer.optimizer_step()
    except torch.OutOfMemoryError as error:
        trainer.optimizer.zero_grad(set_to_none=True)
        record.oom, record.error = True, str(error).splitlines()[0]
    synchronize(trainer.device)
    record.iter_ms += (time.perf_counter() - start) * 1e3
    record.peak_bytes = max(record.peak_bytes, mem.peak_bytes)
